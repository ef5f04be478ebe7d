"""The judge fork server: judges forked from it run as `python -m sandbox.judge` would, each in a
session of its own; it answers bad requests with an error and goes on; it ends with the process
that started it; without it (switched off, or failing to start) judges start on their own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from sandbox import Candidate, LocalBackend, Status, judge_server
from search_space.embedding_bag import TEMPLATE

ROOT = Path(__file__).resolve().parents[2]
RAISING = TEMPLATE.render({}) + "\nraise RuntimeError('gave up at import')\n"


def _env() -> dict[str, str]:
    return LocalBackend(timeout_s=60, isolation="none")._env()


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _alive(pid: int, started: str | None = None) -> bool:
    """Whether `pid` runs (not a zombie), and is the process that started at `started` (clock
    ticks since boot, /proc's field 22) when given: a busy host reuses pids within seconds."""
    fields = _stat(pid)
    if fields is None or fields[0] == "Z":
        return False
    return started is None or fields[19] == started


def _started(pid: int) -> str:
    fields = _stat(pid)
    assert fields is not None, f"{pid} is not running"
    return fields[19]


def test_a_forked_judge_leads_its_own_session_and_reports_its_exit(tmp_path: Path) -> None:
    server = judge_server.server_for(_env())
    # No request file: the judge fails as `python -m sandbox.judge` would, with a traceback.
    judge = server.start(
        [str(tmp_path / "absent.json"), str(tmp_path / "result.json")], tmp_path, tmp_path / "log"
    )
    assert judge.wait(timeout=60) == 1
    assert "FileNotFoundError" in (tmp_path / "log").read_text()
    assert judge.pid not in server.running
    # The server answers a request it cannot read with an error, and serves the next one.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(server.socket_path)
        conn.sendall(b"{not json\n")
        assert conn.recv(4096).startswith(b"error JSONDecodeError")
    again = server.start(
        [str(tmp_path / "absent.json"), str(tmp_path / "r.json")], tmp_path, tmp_path / "log2"
    )
    assert again.wait(timeout=60) == 1 and again.pid != judge.pid
    assert judge_server.server_for(_env()) is server  # one server per judge environment


@pytest.mark.slow
def test_the_server_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "from sandbox import judge_server\n"
        "server = judge_server.server_for(dict(os.environ))\n"
        "started = open(f'/proc/{server.proc.pid}/stat').read().rpartition(')')[2].split()[19]\n"
        "print(server.proc.pid, started, server.folder, flush=True)\n"
        "os._exit(0)\n"  # no atexit: only the server's own watch can end it
    )
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    pid, started, folder = done.stdout.split()
    deadline = time.monotonic() + 10
    while _alive(int(pid), started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(int(pid), started)
    folder = Path(folder)
    deadline = time.monotonic() + 10
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not folder.exists()  # its socket and log go with it


@pytest.mark.slow
def test_idle_servers_of_other_environments_are_stopped(monkeypatch) -> None:
    monkeypatch.setattr(judge_server, "MAX_IDLE", 0)
    first = judge_server.server_for({**_env(), "RECFORGE_TEST_ENV": "1"})
    second = judge_server.server_for({**_env(), "RECFORGE_TEST_ENV": "2"})
    assert first.socket_path != second.socket_path and second.alive()
    assert not first.alive() and not first.folder.exists()
    assert judge_server.server_for({**_env(), "RECFORGE_TEST_ENV": "2"}) is second


@pytest.mark.parametrize("how", ["switched off", "failing to start"])
@pytest.mark.slow
def test_without_the_server_judges_start_on_their_own(tmp_path: Path, monkeypatch, how: str) -> None:
    if how == "switched off":
        monkeypatch.setenv(judge_server.ENV_SWITCH, "0")
    else:
        monkeypatch.setenv(judge_server.ENV_SWITCH, "1")

        def refuse(self, env):
            raise judge_server.ServerUnavailable("the judge server did not start: (test)")

        monkeypatch.setattr(judge_server.Server, "__init__", refuse)
        monkeypatch.setattr(judge_server, "_servers", {})
    candidate = Candidate(problem="embedding_bag", source=RAISING, entry=TEMPLATE.entry)
    backend = LocalBackend(timeout_s=60, isolation="none", scratch_root=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = backend.evaluate(candidate, timing=False)
    assert result.status == Status.COMPILE_ERROR, result.message
    assert "gave up at import" in result.message
    said = [str(w.message) for w in caught if "starts on its own" in str(w.message)]
    assert said == (
        ["the judge server did not start: (test); this judge starts on its own"]
        if how == "failing to start"
        else []
    )


def test_the_server_is_used_unless_switched_off(monkeypatch) -> None:
    monkeypatch.delenv(judge_server.ENV_SWITCH, raising=False)
    assert judge_server.enabled()
    monkeypatch.setenv(judge_server.ENV_SWITCH, "1")
    assert judge_server.enabled()
    monkeypatch.setenv(judge_server.ENV_SWITCH, "0")
    assert not judge_server.enabled()


def _sleeper(tmp_path: Path, name: str, env: dict[str, str] | None = None) -> judge_server.Judge:
    """A judge that runs until killed: its request file is a FIFO nobody writes."""
    fifo = tmp_path / f"{name}.fifo"
    os.mkfifo(fifo)
    return judge_server.server_for(env or _env()).start([str(fifo), str(tmp_path / f"{name}.json")], tmp_path,
                                                  tmp_path / f"{name}.log")  # fmt: skip


@pytest.mark.slow
def test_no_client_can_stop_the_server_or_another_clients_judge(tmp_path: Path) -> None:
    server = judge_server.server_for(_env())
    other = _sleeper(tmp_path, "other")
    request = json.dumps({"argv": [str(tmp_path / "absent.json"), str(tmp_path / "r.json")],
                          "cwd": str(tmp_path), "log": str(tmp_path / "hung-up.log")})  # fmt: skip
    for abuse in (
        request.encode() + b"\n",  # hangs up before the server answers
        b"[1, 2]\n",  # JSON, not a request
        b'{"argv": "x", "cwd": 1, "log": null}\n',
        b"x" * (judge_server.MAX_REQUEST_BYTES + 10),  # never a newline
        b"",  # connects and hangs up
    ):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(server.socket_path)
            with contextlib.suppress(OSError):
                conn.sendall(abuse)
    time.sleep(0.5)
    assert server.alive() and _alive(other.pid)
    with pytest.raises(TimeoutError):
        other.wait(timeout=0.2)
    judge = server.start([str(tmp_path / "absent.json"), str(tmp_path / "r2.json")], tmp_path, tmp_path / "l")
    assert judge.wait(timeout=60) == 1  # served as before
    other.kill()
    assert other.wait(timeout=30) == -signal.SIGKILL  # as the server reaped it


def test_a_judge_whose_client_hangs_up_is_killed(tmp_path: Path) -> None:
    judge = _sleeper(tmp_path, "orphan")
    started = _started(judge.pid)
    judge._conn.close()
    deadline = time.monotonic() + 10
    while _alive(judge.pid, started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(judge.pid, started)
    judge._server.ended(judge)


@pytest.mark.slow
def test_a_server_whose_code_changed_is_replaced(tmp_path: Path) -> None:
    env = {**_env(), "RECFORGE_TEST_ENV": "stale"}  # a server of its own, no other test's judges
    server = judge_server.server_for(env)
    assert any(path.endswith("sandbox/judge.py") for path, _, _ in server.files)
    running = _sleeper(tmp_path, "running", env)
    watched = tmp_path / "module.py"
    watched.write_text("x = 1\n")
    st = watched.stat()
    server.files.append([str(watched), st.st_mtime_ns, st.st_size])
    assert judge_server.server_for(env) is server
    watched.write_text("x = 22\n")  # what a later judge imports is not what the server holds
    fresh = judge_server.server_for(env)
    assert fresh is not server and fresh.alive()
    assert server.alive() and _alive(running.pid)  # its running judge ends as it would have
    running.kill()
    running.wait(timeout=30)
    judge_server.server_for(env)
    assert not server.alive() and not server.folder.exists()


@pytest.mark.slow
def test_plug_in_ops_are_imported_by_each_judge_not_by_the_server(monkeypatch) -> None:
    monkeypatch.setenv("RECFORGE_OPS", "seq_scaled_sum")
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "ops"), _env()["PYTHONPATH"]])}
    server = judge_server.server_for(env)
    assert env["RECFORGE_OPS"] == "seq_scaled_sum"
    assert not [path for path, _, _ in server.files if "seq_scaled_sum" in path]
    assert any("search_space/embedding_bag.py" in path for path, _, _ in server.files)


@pytest.mark.slow
def test_a_forked_copy_of_the_backend_leaves_its_parents_server_alone(tmp_path: Path) -> None:
    server = judge_server.server_for(_env())
    pid = os.fork()
    if pid == 0:  # the child: its own server if it asks for one; its exit stops only that one
        code = 1
        try:
            mine = judge_server.server_for(_env())
            code = 0 if mine is not server and mine.owner == os.getpid() else 2
            judge_server._stop_all()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert server.alive() and server.folder.exists()
    server.stop()  # and in a child, stop() would not have: this process owns it
    assert not server.alive()


@pytest.mark.gpu
@pytest.mark.slow
def test_a_forked_judge_checks_and_times_on_the_gpu(tmp_path: Path, monkeypatch) -> None:
    """The server never initialises CUDA, so a judge forked from it can: the default kernel is
    checked and timed on the GPU by a forked judge (not by one started on its own)."""
    monkeypatch.setenv(judge_server.ENV_SWITCH, "1")
    forked: list[int] = []
    start = judge_server.Server.start

    def recording(self, argv, cwd, log):
        judge = start(self, argv, cwd, log)
        forked.append(judge.pid)
        return judge

    monkeypatch.setattr(judge_server.Server, "start", recording)
    candidate = Candidate(problem="embedding_bag", source=TEMPLATE.render({}), entry=TEMPLATE.entry)
    backend = LocalBackend(scratch_root=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = backend.evaluate(candidate, timing=True)
    assert result.status == Status.OK, result.message
    assert not [w for w in caught if "starts on its own" in str(w.message)]
    assert len(forked) == 1
    assert result.device is not None and not result.device.interpreted
    assert result.timings and all(t.candidate.median_us > 0 for t in result.timings)
