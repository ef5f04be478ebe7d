"""The local backend end to end: one worker process per candidate, each outcome a status.

Every worker launch costs 4-8 s on a small CPU machine (importing torch and triton), so each
outcome gets exactly one candidate and correct candidates run one trial per check shape.
"""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from sandbox import Candidate, LocalBackend, Status
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


def test_default_template_is_ok(backend: LocalBackend, scratch: Path) -> None:
    result = backend.evaluate(_candidate(DEFAULT_SOURCE), trials=1)
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


def test_wrong_kernel_names_the_shape(backend: LocalBackend) -> None:
    source = _edit(STORE, f"(acc * 2.0).{STORE[4:]}")
    result = backend.evaluate(_candidate(source), timing=False, trials=1)
    first = CHECK_SHAPES[0]
    assert result.status == Status.WRONG, f"{result.message}\n{result.log_tail}"
    assert result.message.startswith(first.describe())
    assert "outside tolerance" in result.message
    assert result.checks and not result.checks[-1].ok
    assert result.timings == []


def test_raising_entry_is_a_runtime_error(backend: LocalBackend) -> None:
    source = _edit(ENTRY_BODY, '    raise RuntimeError("candidate gave up")\n' + ENTRY_BODY)
    result = backend.evaluate(_candidate(source), timing=False, trials=1)
    assert result.status == Status.RUNTIME_ERROR, f"{result.message}\n{result.log_tail}"
    assert "RuntimeError: candidate gave up" in result.message
    assert CHECK_SHAPES[0].name in result.message
    assert "candidate gave up" in result.log_tail  # the traceback comes back


def test_hanging_entry_times_out_and_its_process_group_dies(
    scratch: Path, started: list[subprocess.Popen]
) -> None:
    source = _edit(ENTRY_BODY, "    while True:\n        pass\n" + ENTRY_BODY)
    result = LocalBackend(timeout_s=15, scratch_root=scratch).evaluate(
        _candidate(source), timing=False, trials=1
    )
    assert result.status == Status.TIMEOUT, f"{result.message}\n{result.log_tail}"
    assert "killed after 15 s" in result.message
    assert 15 <= result.wall_s < 30
    (worker,) = started
    assert worker.returncode is not None  # reaped
    # The worker led its own session, so its process group id is its pid.
    with pytest.raises(ProcessLookupError):
        os.killpg(worker.pid, 0)


@pytest.mark.parametrize(
    ("source", "error"),
    [
        # A module-level call of a name the module never defines.
        (DEFAULT_SOURCE + "\nHELPER = _make_helper()\n", "NameError"),
        # Parses (so it passes the screen's ast.parse) but does not compile.
        (_edit("import torch\n", "import torch\n\nreturn None\n"), "SyntaxError"),
    ],
    ids=["undefined-name", "return-outside-function"],
)
def test_import_failure_is_a_compile_error(backend: LocalBackend, source: str, error: str) -> None:
    result = backend.evaluate(_candidate(source), timing=False, trials=1)
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
