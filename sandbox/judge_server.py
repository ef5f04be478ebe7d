"""A fork server for judges: each evaluation's judge is a fresh process, forked from one that has
already imported torch, Triton and the judge's code.

Importing those costs a judge three or four seconds of CPU before it does anything, which on a
busy host (a campaign's parallel evaluations, a CI machine) is most of an evaluation's CPU. The
server is started the way a judge was (`python -P -m sandbox.judge_server`, with the judge's
environment) and never initialises CUDA, reads no candidate and holds no GPU; it is trusted code
like the judge. For each evaluation the backend connects to its Unix socket (in a folder only
this user can enter) and sends the judge's arguments; the server forks a child that starts a new
session, dies with the server, writes to the evaluation's judge log and runs `sandbox.judge.main`
exactly as `python -m sandbox.judge` would. The server answers the child's pid, and its exit
status once it has reaped it. The server exits when the process that started it ends, killing
the judges it forked; servers are keyed by the judge environment, so a changed environment
(another RECFORGE_OPS, GPUs or interpreter setting) gets a server of its own.

RECFORGE_JUDGE_SERVER=0 starts each judge with `python -m sandbox.judge` instead, =1 uses the
server; unset, it is used where there is no GPU (see `enabled`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
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
ENV_SWITCH = "RECFORGE_JUDGE_SERVER"
# The modules every judge imports: the server imports them once. Only this repository's own
# problems: plug-in ops' modules (RECFORGE_OPS) may change between evaluations, so each judge
# imports those itself.
PRELOAD = ("torch", "triton", "triton.language", "sandbox.judge")


class ServerUnavailable(RuntimeError):
    """The fork server did not start or stopped answering; the caller starts a plain judge."""


def enabled() -> bool:
    """RECFORGE_JUDGE_SERVER=1 or 0 decides; unset, the server is used on hosts without a GPU
    (on a GPU host judges start on their own until forked judges are shown to use CUDA there)."""
    setting = os.environ.get(ENV_SWITCH)
    if setting is not None:
        return setting != "0"
    from sandbox.hardware import cuda_present

    return not cuda_present()


# --- the server -----------------------------------------------------------------------------------


def _preload() -> None:
    # torch.cuda.is_available() through the CUDA runtime initialises the driver, which a forked
    # child cannot use; through NVML it does not. The server must leave CUDA to each judge.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from search_space import problem as registry

    for name in registry.problem_names():
        if registry._builtin(name) is not None:
            registry.get_problem(name)
    import torch

    if torch.cuda.is_initialized():  # a forked child could not use the GPU
        raise RuntimeError("the judge server initialised CUDA while importing")


def _child(request: dict, server_pid: int, closing: list[int]) -> None:
    """In the forked child: become the judge of one evaluation. Never returns."""
    code = 1
    try:
        os.setsid()  # its own session and process group: the backend kills it and its runner so
        from sandbox.confine import die_with_parent

        die_with_parent(server_pid)
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


def serve(socket_path: str, owner: int) -> None:
    """Accept requests on `socket_path` until `owner` (the backend's process) ends."""
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    os.chmod(socket_path, 0o600)
    listener.listen(64)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}  # judge pid -> the connection awaiting its exit status
    pending: dict[socket.socket, bytes] = {}  # connections whose request is still arriving
    while True:
        if os.getppid() != owner:  # the backend's process ended: so do its judges
            for pid in waiting:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            return
        ready, _, _ = select.select([listener, *pending], [], [], 0.05)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                pending[conn] = b""
                continue
            chunk = sock.recv(1 << 16)
            pending[sock] += chunk
            if chunk and not pending[sock].endswith(b"\n"):
                continue
            data = pending.pop(sock)
            try:
                request = json.loads(data)
                pid = os.fork()
            except (ValueError, OSError) as exc:
                with contextlib.suppress(OSError):
                    sock.sendall(f"error {type(exc).__name__}: {exc}\n".encode())
                sock.close()
                continue
            if pid == 0:
                fds = [listener.fileno(), *(s.fileno() for s in (*pending, *waiting.values())), sock.fileno()]
                _child(request, os.getppid(), fds)
            sock.sendall(f"pid {pid}\n".encode())
            waiting[pid] = sock
        while waiting:  # reap the judges that ended, and say how
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
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
        if self._buffer.endswith(b"\n"):
            self.returncode = int(self._buffer.split()[1])
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"judge {self.pid} still running")
            self._conn.settimeout(left)
            try:
                chunk = self._conn.recv(4096)
            except TimeoutError:
                raise TimeoutError(f"judge {self.pid} still running") from None
            if not chunk:  # the server died: its judges died with it
                self.returncode = -int(signal.SIGKILL)
                break
            self._buffer += chunk
            if self._buffer.endswith(b"\n"):
                self.returncode = int(self._buffer.split()[1])
                break
        self._conn.close()
        self._server.ended(self)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL to its process group (the judge and the bubblewrap of its runner)."""
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(self.pid, signal.SIGKILL)


class Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="recforge-judges-"))  # 0700: this user's alone
        self.socket_path = str(self.folder / "judges.sock")
        self.log_path = self.folder / "server.log"
        self.running: set[int] = set()  # its judges still running: it is not stopped under them
        code = "import sys; from sandbox.judge_server import serve; serve(sys.argv[1], int(sys.argv[2]))"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-c", code, self.socket_path, str(os.getpid())],
                cwd=self.folder, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                start_new_session=True,
            )  # fmt: skip
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            code = self.proc.poll()
            said = self._log_tail()  # read before stop() removes the folder
            self.stop()
            how = f"it exited with {code}" if code is not None else f"no answer in {START_TIMEOUT_S:.0f} s"
            raise ServerUnavailable(f"the judge server did not start ({how}): {said}")

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
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_servers: dict[tuple, Server] = {}
_lock = threading.RLock()


def server_for(env: dict[str, str]) -> Server:
    """The running server of judges with environment `env` (started on first use)."""
    key = (sys.executable, tuple(sorted(env.items())))
    with _lock:
        server = _servers.get(key)
        if server is None or not server.alive():
            if server is not None:
                server.stop()
            server = _servers[key] = Server(env)
            # A server holds a few hundred MB: beyond MAX_IDLE others, stop those with no judges.
            idle = [k for k, s in _servers.items() if k != key and not s.running]
            for k in idle[: max(0, len(idle) - MAX_IDLE)]:
                _servers.pop(k).stop()
        return server


@atexit.register
def _stop_all() -> None:
    for server in list(_servers.values()):
        server.stop()
    _servers.clear()
