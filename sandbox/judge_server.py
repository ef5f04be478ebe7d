"""A fork server for judges: each evaluation's judge is a fresh process, forked from one that has
already imported torch, Triton and the judge's code.

Importing those costs a judge three to five seconds of CPU before it does anything, which on a
busy host (a campaign's parallel evaluations, a CI machine) is most of an evaluation's CPU, and on
a GPU host most of a judge's start-up. The server is started the way a judge was (`python -P`,
with the judge's environment) and never initialises CUDA, reads no candidate and holds no GPU;
it is trusted code like the judge. For each evaluation the backend connects to its Unix socket
(in a folder only this user can enter) and sends the judge's arguments; the server forks a child
that starts a new session, dies with the server, writes to the evaluation's judge log and runs
`sandbox.judge.main` exactly as `python -m sandbox.judge` would. The server answers the child's
pid, and its exit status once it has reaped it.

What holds, whatever a client does:
- A judge lives as long as its connection: the backend's `kill` (or its hanging up) makes the
  server kill the judge, which only the server can do safely, since until it reaps the judge its
  pid cannot name another process.
- No connection can stop the server: a client that hangs up, floods or sends garbage loses only
  its own connection (and its judge).
- Servers are keyed by the judge environment, and a server whose code changed on disk (a file
  of this checkout that it imported) is replaced before its next judge: a judge always runs the
  code a fresh `python -m sandbox.judge` would. Plug-in ops (RECFORGE_OPS) are imported by each
  judge, never by the server.
- A server belongs to the process that started it: it ends when that process ends (killing its
  judges and removing its folder), and a forked child of that process neither uses nor stops it.

RECFORGE_JUDGE_SERVER=0 starts each judge with `python -m sandbox.judge` instead; =1 or unset
uses the server.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

START_TIMEOUT_S = 120.0  # the server's imports, on a loaded host
MAX_IDLE = 1  # servers kept without a running judge, besides the one in use
MAX_REQUEST_BYTES = 1 << 20  # a request is a few hundred bytes of JSON
ENV_SWITCH = "RECFORGE_JUDGE_SERVER"
CHECKOUT = Path(__file__).resolve().parents[1]
# The modules every judge imports, imported once by the server, with this repository's own
# problems; plug-in ops' modules (RECFORGE_OPS) may change between evaluations, so each judge
# imports those itself.
PRELOAD = ("torch", "triton", "triton.language", "sandbox.judge")


class ServerUnavailable(RuntimeError):
    """The fork server did not start or stopped answering; the caller starts a plain judge."""


def enabled() -> bool:
    """RECFORGE_JUDGE_SERVER=0 turns the server off; otherwise judges are forked from it."""
    return os.environ.get(ENV_SWITCH) != "0"


# --- the server -----------------------------------------------------------------------------------


def _preload() -> list[list]:
    """Import what every judge imports; returns [path, mtime_ns, size] of each file of this
    checkout that is now imported, which the client watches for changes."""
    # torch.cuda.is_available() through the CUDA runtime initialises the driver, which a forked
    # child cannot use; through NVML it does not. The server must leave CUDA to each judge.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from search_space import problem as registry

    for name in registry.builtin_problem_names():
        registry.get_problem(name)
    import torch

    if torch.cuda.is_initialized():  # a forked child could not use the GPU
        raise RuntimeError("the judge server initialised CUDA while importing")
    return code_files()


def code_files() -> list[list]:
    """[path, mtime_ns, size] of every imported module file inside this checkout."""
    files = []
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path:
            continue
        with contextlib.suppress(OSError, ValueError):
            resolved = Path(path).resolve()
            if resolved.is_relative_to(CHECKOUT):
                st = resolved.stat()
                files.append([str(resolved), st.st_mtime_ns, st.st_size])
    return sorted(files)


def _child(request: dict, server_pid: int, closing: list[int]) -> None:
    """In the forked child: become the judge of one evaluation. Never returns."""
    code = 1
    try:
        os.setsid()  # its own session and process group: the backend kills it and its runner so
        from sandbox.confine import die_with_parent

        die_with_parent(server_pid)  # the pid read before the fork: a server gone already ends it
        for fd in closing:
            with contextlib.suppress(OSError):
                os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115  (the process's own)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(request["cwd"])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter leaves it
        from sandbox import judge

        sys.argv = ["sandbox.judge", *request["argv"]]
        code = judge.main(list(request["argv"]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _kill_judge(pid: int) -> None:
    """Only for a judge not yet reaped: its pid (and group id) are still its own."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _request(data: bytes) -> dict:
    request = json.loads(data)
    if not (
        isinstance(request, dict)
        and isinstance(request.get("argv"), list)
        and all(isinstance(a, str) for a in request["argv"])
        and isinstance(request.get("cwd"), str)
        and isinstance(request.get("log"), str)
    ):
        raise ValueError("a request is {argv: [str], cwd: str, log: str}")
    return request


def serve(socket_path: str, owner: int) -> None:
    """Accept requests on `socket_path` until `owner` (the backend's process) ends."""
    files = _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    os.chmod(socket_path, 0o600)
    listener.listen(64)
    listener.setblocking(False)
    selector = selectors.DefaultSelector()  # epoll: no limit on descriptor numbers
    selector.register(listener, selectors.EVENT_READ)
    requests: dict[socket.socket, bytes] = {}  # connections whose request is still arriving
    judges: dict[socket.socket, int] = {}  # connection -> the judge it waits for
    orphans: set[int] = set()  # judges whose connection went (killed; reaped when they end)
    print("ready " + json.dumps(files), flush=True)

    def drop(conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            selector.unregister(conn)
        requests.pop(conn, None)
        pid = judges.pop(conn, None)
        if pid is not None:  # nobody waits for this judge any more: it ends
            _kill_judge(pid)
            orphans.add(pid)
        conn.close()

    def send(conn: socket.socket, data: bytes) -> bool:
        try:
            return conn.send(data) == len(data)  # a few bytes: they fit, or the client is gone
        except OSError:
            return False

    while True:
        if os.getppid() != owner:  # the backend's process ended: so do its judges
            for pid in [*judges.values(), *orphans]:
                _kill_judge(pid)
            shutil.rmtree(Path(socket_path).parent, ignore_errors=True)
            return
        for key, _ in selector.select(0.05):
            conn = key.fileobj
            if conn is listener:
                try:
                    conn, _ = listener.accept()
                except OSError:  # out of descriptors, or the client gave up: later
                    continue
                conn.setblocking(False)
                selector.register(conn, selectors.EVENT_READ)
                requests[conn] = b""
                continue
            try:
                chunk = conn.recv(1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if conn in judges:  # "kill", or hanging up: either way its judge ends
                if not chunk or chunk.startswith(b"kill"):
                    drop(conn)
                continue
            if not chunk:
                drop(conn)
                continue
            data = requests[conn] = requests[conn] + chunk
            if len(data) > MAX_REQUEST_BYTES:
                send(conn, b"error request too long\n")
                drop(conn)
                continue
            if not data.endswith(b"\n"):
                continue
            del requests[conn]
            try:
                request = _request(data)
            except ValueError as exc:
                send(conn, f"error {type(exc).__name__}: {exc}\n".encode())
                drop(conn)
                continue
            me = os.getpid()
            closing = [listener.fileno(), selector.fileno(), conn.fileno()]
            closing += [c.fileno() for c in (*requests, *judges)]
            try:
                pid = os.fork()
            except OSError as exc:
                send(conn, f"error {type(exc).__name__}: {exc}\n".encode())
                drop(conn)
                continue
            if pid == 0:
                _child(request, me, closing)
            judges[conn] = pid
            if not send(conn, f"pid {pid}\n".encode()):
                drop(conn)  # the client went: its judge goes too
        while judges or orphans:  # reap the judges that ended, and say how
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            orphans.discard(pid)
            for conn, judge_pid in list(judges.items()):
                if judge_pid == pid:
                    del judges[conn]
                    send(conn, f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                    with contextlib.suppress(KeyError, ValueError, OSError):
                        selector.unregister(conn)
                    conn.close()


# --- the client -----------------------------------------------------------------------------------


class Judge:
    """One judge forked by the server: `pid` leads its own process group."""

    def __init__(self, conn: socket.socket, pid: int, server: Server) -> None:
        self._server = server
        self._conn = conn
        self._buffer = b""
        self.pid = pid
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code (negative: the signal that ended it); TimeoutError after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None and not self._buffer.endswith(b"\n"):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"judge {self.pid} still running")
            self._conn.settimeout(left)
            try:
                chunk = self._conn.recv(4096)
            except TimeoutError:
                raise TimeoutError(f"judge {self.pid} still running") from None
            except OSError:
                chunk = b""
            if not chunk:  # the server died: its judges died with it
                self.returncode = -int(signal.SIGKILL)
                break
            self._buffer += chunk
        if self.returncode is None:
            kind, _, value = self._buffer.decode(errors="replace").strip().partition(" ")
            self.returncode = int(value) if kind == "exit" and value.lstrip("-").isdigit() else 1
        self._conn.close()
        self._server.ended(self)
        return self.returncode

    def kill(self) -> None:
        """End the judge, unless it has ended: the server kills it (and with it its runner,
        which dies with its judge) only while it is unreaped, so no other process is hit."""
        if self.returncode is not None:
            return
        with contextlib.suppress(OSError):
            self._conn.sendall(b"kill\n")


class Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.owner = os.getpid()
        self.folder = Path(tempfile.mkdtemp(prefix="recforge-judges-"))  # 0700: this user's alone
        self.socket_path = str(self.folder / "judges.sock")
        self.log_path = self.folder / "server.log"
        self.running: set[int] = set()  # its judges still running: it is not stopped under them
        self.files: list[list] = []  # [path, mtime_ns, size] of the checkout's files it imported
        code = "import sys; from sandbox.judge_server import serve; serve(sys.argv[1], int(sys.argv[2]))"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-c", code, self.socket_path, str(os.getpid())],
                cwd=self.folder, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                start_new_session=True,
            )  # fmt: skip
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else b""
        word, _, files = line.partition(b" ")
        if word.strip() != b"ready":
            code = self.proc.poll()
            said = self._log_tail()  # read before stop() removes the folder
            self.stop()
            how = f"it exited with {code}" if code is not None else f"no answer in {START_TIMEOUT_S:.0f} s"
            raise ServerUnavailable(f"the judge server did not start ({how}): {said}")
        self.files = json.loads(files)

    def ended(self, judge: Judge) -> None:
        with _lock:
            self.running.discard(judge.pid)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:] or "(no output)"
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stale(self) -> bool:
        """Whether a file of this checkout that the server imported changed since."""
        for path, mtime_ns, size in self.files:
            try:
                st = os.stat(path)
            except OSError:
                return True
            if (st.st_mtime_ns, st.st_size) != (mtime_ns, size):
                return True
        return False

    def start(self, argv: list[str], cwd: Path, log: Path) -> Judge:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(60)
            conn.connect(self.socket_path)
            conn.sendall(json.dumps({"argv": argv, "cwd": str(cwd), "log": str(log)}).encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                reply += chunk
        except OSError as exc:
            conn.close()
            raise ServerUnavailable(f"the judge server did not answer: {exc}") from None
        first, _, rest = reply.partition(b"\n")
        kind, _, value = first.decode(errors="replace").partition(" ")
        if kind != "pid" or not value.isdigit():
            conn.close()
            raise ServerUnavailable(f"the judge server refused: {first.decode(errors='replace')}")
        judge = Judge(conn, int(value), self)
        with _lock:
            self.running.add(judge.pid)
        judge._buffer = rest  # its exit status, if it ended already
        return judge

    def stop(self) -> None:
        """Kill the server (and so its judges) and remove its folder; only its owner does."""
        if self.owner != os.getpid():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_servers: dict[tuple, Server] = {}
_retired: list[Server] = []  # replaced (stale code) while judges still ran on them
_lock = threading.RLock()


def _sweep() -> None:
    for server in list(_retired):
        if not server.running:
            _retired.remove(server)
            server.stop()


def server_for(env: dict[str, str]) -> Server:
    """The running server of judges with environment `env` (started on first use, and again
    when the code it imported changed)."""
    key = (sys.executable, tuple(sorted(env.items())))
    with _lock:
        _sweep()
        server = _servers.get(key)
        if server is not None and (not server.alive() or server.stale()):
            del _servers[key]
            _retired.append(server)
            _sweep()
            server = None
        if server is None:
            server = _servers[key] = Server(env)
            # A server holds a few hundred MB: beyond MAX_IDLE others, stop those with no judges.
            idle = [k for k, s in _servers.items() if k != key and not s.running]
            for k in idle[: max(0, len(idle) - MAX_IDLE)]:
                _servers.pop(k).stop()
        return server


def start_judge(env: dict[str, str], argv: list[str], cwd: Path, log: Path) -> Judge:
    """A judge of environment `env` running `sandbox.judge.main(argv)` in `cwd`, writing to `log`
    (its server is not stopped between being chosen and the judge being counted on it)."""
    with _lock:
        return server_for(env).start(argv, cwd, log)


def _forget_in_child() -> None:
    # A forked copy of the backend's process neither uses nor stops its parent's servers.
    global _lock
    _lock = threading.RLock()
    _servers.clear()
    _retired.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _stop_all() -> None:
    for server in [*_servers.values(), *_retired]:
        server.stop()
    _servers.clear()
    _retired.clear()
