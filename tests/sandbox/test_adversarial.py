"""The adversarial suite: candidates that try to fool, crash or escape the evaluator.

Each file in `adversarial/` says in its docstring what it tries and, in a header line
`# expect: STATUS | FRAGMENT`, the status it must get and a fragment of the message. Files marked
`# base: yes` are appended to `adversarial/base.py`, a correct kernel, so that the only thing
wrong with them is the exploit (`control_correct.py` proves the base passes). Files marked
`# timing: yes` are timed as well (the rest are checked only); `# expect-gpu:`, where present,
replaces `# expect:` on a GPU. A case is an embedding-bag kernel unless `# problem:` names
another problem (and `# entry:` its entry function, the problem's name by default). A case
marked `# from: FILE` is that file (a control that passes) with the defect its `EDITS` make:
(search, replace) pairs, each found exactly once.
"""

from __future__ import annotations

import ast
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from case_headers import header as _header

from sandbox import Candidate, EvalResult, LocalBackend, Status, cgroups, isolation
from sandbox.isolation import REPO_ROOT
from sandbox.judge import evaluate
from sandbox.protocol import EvalRequest
from search_space.template import parse_source

HERE = Path(__file__).parent / "adversarial"
CASES = sorted(p for p in HERE.glob("*.py") if p.name != "base.py")


def _source(path: Path) -> tuple[str, Status, str]:
    text = path.read_text()
    expect = _header(text, "expect")
    if torch.cuda.is_available():  # a case may expect another outcome of compiled kernels
        expect = _header(text, "expect-gpu", expect)
    status, _, fragment = expect.partition("|")
    if _header(text, "from", "") != "":
        text = _edited(HERE / _header(text, "from"), text)
    elif _header(text, "base") == "yes":
        text = (HERE / "base.py").read_text() + "\n\n" + text
    return text, Status(status.strip()), fragment.strip()


def _edited(control: Path, case: str) -> str:
    """`control`'s source with the case's EDITS applied (a literal list of (search, replace))."""
    [edits] = [
        ast.literal_eval(node.value)
        for node in parse_source(case).body  # under the lock: the corpus screens in threads
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["EDITS"]
    ]
    source = control.read_text()
    for search, replace in edits:
        assert source.count(search) == 1, f"{control.name}: {search!r} is not there exactly once"
        source = source.replace(search, replace)
    return source


def test_the_suite_covers_every_exploit_and_fault() -> None:
    assert len(CASES) >= 15
    for path in CASES:
        assert path.read_text().startswith('"""'), f"{path.name} has no docstring saying what it tries"


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Future[EvalResult], Path, Path]]:
    """Every case evaluated once, two at a time (RECFORGE_CORPUS_PARALLEL on a larger host): a
    worker keeps one core busy, and the cases that run a worker (or spin until the timeout) would
    otherwise leave the second core of a small CI machine idle. Case name -> (its evaluation, its
    scratch directory, a canary directory beside it)."""
    # Only the cases this session runs: `-k control_correct` evaluates that one alone.
    selected = {
        item.callspec.params["path"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_adversarial_candidate_gets_its_status"
    }
    runs = {}
    with ThreadPoolExecutor(max_workers=int(os.environ.get("RECFORGE_CORPUS_PARALLEL", "2"))) as pool:
        for path in sorted(selected):
            source, expected, _ = _source(path)
            root = tmp_path_factory.mktemp(path.stem)
            scratch, canary = root / "scratch", root / "canary"
            canary.mkdir()
            (canary / "keep").write_text("unchanged")
            # Cases that must time out get a short limit; the rest a generous one for slow CI machines.
            backend = LocalBackend(timeout_s=8 if expected == Status.TIMEOUT else 120, scratch_root=scratch)
            text = path.read_text()
            problem = _header(text, "problem", "embedding_bag")
            candidate = Candidate(problem=problem, source=source, entry=_header(text, "entry", problem))
            timing = _header(text, "timing", "no") == "yes"
            runs[path.stem] = (
                pool.submit(backend.evaluate, candidate, trials=2, timing=timing),
                scratch,
                canary,
            )
    return runs


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first case waits for the whole corpus (3 minutes on 2 idle cores)
@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_adversarial_candidate_gets_its_status(path: Path, outcomes) -> None:
    _, expected, fragment = _source(path)
    run, scratch, canary = outcomes[path.stem]
    result = run.result()

    assert result.status == expected, (
        f"{path.name}: {result.status.value}: {result.message}\n{result.log_tail}"
    )
    # A fragment may name alternatives ("a || b"): a case refused by whichever check trips first.
    assert any(f.strip() in result.message for f in fragment.split("||")), result.message
    # Nothing left behind: the scratch directory is gone and nothing beside it was touched.
    assert [p.name for p in canary.iterdir()] == ["keep"] and (canary / "keep").read_text() == "unchanged"
    assert not scratch.exists() or not any(scratch.iterdir())


# Runs as the entry of a candidate in the real runner sandbox (evaluated by the judge directly,
# which screens nothing): tries each way out, leaves a process behind in a session of its own,
# and raises with what happened, as JSON, for the judge to report.
PROBE = """
import errno, json, os, socket, sys, time

def _try(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc))

def _write(path):
    with open(path, "w") as f:
        f.write("escaped")

def _connect(host):
    socket.create_connection((host, PORT), timeout=3).close()

def embedding_bag(weight, indices, offsets, **kwargs):
    report = {
        "connect": {host: _try(lambda host=host: _connect(host)) for host in ("127.0.0.1", "192.0.2.1")},
        "interfaces": [name for _, name in socket.if_nameindex()],
        "sees": {label: os.path.exists(path) for label, path in SEE.items()},
        "writes": {label: _try(lambda path=path: _write(path)) for label, path in WRITE.items()},
    }
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", MARKER])
    with open("/scratch/child.pid", "w") as f:
        f.write(str(pid))
    time.sleep(3)
    raise RuntimeError("PROBE " + json.dumps(report))
"""


def _host_processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass  # it ended meanwhile
    return found


@pytest.mark.skipif(isolation.bwrap_works() is not None, reason=f"no sandbox: {isolation.bwrap_works()}")
@pytest.mark.slow
def test_the_runner_cannot_reach_the_host_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """What the screen would refuse, tried anyway inside the runner's sandbox: no connection to
    a listener on the host's loopback, no sight of the host's /tmp (the GPU lock file) or of the
    judge's directory, no write outside the scratch directory, and no process that outlives the
    evaluation, even one in a session of its own."""
    token = secrets.token_hex(4)
    marker = f"recforge-probe-{token}"
    judge_dir = tmp_path / "judge"
    judge_dir.mkdir()
    (judge_dir / "request.json").write_text("{}")
    runner_dir = tmp_path / "runner"
    runner_dir.mkdir()
    host_tmp = Path(tempfile.gettempdir())
    lock = host_tmp / f"{marker}.lock"
    lock.write_text("")
    see = {
        "lock": str(lock),
        "judge": str(judge_dir / "request.json"),
        "git": str(REPO_ROOT / ".git"),
        "agent": str(REPO_ROOT / "agent"),
        "own source": f"{isolation.SCRATCH}/candidate.py",
    }
    write = {
        "repository": str(REPO_ROOT / marker),
        "sandbox package": str(REPO_ROOT / "sandbox" / marker),
        "python": str(Path(sys.prefix) / marker),
        "judge": str(judge_dir / marker),
        "host tmp": str(host_tmp / f"{marker}.escaped"),
        "scratch": f"{isolation.SCRATCH}/{marker}",
    }
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        source = f"PORT = {port}\nSEE = {see!r}\nWRITE = {write!r}\nMARKER = {marker!r}\n" + PROBE
        (runner_dir / "candidate.py").write_text(source)
        request = EvalRequest(
            problem="embedding_bag",
            candidate_id="probe",
            source_file=f"{isolation.SCRATCH}/candidate.py",
            entry="embedding_bag",
            runner_dir=str(runner_dir),
            timing=False,
            timeout_s=60,
            timing_locks=[str(lock)],
        )
        try:
            with ThreadPoolExecutor(max_workers=1) as pool:
                run = pool.submit(evaluate, request)
                seen_during: list[int] = []
                while not run.done() and not seen_during:
                    seen_during = _host_processes_with(marker)
                    time.sleep(0.05)
                result = run.result()
            left = _host_processes_with(marker)
            listener.settimeout(0)
            with pytest.raises(BlockingIOError):
                listener.accept()  # nothing ever connected
        finally:
            for path in (lock, host_tmp / f"{marker}.escaped"):
                path.unlink(missing_ok=True)
    assert result.status == Status.RUNTIME_ERROR, f"{result.message}\n{result.log_tail}"
    report = json.loads(result.message.split("PROBE ", 1)[1])
    # A network namespace of its own: only a loopback (bubblewrap brings it up), on which nothing
    # listens, and no route anywhere else; the host's listener never saw a connection (above).
    assert report["connect"] == {"127.0.0.1": "ECONNREFUSED", "192.0.2.1": "ENETUNREACH"}
    assert report["interfaces"] == ["lo"]
    assert report["sees"] == {"lock": False, "judge": False, "git": False, "agent": False, "own source": True}
    writes = report["writes"]
    assert writes.pop("scratch") == "ok" and (runner_dir / marker).read_text() == "escaped"
    # The runner's /tmp is its own (and its root's, so closed to it): nothing reaches the host's.
    assert writes.pop("host tmp") in ("ok", "EACCES")
    assert writes.pop("sandbox package") == "EROFS"
    assert all(outcome != "ok" for outcome in writes.values()), writes
    for label, path in write.items():
        if label != "scratch":
            assert not os.path.exists(path), f"{label}: {path} was written on the host"
    # The process it left behind existed while the runner ran, and is gone with it.
    assert (runner_dir / "child.pid").read_text().isdigit()
    assert seen_during, "the probe's child never showed up among the host's processes"
    assert left == [], f"processes outlived the evaluation: {left}"


# Runs as the entry of a candidate in the real runner sandbox: fills its /tmp and /dev/shm and
# forks until each refuses, and raises with how far it got, as JSON.
EXHAUST = """
import errno, json, os, signal

def _fill(directory):
    written = 0
    try:
        with open(os.path.join(directory, "fill"), "wb") as f:
            while written < (4 << 30):
                f.write(b"x" * (1 << 20))
                f.flush()
                written += 1 << 20
        return written, "never refused"
    except OSError as exc:
        return written, errno.errorcode.get(exc.errno, str(exc))
    finally:
        try:
            os.unlink(os.path.join(directory, "fill"))
        except OSError:
            pass

def _fork_all():
    children = 0
    try:
        while children < 100_000:
            if os.fork() == 0:
                try:
                    signal.pause()
                finally:
                    os._exit(0)
            children += 1
        return children, "never refused"
    except OSError as exc:
        return children, errno.errorcode.get(exc.errno, str(exc))

def _status(name):
    with open(f"/proc/self/{name}") as f:
        return [line.strip() for line in f if line.startswith(("Max processes", "Threads", "Uid"))]

def embedding_bag(weight, indices, offsets, **kwargs):
    with open("/proc/self/mounts") as f:
        mounts = {line.split()[1]: line.split()[3] for line in f}
    report = {
        "before": _status("limits") + _status("status"),
        "tmp": _fill("/tmp"),
        "shm": _fill("/dev/shm"),
        "forks": _fork_all(),
        "options": {place: mounts.get(place, "") for place in ("/tmp", "/dev/shm")},
    }
    raise RuntimeError("EXHAUST " + json.dumps(report))
"""

# Writes files into its scratch directory until the judge stops it (or gives up at 1 GiB).
FLOOD_SCRATCH = """
import time

def embedding_bag(weight, indices, offsets, **kwargs):
    for i in range(128):
        with open(f"/scratch/flood-{i}", "wb") as f:
            f.write(b"x" * (8 << 20))
        time.sleep(0.02)
    raise RuntimeError("NOT STOPPED")
"""


def _probe_request(runner_dir: Path, source: str, **overrides) -> EvalRequest:
    runner_dir.mkdir()
    (runner_dir / "candidate.py").write_text(source)
    fields = {
        "problem": "embedding_bag",
        "candidate_id": "probe",
        "source_file": f"{isolation.SCRATCH}/candidate.py",
        "entry": "embedding_bag",
        "runner_dir": str(runner_dir),
        "timing": False,
        "timeout_s": 120,
        **overrides,
    }
    return EvalRequest(**fields)


def _exhaust_report(runner_dir: Path) -> dict:
    result = evaluate(_probe_request(runner_dir, EXHAUST))
    assert result.status == Status.RUNTIME_ERROR, f"{result.message}\n{result.log_tail}"
    return json.loads(result.message.split("EXHAUST ", 1)[1])


def _forks_end_at_the_budget(report: dict) -> None:
    forks, error = report["forks"]
    assert error == "EAGAIN" and 0 < forks <= isolation.TASK_BUDGET, report


@pytest.mark.skipif(isolation.bwrap_works() is not None, reason=f"no sandbox: {isolation.bwrap_works()}")
@pytest.mark.slow
def test_the_runner_cannot_exhaust_the_hosts_memory_or_pids(tmp_path: Path) -> None:
    """Its /tmp and /dev/shm (in the host's memory) are sized, and end there (under a root judge
    they are root's, so closed to the runner's user altogether); forking ends at the task
    budget; each with the error a full system gives, not with a host out of memory or PIDs."""
    # The budget is of every task of `nobody` (on kernels before 5.14, or where the judge may not
    # lift its own limit), and another test's runner may hold it for a moment: a probe that
    # could not fork once is run again, a few times, before its count is taken as the answer.
    for attempt in range(4):
        report = _exhaust_report(tmp_path / f"runner-{attempt}")
        if report["forks"][0] > 0:
            break
        time.sleep(2.0)
    for place in ("tmp", "shm"):
        written, error = report[place]
        full = error == "ENOSPC" and written <= isolation.TMPFS_BYTES
        closed = error in ("EACCES", "EROFS") and written == 0
        assert full or closed, (place, report[place])
    for place, options in report["options"].items():
        assert f"size={isolation.TMPFS_BYTES // 1024}k" in options.split(","), (place, options)
    _forks_end_at_the_budget(report)


@pytest.mark.skipif(isolation.bwrap_works() is not None, reason=f"no sandbox: {isolation.bwrap_works()}")
@pytest.mark.slow
def test_a_judge_held_to_few_tasks_still_starts_its_runner(tmp_path: Path) -> None:
    """A judge held to fewer tasks than the budget (a small `ulimit -u`): its runner starts,
    and its forks end in EAGAIN below the judge's limit. Where the judge may not lift that limit
    (no CAP_SYS_RESOURCE, as in a default container), every task of `nobody` on the host counts
    against it, other tests' runners included, so the runner may find it spent before its first
    fork: how many it makes is not this test's to fix, only that it started and ended there."""
    limit = isolation.TASK_BUDGET // 4
    code = (
        "import json, resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_NPROC, ({limit}, {limit}))\n"
        "sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
        "import test_adversarial\n"
        "from pathlib import Path\n"
        "print(json.dumps(test_adversarial._exhaust_report(Path(sys.argv[3]))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(REPO_ROOT), str(Path(__file__).parent), str(tmp_path / "runner")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    forks, error = report["forks"]
    assert error == "EAGAIN" and 0 <= forks < limit, report


def _groups_here() -> bool:
    group = cgroups.create(f"probe-{secrets.token_hex(4)}", memory_bytes=2**30, max_tasks=64)
    if group is not None:
        group.remove()
    return group is not None


HIDE_IN_UNLINKED = """
import os
import time

HELD = []

def embedding_bag(weight, indices, offsets, **kwargs):
    for i in range(32):
        f = open(f"/scratch/hidden-{i}", "wb")
        os.unlink(f.name)  # out of the directory's listing, still on the disk while held open
        f.write(b"x" * (8 << 20))
        f.flush()
        HELD.append(f)
        time.sleep(0.05)
    time.sleep(3)
    raise RuntimeError("NOT STOPPED")
"""


@pytest.mark.skipif(isolation.bwrap_works() is not None, reason=f"no sandbox: {isolation.bwrap_works()}")
@pytest.mark.skipif(not _groups_here(), reason="this host gives a root judge no control group for its runner")
def test_files_unlinked_but_held_open_count_against_the_scratch_quota(tmp_path: Path) -> None:
    request = _probe_request(tmp_path / "runner", HIDE_IN_UNLINKED, scratch_bytes=64 * 1024**2)
    result = evaluate(request)
    assert result.status == Status.RUNTIME_ERROR, f"{result.message}\n{result.log_tail}"
    assert "over its quota of 64 MiB" in result.message, result.message


HOARD_MEMORY = """
def embedding_bag(weight, indices, offsets, **kwargs):
    hoard = [bytearray(64 << 20) for _ in range(64)]  # 4 GiB of the host's memory, touched
    raise RuntimeError(f"NOT STOPPED {len(hoard)}")
"""


@pytest.mark.skipif(isolation.bwrap_works() is not None, reason=f"no sandbox: {isolation.bwrap_works()}")
@pytest.mark.skipif(not _groups_here(), reason="this host gives a root judge no control group for its runner")
def test_a_runner_hoarding_host_memory_is_killed_at_its_groups_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a root judge the runner's group bounds the host memory of everything it starts (on
    a GPU host no address-space limit can: the CUDA driver reserves far more than it uses)."""
    monkeypatch.setattr(isolation, "MEMORY_BYTES", 512 * 1024**2)
    result = evaluate(_probe_request(tmp_path / "runner", HOARD_MEMORY, address_space_bytes=None))
    assert result.status == Status.RUNTIME_ERROR, f"{result.message}\n{result.log_tail}"
    assert "killed at its memory limit" in result.message, result.message
    left = list(Path(cgroups.CGROUP_ROOT).glob(f"**/{cgroups.PARENT}/{os.getpid()}-*"))
    assert not left, f"groups left behind: {left}"


@pytest.mark.skipif(isolation.bwrap_works() is not None, reason=f"no sandbox: {isolation.bwrap_works()}")
def test_a_runner_filling_its_scratch_directory_is_stopped(tmp_path: Path) -> None:
    runner_dir = tmp_path / "runner"
    request = _probe_request(runner_dir, FLOOD_SCRATCH, scratch_bytes=64 * 1024**2)
    result = evaluate(request)
    assert result.status == Status.RUNTIME_ERROR, f"{result.message}\n{result.log_tail}"
    assert "over its quota of 64 MiB" in result.message, result.message
    # Stopped at the quota (allocated blocks count, so exactly 64 MiB of data can cross it),
    # before the flood's whole gigabyte.
    written = sum(p.stat().st_size for p in runner_dir.glob("flood-*"))
    assert 64 * 1024**2 <= written < 1024**3, written
