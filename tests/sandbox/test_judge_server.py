"""The judge fork server: judges forked from it run as `python -m sandbox.judge` would, each in a
session of its own; it answers bad requests with an error and goes on; it ends with the process
that started it; without it (switched off, or failing to start) judges start on their own."""

from __future__ import annotations

import os
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


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


def test_the_server_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "from sandbox import judge_server\n"
        "server = judge_server.server_for(dict(os.environ))\n"
        "print(server.proc.pid, flush=True)\n"
        "os._exit(0)\n"  # no atexit: only the server's own watch can end it
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_idle_servers_of_other_environments_are_stopped(monkeypatch) -> None:
    monkeypatch.setattr(judge_server, "MAX_IDLE", 0)
    first = judge_server.server_for({**_env(), "RECFORGE_TEST_ENV": "1"})
    second = judge_server.server_for({**_env(), "RECFORGE_TEST_ENV": "2"})
    assert first.socket_path != second.socket_path and second.alive()
    assert not first.alive() and not first.folder.exists()
    assert judge_server.server_for({**_env(), "RECFORGE_TEST_ENV": "2"}) is second


@pytest.mark.parametrize("how", ["switched off", "failing to start"])
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


def test_the_server_is_used_by_default_only_without_a_gpu(monkeypatch) -> None:
    from sandbox import hardware

    monkeypatch.delenv(judge_server.ENV_SWITCH, raising=False)
    for gpu in (False, True):
        monkeypatch.setattr(hardware, "cuda_present", lambda gpu=gpu: gpu)
        assert judge_server.enabled() is (not gpu)
    monkeypatch.setenv(judge_server.ENV_SWITCH, "1")
    assert judge_server.enabled()
    monkeypatch.setenv(judge_server.ENV_SWITCH, "0")
    assert not judge_server.enabled()


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
