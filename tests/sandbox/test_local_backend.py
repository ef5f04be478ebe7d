"""The local backend end to end: a judge process per candidate, its runner in bubblewrap, each
outcome a status. (The judge's own outcomes, in this process and faster, are test_judge.py's.)

Every evaluation costs a few seconds on a small CPU machine (the judge and its runner each
import torch and triton), so each outcome gets exactly one candidate.
"""

import os
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sandbox import Candidate, EvalResult, LocalBackend, Status, judge_server
from search_space.embedding_bag import CHECK_SHAPES, INTERPRETED_TIMING_SHAPES, TEMPLATE

pytestmark = pytest.mark.slow

DEFAULT_SOURCE = TEMPLATE.render({})
# First statement of the rendered entry's body: code injected before it runs on every call.
ENTRY_BODY = "    num_bags, dim = offsets.numel() - 1, weight.shape[1]\n"
STORE = "acc_BD.to(out_ptr.dtype.element_ty)"


def _edit(old: str, new: str) -> str:
    assert DEFAULT_SOURCE.count(old) == 1, f"template changed: {old!r} no longer appears once"
    return DEFAULT_SOURCE.replace(old, new)


def _candidate(source: str) -> Candidate:
    return Candidate(problem="embedding_bag", source=source, entry=TEMPLATE.entry, origin="human")


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    return tmp_path / "scratch"


@pytest.fixture
def backend(scratch: Path) -> LocalBackend:
    return LocalBackend(timeout_s=120, scratch_root=scratch)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list:
    """Judges the backend starts, forked by its judge server (or, with the server off, started
    as processes of their own), recorded so a test can look at them afterwards (the judge's own
    Popen of its runner happens in the judge's process, not here)."""
    judges: list = []
    start = judge_server.Server.start

    def recording_start(self, *args, **kwargs):
        judge = start(self, *args, **kwargs)
        judges.append(judge)
        return judge

    class RecordingPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if "sandbox.judge" in self.args:  # not, say, the backend's probe of bubblewrap
                judges.append(self)

    monkeypatch.setattr(judge_server.Server, "start", recording_start)
    monkeypatch.setattr(subprocess, "Popen", RecordingPopen)
    return judges


UNTIMED = {"timing": False, "trials": 1}
CASES = {
    "correct": (DEFAULT_SOURCE, {"trials": 1}),
    "wrong": (_edit(STORE, STORE.replace("acc_BD.", "(acc_BD * 2.0).")), UNTIMED),
    "raising": (_edit(ENTRY_BODY, '    raise RuntimeError("candidate gave up")\n' + ENTRY_BODY), UNTIMED),
    # A module-level lookup that fails when the module runs (the screen only reads it).
    "key-error": (DEFAULT_SOURCE + '\nHELPER = KNOBS["missing"]\n', UNTIMED),
    # Parses (so it passes the screen's ast.parse) but does not compile.
    "return-outside-function": (_edit("import torch\n", "import torch\n\nreturn None\n"), UNTIMED),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Future[EvalResult], Path]]:
    """Each case evaluated once, two at a time (a runner keeps one core busy, and a small CI
    machine has two): name -> (its evaluation, its backend's scratch directory)."""
    runs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, (source, kwargs) in CASES.items():
            scratch = tmp_path_factory.mktemp(f"local-{name}") / "scratch"
            backend = LocalBackend(timeout_s=120, scratch_root=scratch)
            runs[name] = (pool.submit(backend.evaluate, _candidate(source), **kwargs), scratch)
    return runs


def test_default_template_is_ok(outcomes) -> None:
    run, scratch = outcomes["correct"]
    result = run.result()
    assert result.status == Status.OK, f"{result.message}\n{result.log_tail}"
    # Two trials per check shape (the least the judge runs), no-op proofs (trial -1) at random
    # points among them and in the timing, and checks of timed calls (trial -2).
    checks = [c for c in result.checks if c.trial >= 0]
    assert len(checks) == 3 * len(CHECK_SHAPES)  # trial 0 calls twice on the same inputs
    assert {(c.shape, c.dtype) for c in checks} == {(s.name, s.dtype) for s in CHECK_SHAPES}
    assert len([c for c in result.checks if c.trial == -1]) >= 3
    assert any(c.trial == -2 for c in result.checks)
    assert all(c.ok for c in result.checks), [c for c in result.checks if not c.ok]
    assert result.device is not None
    assert result.device.interpreted == (not torch.cuda.is_available())
    if result.device.interpreted:
        assert [t.shape for t in result.timings] == [s.name for s in INTERPRETED_TIMING_SHAPES]
    assert result.timings and all(t.candidate.median_us > 0 for t in result.timings)
    assert all(t.checked_calls >= 1 for t in result.timings)
    assert result.geomean_us() is not None
    # The judge accounts for its phases (its runner's start included), the backend for the
    # judge's spawn and exit; the rest of the judge's start-up is what the backend's wall time
    # adds. A GPU's lock is taken, and its wait reported, only where the backend has a GPU.
    phases = {"spawn", "setup", "init", "start", "load", "check", "timing", "finish", "exit"}
    assert phases <= set(result.phase_s) <= phases | {"lock_wait"}
    assert 0 <= result.phase_s["exit"] < result.wall_s and 0 < result.phase_s["spawn"] < result.wall_s
    assert 0 < sum(result.phase_s.values()) <= result.wall_s + 1e-9  # (a sum's rounding)
    # The time the lock was held, by kind: none where there is no GPU to lock.
    if torch.cuda.is_available():
        assert set(result.gpu_held_s) == {"exclusive", "shared"} and min(result.gpu_held_s.values()) > 0
    else:
        assert result.gpu_held_s == {}
    assert list(scratch.iterdir()) == []  # the scratch directory is removed afterwards


def test_wrong_kernel_names_the_shape(outcomes) -> None:
    result = outcomes["wrong"][0].result()
    first = CHECK_SHAPES[0]
    assert result.status == Status.WRONG, f"{result.message}\n{result.log_tail}"
    assert result.message.startswith(first.describe())
    assert "outside tolerance" in result.message
    assert result.checks and not result.checks[-1].ok
    assert result.timings == []


def test_raising_entry_is_a_runtime_error(outcomes) -> None:
    result = outcomes["raising"][0].result()
    assert result.status == Status.RUNTIME_ERROR, f"{result.message}\n{result.log_tail}"
    assert "RuntimeError: candidate gave up" in result.message
    assert CHECK_SHAPES[0].name in result.message
    assert result.message == f"{CHECK_SHAPES[0].describe()}: RuntimeError: candidate gave up"
    assert "candidate gave up" in result.log_tail  # the traceback comes back


def test_hanging_entry_times_out_and_its_process_group_dies(scratch: Path, started: list) -> None:
    source = _edit(ENTRY_BODY, "    while True:\n        pass\n" + ENTRY_BODY)
    result = LocalBackend(timeout_s=8, scratch_root=scratch).evaluate(
        _candidate(source), timing=False, trials=1
    )
    assert result.status == Status.TIMEOUT, f"{result.message}\n{result.log_tail}"
    # The judge's own verdict, at its deadline (the backend's hard limit comes later).
    assert result.message.startswith("killed after 8 s (") and "no answer" in result.message
    assert 8 <= result.wall_s < 20
    (judge,) = started
    assert judge.returncode == 0  # it wrote its result and exited
    # The judge led its own session, so its process group id is its pid.
    with pytest.raises(ProcessLookupError):
        os.killpg(judge.pid, 0)
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize(
    ("case", "error"),
    [("key-error", "KeyError: 'missing'"), ("return-outside-function", "SyntaxError")],
    ids=["key-error", "return-outside-function"],
)
def test_import_failure_is_a_compile_error(outcomes, case: str, error: str) -> None:
    result = outcomes[case][0].result()
    assert result.status == Status.COMPILE_ERROR, f"{result.message}\n{result.log_tail}"
    assert result.message.startswith(f"import failed: {error}")
    assert result.checks == []
    assert "Traceback" in result.log_tail


def test_forbidden_import_is_rejected_without_a_judge(backend: LocalBackend, started: list) -> None:
    source = _edit("import torch\n", "import os\nimport torch\n")
    line = source.splitlines().index("import os") + 1
    result = backend.evaluate(_candidate(source))
    assert result.status == Status.STATIC_REJECTED
    assert f"line {line}: rule 'imports': import of 'os'" in result.message
    assert started == []


def test_parallel_evaluations_all_finish_in_order(tmp_path: Path) -> None:
    """Judges run side by side (on a GPU host sharing its timing lock, each timed batch holding
    it alone: test_judge.py's); here, the three evaluations of two at a time all finish, each
    with its timing, in the order asked, each told as it ends; one of them, whichever got to its
    timing first, times the baselines."""
    backend = LocalBackend(timeout_s=120, scratch_root=tmp_path, parallel=2)
    sources = [TEMPLATE.render({"BLOCK_L": n}) for n in (4, 16, 32)]
    told: dict[int, EvalResult] = {}
    # Unchecked, so that both judges reach their timing phase at about the same moment.
    results = backend.evaluate_many(
        [_candidate(s) for s in sources], check=False, baselines=["reference"], on_result=told.__setitem__
    )
    assert [r.status for r in results] == [Status.OK] * 3, [r.message for r in results]
    assert all(r.timing_window is not None and r.timings for r in results)
    assert [r.candidate_id for r in results] == [_candidate(s).id for s in sources]  # order kept
    assert [told[i] for i in range(3)] == results
    shapes = len(results[0].timings)
    timed = sorted([set(t.baselines) for t in r.timings] for r in results)
    assert timed == [[set()] * shapes, [set()] * shapes, [{"reference"}] * shapes]


def _oom(message: str) -> EvalResult:
    return EvalResult(status=Status.RUNTIME_ERROR, problem="embedding_bag", candidate_id="c", message=message)


@pytest.mark.parametrize(
    ("message", "retried"),
    [
        ("the judge failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 1.17 GiB", True),
        ("the judge failed: SharedMemoryError: cuMemCreate failed with CUDA driver error 2", True),
        ("the judge failed: SharedMemoryError: cuMemCreate failed with CUDA driver error 20", False),
        ("b64k [bf16]: OutOfMemoryError: CUDA out of memory (the candidate's own)", False),
        ("the judge failed: ValueError: something else", False),
    ],
)
def test_only_the_judges_own_out_of_memory_runs_alone(tmp_path: Path, message: str, retried: bool) -> None:
    """The first run fails as `message` says; a judge's own out-of-memory runs again, holding
    the host's memory lock alone (no other evaluation could take it shared meanwhile)."""
    import fcntl

    from sandbox.gpus import Place, Places
    from sandbox.local import WorkerBackend, judge_out_of_memory

    lock = tmp_path / "memory.lock"
    runs: list[bool] = []  # per run: could another evaluation share the lock meanwhile?

    class Scripted(WorkerBackend):
        scratch_root, keep_scratch = tmp_path / "scratch", False
        _places = Places([Place(None, memory_locks=(lock,))], 1)

        def _run(self, candidate, scratch, request):
            with open(lock, "a") as other:
                try:
                    fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    runs.append(True)
                    fcntl.flock(other, fcntl.LOCK_UN)
                except BlockingIOError:
                    runs.append(False)
            if len(runs) == 1:
                return _oom(message).model_copy(update={"wall_s": 3.0, "phase_s": {"check": 2.0}})
            return EvalResult(
                status=Status.OK, problem="embedding_bag", candidate_id="c", message="", wall_s=5.0,
                phase_s={"check": 1.0, "timing": 3.0},
            )  # fmt: skip

    result = Scripted().evaluate(_candidate(DEFAULT_SOURCE), timing=False)
    assert judge_out_of_memory(_oom(message)) is retried
    assert runs == ([True, False] if retried else [True])
    assert result.status == (Status.OK if retried else Status.RUNTIME_ERROR)
    # Both runs' time counts: their wall time and their phases (the device seconds a budget
    # counts), the first run's time outside its phases named for its cause; its message is kept.
    if retried:
        assert result.wall_s == 8.0
        assert result.phase_s == {"check": 3.0, "timing": 3.0, "beside_out_of_memory": 1.0}
        assert result.log_tail.startswith(f"the first run, beside other evaluations: {message}")


@pytest.mark.slow
def test_the_timing_lock_switch_reaches_the_judge(monkeypatch, tmp_path: Path) -> None:
    """RECFORGE_TIMING_LOCK (sandbox.judge.TIMING_LOCK) is passed to the judges: "batch" times
    a correct candidate as the default "shape" does (each batch under a hold of its own), and a
    value the judge does not know stops it with a message naming the switch."""
    monkeypatch.setenv("RECFORGE_TIMING_LOCK", "batch")
    backend = LocalBackend(timeout_s=120, scratch_root=tmp_path / "batch")
    result = backend.evaluate(_candidate(DEFAULT_SOURCE), trials=1)
    assert result.status == Status.OK, result.message
    assert result.timings and all(t.checked_calls >= 1 for t in result.timings)
    monkeypatch.setenv("RECFORGE_TIMING_LOCK", "sometimes")
    backend = LocalBackend(timeout_s=120, scratch_root=tmp_path / "unknown")
    with pytest.warns(UserWarning, match="the judge server did not start"):  # its import fails too
        result = backend.evaluate(_candidate(DEFAULT_SOURCE), trials=1)
    assert result.status == Status.RUNTIME_ERROR
    assert "RECFORGE_TIMING_LOCK must be 'batch' or 'shape'" in result.log_tail, result.log_tail


@pytest.mark.parametrize("server", [False, True], ids=["own-process", "judge-server"])
def test_a_judge_past_its_hard_limit_loses_its_runner_before_its_locks(server, monkeypatch, tmp_path) -> None:
    """A judge killed drops its GPU locks at once, while its runner may still have work on the
    GPU: the runner's control group is killed and emptied before the judge is."""
    import signal
    import sys

    from sandbox import local

    order: list[str] = []
    monkeypatch.setattr(local.cgroups, "remove_groups_of", lambda pid: order.append("runner's groups"))

    def timed_out(wait, limit, judge_dir) -> None:
        raise TimeoutError

    monkeypatch.setattr(local, "_wait_within", timed_out)
    if server:

        class Judge:
            pid, returncode = 123456, None

            def kill(self) -> None:
                order.append("judge")
                self.returncode = -int(signal.SIGKILL)

            def wait(self, timeout=None) -> int:
                return self.returncode

        monkeypatch.setattr(judge_server, "enabled", lambda: True)
        monkeypatch.setattr(judge_server, "start_judge", lambda *args: Judge())
    else:
        monkeypatch.setenv("RECFORGE_JUDGE_SERVER", "0")
        real_killpg = local.os.killpg

        def killpg(pid: int, sig: int) -> None:
            order.append("judge")
            real_killpg(pid, sig)

        monkeypatch.setattr(local.os, "killpg", killpg)
    cmd = [sys.executable, "-c", "import time; time.sleep(60)", "", "", ""]
    timed, _, _ = LocalBackend(timeout_s=1)._judge(cmd, tmp_path)
    assert timed and order[:2] == ["runner's groups", "judge"], order


def test_the_docker_backend_ends_the_runners_container_too(monkeypatch, tmp_path) -> None:
    """Its runner is a container, found by the label naming the evaluation's runner directory,
    removed (killed) before the judge's groups and the judge."""
    from sandbox import local
    from sandbox.docker_backend import LABEL, DockerBackend

    order: list[str] = []
    asked: list[dict] = []

    class Container:
        def remove(self, force: bool = False) -> None:
            order.append(f"container removed, force={force}")

    class Containers:
        def list(self, **kwargs) -> list:
            asked.append(kwargs)
            return [Container()]

    backend = DockerBackend.__new__(DockerBackend)  # no daemon here: a client that answers
    backend.client = type("Client", (), {"containers": Containers()})()
    monkeypatch.setattr(local.cgroups, "remove_groups_of", lambda pid: order.append("runner's groups"))
    backend._end_runner(123456, tmp_path / "judge")
    assert asked == [{"all": True, "filters": {"label": f"{LABEL}={tmp_path / 'runner'}"}}]
    assert order == ["container removed, force=True", "runner's groups"]

    class Unreachable:
        def list(self, **kwargs) -> list:
            raise ConnectionError("the daemon does not answer")  # as the HTTP client raises it

    order.clear()
    backend.client = type("Client", (), {"containers": Unreachable()})()
    backend._end_runner(123456, tmp_path / "judge")
    assert order == ["runner's groups"]
