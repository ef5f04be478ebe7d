"""The local backend end to end: one worker process per candidate, each outcome a status.

Every worker launch costs 4-8 s on a small CPU machine (importing torch and triton), so each
outcome gets exactly one candidate and correct candidates run one trial per check shape.
"""

import os
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sandbox import Candidate, EvalResult, LocalBackend, Status
from search_space.embedding_bag import CHECK_SHAPES, ENTRY, INTERPRETED_TIMING_SHAPES, TEMPLATE

pytestmark = pytest.mark.slow

DEFAULT_SOURCE = TEMPLATE.render({})
# First statement of the rendered entry's body: code injected before it runs on every call.
ENTRY_BODY = "    num_bags, dim = offsets.numel() - 1, weight.shape[1]\n"
STORE = "acc.to(out_ptr.dtype.element_ty)"


def _edit(old: str, new: str) -> str:
    assert DEFAULT_SOURCE.count(old) == 1, f"template changed: {old!r} no longer appears once"
    return DEFAULT_SOURCE.replace(old, new)


def _candidate(source: str) -> Candidate:
    return Candidate(problem="embedding_bag", source=source, entry=ENTRY, origin="human")


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    return tmp_path / "scratch"


@pytest.fixture
def backend(scratch: Path) -> LocalBackend:
    return LocalBackend(timeout_s=120, scratch_root=scratch)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen]:
    """Worker processes the backend starts, recorded so a test can look at them afterwards."""
    processes: list[subprocess.Popen] = []

    class RecordingPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            processes.append(self)

    monkeypatch.setattr(subprocess, "Popen", RecordingPopen)
    return processes


UNTIMED = {"timing": False, "trials": 1}
CASES = {
    "correct": (DEFAULT_SOURCE, {"trials": 1}),
    "wrong": (_edit(STORE, f"(acc * 2.0).{STORE[4:]}"), UNTIMED),
    "raising": (_edit(ENTRY_BODY, '    raise RuntimeError("candidate gave up")\n' + ENTRY_BODY), UNTIMED),
    # A module-level call of a name the module never defines.
    "undefined-name": (DEFAULT_SOURCE + "\nHELPER = _make_helper()\n", UNTIMED),
    # Parses (so it passes the screen's ast.parse) but does not compile.
    "return-outside-function": (_edit("import torch\n", "import torch\n\nreturn None\n"), UNTIMED),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Future[EvalResult], Path]]:
    """Each case evaluated once, two workers at a time (a worker keeps one core busy, and a small
    CI machine has two): name -> (its evaluation, its backend's scratch directory)."""
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
    # two trials per check shape (the least the worker runs), then the no-op proof (trial -1)
    assert len(result.checks) == 2 * len(CHECK_SHAPES) + 1 and result.checks[-1].trial == -1
    assert all(c.ok for c in result.checks), [c for c in result.checks if not c.ok]
    assert result.device is not None
    assert result.device.interpreted == (not torch.cuda.is_available())
    if result.device.interpreted:
        assert [t.shape for t in result.timings] == [s.name for s in INTERPRETED_TIMING_SHAPES]
    assert result.timings and all(t.candidate.median_us > 0 for t in result.timings)
    assert result.geomean_us() is not None
    # The worker accounts for its phases; start-up is what the backend's wall time adds.
    assert set(result.phase_s) == {"load", "check", "lock_wait", "timing"}
    assert 0 < sum(result.phase_s.values()) < result.wall_s
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
    assert "candidate gave up" in result.log_tail  # the traceback comes back


def test_hanging_entry_times_out_and_its_process_group_dies(
    scratch: Path, started: list[subprocess.Popen]
) -> None:
    source = _edit(ENTRY_BODY, "    while True:\n        pass\n" + ENTRY_BODY)
    result = LocalBackend(timeout_s=8, scratch_root=scratch).evaluate(
        _candidate(source), timing=False, trials=1
    )
    assert result.status == Status.TIMEOUT, f"{result.message}\n{result.log_tail}"
    assert "killed after 8 s" in result.message
    assert 8 <= result.wall_s < 20
    (worker,) = started
    assert worker.returncode is not None  # reaped
    # The worker led its own session, so its process group id is its pid.
    with pytest.raises(ProcessLookupError):
        os.killpg(worker.pid, 0)


@pytest.mark.parametrize(
    ("case", "error"),
    [("undefined-name", "NameError"), ("return-outside-function", "SyntaxError")],
    ids=["undefined-name", "return-outside-function"],
)
def test_import_failure_is_a_compile_error(outcomes, case: str, error: str) -> None:
    result = outcomes[case][0].result()
    assert result.status == Status.COMPILE_ERROR, f"{result.message}\n{result.log_tail}"
    assert result.message.startswith(f"import failed: {error}")
    assert result.checks == []


def test_forbidden_import_is_rejected_without_a_worker(
    backend: LocalBackend, started: list[subprocess.Popen]
) -> None:
    source = _edit("import torch\n", "import os\nimport torch\n")
    line = source.splitlines().index("import os") + 1
    result = backend.evaluate(_candidate(source))
    assert result.status == Status.STATIC_REJECTED
    assert f"line {line}: rule 'imports': import of 'os'" in result.message
    assert started == []


def test_parallel_workers_take_turns_for_timing(tmp_path: Path) -> None:
    """Workers run side by side but hold the timing lock one at a time: their timing phases
    never overlap, so a timing is what a lone run would measure."""
    backend = LocalBackend(timeout_s=120, scratch_root=tmp_path, parallel=2)
    sources = [TEMPLATE.render({"BLOCK_L": n}) for n in (4, 16, 32)]
    # Unchecked, so that both workers reach their timing phase at about the same moment.
    results = backend.evaluate_many([_candidate(s) for s in sources], check=False)
    assert [r.status for r in results] == [Status.OK] * 3, [r.message for r in results]
    windows = sorted(r.timing_window for r in results)
    assert all(w is not None for w in windows)
    for (_, end), (start, _) in zip(windows, windows[1:], strict=False):
        assert end <= start, f"timing phases overlap: {windows}"
    assert [r.candidate_id for r in results] == [_candidate(s).id for s in sources]  # order kept
