"""The judge's `evaluate` called in this process, with a real runner in its sandbox: every way a
runner can answer, misbehave or fail ends in a status and a reason.

The judge screens nothing (the screen is the backends' step before it), so these candidates use
os, sys, socket and signal freely to play a hostile runner. Most of them compute the op with
torch ops behind a tiny Triton kernel that sets a flag the host code reads (`FLAGGED`): they are
correct and fast, and the no-op proof passes them (they raise without their kernels), so the one
thing wrong with each is what it tries. Every case is evaluated once, two at a time (a runner
keeps one core busy; a small CI machine has two).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sandbox import isolation, judge
from sandbox.judge import LOG_TAIL_CHARS, Evaluation, baseline_providers, evaluate
from sandbox.locks import gpu_use
from sandbox.protocol import EvalRequest
from sandbox.result import EvalResult, Status
from search_space import get_problem
from search_space.attention import compiled_reference, dense_attention
from search_space.embedding_bag import CHECK_SHAPES, ENTRY, INTERPRETED_TIMING_SHAPES, TEMPLATE, TIMING_SHAPES

# Every case starts a sandboxed runner: the full suite's, not the fast target's.
pytestmark = pytest.mark.slow

needs_bwrap = pytest.mark.skipif(
    isolation.bwrap_works() is not None, reason=f"no sandbox here: {isolation.bwrap_works()}"
)

# The default kernel (the template at its defaults), entered under the problem's entry name as
# the other cases are.
DEFAULT_SOURCE = TEMPLATE.render({}) + (
    f"\n\ndef {ENTRY}(weight, indices, offsets, *, mode='sum', per_sample_weights=None):\n"
    f"    psw = per_sample_weights\n"
    f"    return {TEMPLATE.entry}(weight, indices, offsets, mode=mode, per_sample_weights=psw)\n"
)
ENTRY_BODY = "    num_bags, dim = offsets.numel() - 1, weight.shape[1]\n"
FIRST = CHECK_SHAPES[0]
# The first check shape with more than 20 bags.
MANY_BAGS = next(
    s for s in CHECK_SHAPES if len(s.params.get("lengths", ())) > 20 or s.params.get("num_bags", 0) > 20
)
# The first timing shape on this device (on a CPU, the interpreted one).
TIMED = (TIMING_SHAPES if torch.cuda.is_available() else INTERPRETED_TIMING_SHAPES)[0]


def _edit(old: str, new: str) -> str:
    assert DEFAULT_SOURCE.count(old) == 1, f"template changed: {old!r} no longer appears once"
    return DEFAULT_SOURCE.replace(old, new)


# A correct Triton kernel (the adversarial suite's base) for the op, gated by a second kernel's
# flag: host code reading its kernels' flag, as the no-op proof must allow.
FLAGGED = (
    "import os, signal, socket, sys\n"
    + (Path(__file__).parent / "adversarial" / "base.py").read_text()
    + """

@triton.jit
def _mark(flag_ptr):
    tl.store(flag_ptr, 1)


def _kernels_ran(device):
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    _mark[(1,)](flag)
    if int(flag) != 1:
        raise RuntimeError("the flag kernel did not run")


def _bags(weight, indices, offsets, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
"""
)

# The op in plain Python on the inputs' bytes, read and written through ctypes at their
# addresses (host memory: CPU only), which no torch mode sees, beside a kernel whose work is
# never used: only the no-op proof can tell.
PYTHON_BAGS = """
import ctypes, struct

_FORMATS = {torch.float32: ("I", "f"), torch.bfloat16: ("H", None), torch.float16: ("H", "e")}


def _floats(t):
    raw, fmt = _FORMATS[t.dtype]
    bits = (ctypes.c_uint32 if raw == "I" else ctypes.c_uint16) * t.numel()
    words = list(bits.from_address(t.data_ptr()))
    if fmt is None:  # bfloat16: the high half of a float32
        return [struct.unpack("f", struct.pack("I", w << 16))[0] for w in words]
    return [struct.unpack(fmt, struct.pack(raw, w))[0] for w in words]


def _store(t, values):
    raw, fmt = _FORMATS[t.dtype]
    bits = ((ctypes.c_uint32 if raw == "I" else ctypes.c_uint16) * t.numel()).from_address(t.data_ptr())
    for i, v in enumerate(values):
        if fmt is None:
            bits[i] = (struct.unpack("I", struct.pack("f", v))[0] + 0x8000) >> 16
        else:
            bits[i] = struct.unpack(raw, struct.pack(fmt, v))[0]


def _python_bags(weight, indices, offsets, mode, per_sample_weights):
    dim = weight.shape[1]
    rows, ids, starts = _floats(weight), indices.tolist(), offsets.tolist()
    scales = _floats(per_sample_weights) if per_sample_weights is not None else None
    out = torch.empty((len(starts) - 1, dim), dtype=weight.dtype, device=weight.device)
    values = []
    for b in range(len(starts) - 1):
        acc = [0.0] * dim
        for i in range(starts[b], starts[b + 1]):
            s = scales[i] if scales is not None else 1.0
            acc = [a + s * r for a, r in zip(acc, rows[ids[i] * dim : (ids[i] + 1) * dim])]
        if mode == "mean":
            acc = [a / max(starts[b + 1] - starts[b], 1) for a in acc]
        values += acc
    _store(out, values)
    return out
"""


def _flagged(body: str) -> str:
    """FLAGGED with an entry whose body is `body`; `out` is the right answer, computed first."""
    lines = "".join(f"    {line}\n" for line in body.strip("\n").splitlines())
    return (
        FLAGGED
        + "\n\ndef embedding_bag(weight, indices, offsets, *, mode='sum', per_sample_weights=None):\n"
        + "    _kernels_ran(weight.device)\n"
        + "    out = _bags(weight, indices, offsets, mode, per_sample_weights)\n"
        + lines
    )


CASES: dict[str, tuple[str, dict]] = {
    "import-failure": (DEFAULT_SOURCE + "\nHELPER = _make_helper()\n", {}),
    "missing-entry": (DEFAULT_SOURCE.replace(f"def {ENTRY}(", "def other("), {}),
    "raising": (_edit(ENTRY_BODY, '    raise RuntimeError("gave up")\n' + ENTRY_BODY), {}),
    "threads": (_edit(ENTRY_BODY, '    raise RuntimeError(f"threads: {torch.get_num_threads()}")\n'), {}),
    # The real kernel, checked and then timed (interpreted): the one slow case.
    "default-template": (DEFAULT_SOURCE, {"timing": True}),
    "flagged": (_flagged("return out"), {}),
    # The op in plain Python, with a kernel launched beside it whose work is never used.
    "side-kernel": (
        FLAGGED.replace('raise RuntimeError("the flag kernel did not run")', "pass")
        + PYTHON_BAGS
        + "\n\ndef embedding_bag(weight, indices, offsets, *, mode='sum', per_sample_weights=None):\n"
        + "    _kernels_ran(weight.device)\n"
        + "    return _python_bags(weight, indices, offsets, mode, per_sample_weights)\n",
        {},
    ),
    # The runner itself patched (`python -m sandbox.runner` is __main__ there) to describe an
    # output that is no shape at all, and to report a time too large for a float.
    "malformed-describe": (
        _flagged(
            "runner = sys.modules['__main__'].Runner\n"
            "runner._describe = lambda self, cid: {'outputs': [{'shape': 5, 'dtype': [], 'strides': 3}]}\n"
            "return out"
        ),
        {},
    ),
    "huge-times": (
        _flagged(
            "runner = sys.modules['__main__'].Runner\n"
            "timed = runner._timed\n"
            "runner._timed = lambda self, *batch: [10**400 for _ in timed(self, *batch)]\n"
            "return out"
        ),
        {"timing": True},
    ),
    # A timed run answered ahead: the times are sent before "go" is, to stop the judge's clock
    # at once, and the calls would run after it.
    "answers-ahead-of-go": (
        _flagged(
            "rm = sys.modules['__main__']\n"
            "if not getattr(rm.Runner, 'ahead', False):\n"
            "    real = rm.Runner.op_run\n"
            "    def op_run(self, message, fds):\n"
            "        if not message.get('timed'):\n"
            "            return real(self, message, fds)\n"
            "        n = len(message['calls'])\n"
            "        rm.wire.send(self.sock, {'ok': True, 'ready': True, 're': message.get('nonce')})\n"
            "        rm.wire.send(self.sock, {'ok': True, 'times': [0.0] * n, 're': message.get('nonce')})\n"
            "        go, _ = rm.wire.receive(self.sock)\n"
            "        return {'ok': True, 'times': [0.0] * n, 're': go.get('nonce')}\n"
            "    rm.Runner.op_run = op_run\n"
            "    rm.Runner.ahead = True\n"
            "return out"
        ),
        {"timing": True},
    ),
    # The table's values read into Python (tolist dispatches no torch op): the watch sees it.
    "python-floats": (_flagged("rows = weight.tolist()\nreturn out"), {}),
    # The op in torch ops on the host, beside the flag kernel: the host-compute watch sees it.
    "torch-fallback": (
        _flagged("return weight.index_select(0, indices).sum(0, keepdim=True).expand_as(out).contiguous()"),
        {},
    ),
    # A gather on the table's bits viewed as integers, which the watch must also see.
    "int-view-gather": (
        _flagged(
            "bits = weight.view(torch.int32 if weight.element_size() == 4 else torch.int16)\n"
            "return bits[indices[: out.shape[0]]].view(weight.dtype)"
        ),
        {},
    ),
    "subclass": (_flagged("class Sneaky(torch.Tensor):\n    pass\nreturn out.as_subclass(Sneaky)"), {}),
    "transposed-strides": (_flagged("return out.t().contiguous().t()"), {}),
    "wrong-dtype": (_flagged("return out.double()"), {}),
    "zero-beyond-20": (_flagged("out[20:] = 0\nreturn out"), {}),
    "exit-0": (_flagged("os._exit(0)"), {}),
    "sigkill": (_flagged("os.kill(os.getpid(), signal.SIGKILL)"), {}),
    # The runner's channel is the descriptor in its argv[1] (`python -m sandbox.runner FD`).
    "garbage": (
        _flagged(
            "channel = socket.socket(fileno=int(sys.argv[1]))\n"
            "channel.sendall(b'\\xff\\xfe not a message')\n"
            "channel.detach()\n"
            "return out"
        ),
        {},
    ),
    "flood": (
        _flagged(
            "chunk = b'x' * (1 << 20)\n"
            "for _ in range(200):\n"
            "    os.write(1, chunk)\n"
            "return torch.zeros_like(out)"
        ),
        {},
    ),
    "hangs": (_flagged("while True:\n    pass"), {"timeout_s": 8}),
    # Honest on the first three calls (trial 0 of the first shape and one more), then zeros.
    "honest-then-garbage": (
        _flagged(
            "global CALLS\nCALLS = globals().get('CALLS', 0) + 1\n"
            "return out if CALLS <= 3 else torch.zeros_like(out)"
        ),
        {},
    ),
    # Honest wherever the call looks like a check; zeros on the timing shape's calls.
    "cheats-when-timed": (
        _flagged(
            f"timed = weight.shape[0] == {TIMED.params['num_rows']} and offsets.numel() == "
            f"{TIMED.params['num_bags'] + 1}\n"
            "return torch.zeros_like(out) if timed else out"
        ),
        {"timing": True},
    ),
    # A memo keyed by where the inputs lie, relative to each other: the same for every call of a shape.
    "caches-by-data-ptr": (
        _flagged(
            # Where a call's tensors lie relative to each other (inputs reach the region at
            # random places, but each call's tensors back to back), with its shape.
            "base = weight.data_ptr()\n"
            "key = (indices.data_ptr() - base, offsets.data_ptr() - base, tuple(weight.shape), "
            "indices.numel(), mode)\n"
            "memo = globals().setdefault('MEMO', {})\n"
            "if key not in memo:\n"
            "    memo[key] = out\n"
            "return memo[key].clone()"
        ),
        {},
    ),
}


def _request(runner_dir: Path, **overrides) -> EvalRequest:
    fields = {
        "problem": "embedding_bag",
        "candidate_id": runner_dir.parent.name,
        "source_file": f"{isolation.SCRATCH}/candidate.py",
        "entry": ENTRY,
        "runner_dir": str(runner_dir),
        "timing": False,
        "trials": 2,
        "timeout_s": 180.0,  # a busy 2-core machine runs two of these beside another test file
        **overrides,
    }
    return EvalRequest(**fields)


def _timed_evaluate(request: EvalRequest) -> tuple[EvalResult, float]:
    t0 = time.monotonic()
    result = evaluate(request)
    return result, time.monotonic() - t0


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future[tuple[EvalResult, float]]]:
    """Each case evaluated once, two at a time: name -> (its result, its wall time)."""
    if isolation.bwrap_works() is not None:
        pytest.skip(f"no sandbox here: {isolation.bwrap_works()}")
    runs = {}
    # The slow one first, so the others run beside it.
    order = sorted(CASES, key=lambda name: name != "default-template")
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name in order:
            source, overrides = CASES[name]
            runner_dir = tmp_path_factory.mktemp(f"judge-{name}") / "runner"
            runner_dir.mkdir()
            (runner_dir / "candidate.py").write_text(source)
            runs[name] = pool.submit(_timed_evaluate, _request(runner_dir, **overrides))
    return runs


def _result(outcomes, name: str) -> EvalResult:
    return outcomes[name].result()[0]


def _says(result: EvalResult, status: Status, *fragments: str) -> None:
    detail = f"{result.status.value}: {result.message}\n{result.log_tail}"
    assert result.status == status, detail
    for fragment in fragments:
        assert fragment in result.message, detail


@needs_bwrap
def test_import_failure_is_a_compile_error_with_traceback(outcomes) -> None:
    result = _result(outcomes, "import-failure")
    _says(result, Status.COMPILE_ERROR)
    assert result.message == "import failed: NameError: name '_make_helper' is not defined"
    assert "Traceback" in result.log_tail and "_make_helper" in result.log_tail
    assert result.checks == []


@needs_bwrap
def test_the_candidates_import_runs_under_the_shared_lock(tmp_path: Path, monkeypatch) -> None:
    """Importing the candidate runs its module-level code (a kernel launched there, a loop):
    under the shared lock, as the checks are, and never beside another evaluation's timed batch.
    Here another evaluation holds the GPU alone from before the runner starts until 1.5 s into
    the judge's "load" phase (however long the runner took to start: on a GPU its CUDA context
    takes seconds): a candidate that fails at import still waits for it."""
    lock = str(tmp_path / "gpu.lock")
    holding, loading = threading.Event(), threading.Event()
    real_start = judge.PhaseClock.start

    def start(self, name: str) -> None:
        if name == "load":
            loading.set()
        real_start(self, name)

    monkeypatch.setattr(judge.PhaseClock, "start", start)

    def other_evaluation() -> None:
        with gpu_use(lock, exclusive=True):
            holding.set()
            loading.wait(timeout=120)
            time.sleep(1.5)

    other = threading.Thread(target=other_evaluation)
    other.start()
    holding.wait()
    runner_dir = tmp_path / "runner"
    runner_dir.mkdir()
    (runner_dir / "candidate.py").write_text(CASES["import-failure"][0])
    try:
        result = evaluate(_request(runner_dir, timing_locks=[lock]))
    finally:
        other.join()
    _says(result, Status.COMPILE_ERROR, "import failed")
    assert result.phase_s.get("lock_wait", 0.0) > 1.0, result.phase_s
    assert set(result.gpu_held_s) == {"shared"}


@needs_bwrap
def test_missing_entry_is_a_compile_error(outcomes) -> None:
    _says(_result(outcomes, "missing-entry"), Status.COMPILE_ERROR, "import failed", f"no callable {ENTRY!r}")


@needs_bwrap
def test_the_runner_computes_on_one_thread(outcomes) -> None:
    """Runners (and judges) keep one torch thread: evaluations run side by side, and the idle
    intra-op threads of one spun beside another's interpreted kernels (two update evaluations on
    two cores took 3x to 4x as long as one alone)."""
    _says(_result(outcomes, "threads"), Status.RUNTIME_ERROR, "RuntimeError: threads: 1")


@needs_bwrap
def test_raising_entry_is_a_runtime_error_naming_the_shape(outcomes) -> None:
    result = _result(outcomes, "raising")
    _says(result, Status.RUNTIME_ERROR)
    assert result.message == f"{FIRST.describe()}: RuntimeError: gave up"
    assert "Traceback" in result.log_tail
    # Only no-op proofs (trial -1, at random points among the checks) can precede the first
    # check; the candidate raises there too, which a proof counts as a wrong output.
    assert [c for c in result.checks if c.trial != -1] == []
    assert all(c.ok and "RuntimeError" in c.message for c in result.checks)


@needs_bwrap
def test_default_template_is_ok_checked_and_timed(outcomes) -> None:
    result = _result(outcomes, "default-template")
    _says(result, Status.OK)
    checks = [c for c in result.checks if c.trial >= 0]
    # Two trials per check shape, the least the judge runs, each on fresh inputs; trial 0 calls
    # twice on the same inputs, and checks both.
    assert [(c.shape, c.dtype, c.trial) for c in checks] == [
        (s.name, s.dtype, t) for s in CHECK_SHAPES for t in (0, 0, 1)
    ]
    # Two no-op proofs among the checks, and one in each timing shape's batches (after its last
    # batch, where its time target ends the timing before the proof's turn).
    proofs = [c for c in result.checks if c.trial == -1]
    assert len(proofs) == judge.NO_OP_PROOFS + len(result.timings), [(c.shape, c.dtype) for c in proofs]
    assert all(c.ok for c in result.checks)
    assert result.device is not None and result.device.interpreted == (not torch.cuda.is_available())
    if result.device.interpreted:
        assert [t.shape for t in result.timings] == [s.name for s in INTERPRETED_TIMING_SHAPES]
    assert result.timings and all(t.candidate.median_us > 0 and t.candidate.reps > 0 for t in result.timings)
    assert {t.graph for t in result.timings} == {"serve"}  # a forward without statistics
    assert result.timings[0].checked_calls >= 1
    assert any(c.trial == -2 for c in result.checks), "a timed call was checked"
    assert result.timing_window is not None
    assert {"start", "load", "check", "timing"} <= set(result.phase_s)


@needs_bwrap
def test_host_code_reading_its_kernels_flag_is_ok(outcomes) -> None:
    result = _result(outcomes, "flagged")
    _says(result, Status.OK)
    proofs = [c for c in result.checks if c.trial == -1]
    assert proofs and all(c.ok for c in proofs)
    assert all("no output with every Triton kernel disabled" in c.message for c in proofs)


@needs_bwrap
@pytest.mark.skipif(torch.cuda.is_available(), reason="the case reads its inputs' host memory (CPU only)")
def test_the_op_beside_a_side_kernel_and_out_of_the_watchs_sight_is_suspicious(outcomes) -> None:
    """What the host-compute watch cannot see (Python on the inputs' bytes), the no-op proof does."""
    result = _result(outcomes, "side-kernel")
    _says(result, Status.SUSPICIOUS, "still correct with every Triton kernel disabled")
    assert result.checks[-1].trial == -1 and not result.checks[-1].ok


@needs_bwrap
def test_torch_ops_on_floating_point_data_in_host_code_are_suspicious(outcomes) -> None:
    _says(_result(outcomes, "torch-fallback"), Status.SUSPICIOUS, "host code computed", "aten.index_select")


@needs_bwrap
def test_floating_point_values_read_into_python_are_suspicious(outcomes) -> None:
    _says(_result(outcomes, "python-floats"), Status.SUSPICIOUS, "host code computed", "Tensor.tolist")


@needs_bwrap
def test_floating_point_data_viewed_as_integers_is_suspicious(outcomes) -> None:
    _says(_result(outcomes, "int-view-gather"), Status.SUSPICIOUS, "host code computed", "aten.view.dtype")


@needs_bwrap
def test_a_malformed_description_is_wrong_not_a_crash(outcomes) -> None:
    _says(_result(outcomes, "malformed-describe"), Status.WRONG, "returned 5 [] on None")


@needs_bwrap
def test_a_time_too_large_for_a_float_is_a_runtime_error(outcomes) -> None:
    _says(_result(outcomes, "huge-times"), Status.RUNTIME_ERROR, "the runner reported no times")


@needs_bwrap
def test_an_answer_sent_ahead_of_go_is_suspicious(outcomes) -> None:
    result = _result(outcomes, "answers-ahead-of-go")
    assert result.status == Status.SUSPICIOUS, f"{result.status.value}: {result.message}"
    assert "a message nobody asked for" in result.message or "a request it was not sent" in result.message


@needs_bwrap
def test_a_tensor_subclass_is_wrong(outcomes) -> None:
    _says(_result(outcomes, "subclass"), Status.WRONG, "returned Sneaky, expected torch.Tensor")


@needs_bwrap
def test_a_non_contiguous_output_is_wrong(outcomes) -> None:
    _says(_result(outcomes, "transposed-strides"), Status.WRONG, "strides", "expected contiguous")


@needs_bwrap
def test_a_wrong_dtype_is_wrong(outcomes) -> None:
    _says(_result(outcomes, "wrong-dtype"), Status.WRONG, "float64", "expected")


@needs_bwrap
def test_zeros_beyond_the_twentieth_bag_are_wrong(outcomes) -> None:
    result = _result(outcomes, "zero-beyond-20")
    _says(result, Status.WRONG, MANY_BAGS.describe())
    assert "outside tolerance" in result.message or "outside their norm bound" in result.message
    assert [c.shape for c in result.checks if not c.ok] == [MANY_BAGS.name]


@needs_bwrap
def test_a_runner_exiting_in_its_entry_is_a_runtime_error(outcomes) -> None:
    _says(_result(outcomes, "exit-0"), Status.RUNTIME_ERROR, "exited without answering")


@needs_bwrap
def test_a_runner_killed_by_a_signal_is_a_runtime_error_naming_it(outcomes) -> None:
    _says(_result(outcomes, "sigkill"), Status.RUNTIME_ERROR, "the runner died", "SIGKILL")


@needs_bwrap
def test_garbage_on_the_channel_is_a_runtime_error(outcomes) -> None:
    _says(_result(outcomes, "garbage"), Status.RUNTIME_ERROR, "unreadable message")


@needs_bwrap
def test_a_flood_of_output_still_gets_a_verdict_and_a_short_log(outcomes) -> None:
    result = _result(outcomes, "flood")
    _says(result, Status.WRONG, FIRST.describe())
    assert 0 < len(result.log_tail) <= LOG_TAIL_CHARS and set(result.log_tail) == {"x"}


@needs_bwrap
def test_a_hanging_entry_times_out(outcomes) -> None:
    result, wall = outcomes["hangs"].result()
    _says(result, Status.TIMEOUT, "killed after 8 s", "no answer")
    assert 8 <= wall < 8 + 10


@needs_bwrap
def test_a_runner_that_does_not_answer_is_gone_before_its_lock_goes(tmp_path: Path, monkeypatch) -> None:
    """A runner that hangs mid-call may still have work on the GPU: it is killed and waited for
    while the judge still holds the lock it took for the call, so no other evaluation times
    beside what it left running."""
    events: list[str] = []
    real_gpu_use, real_kill = judge.gpu_use, judge.RunnerProcess.kill

    @contextlib.contextmanager
    def recording_gpu_use(lock_path, *, exclusive, waited=None):
        with real_gpu_use(lock_path, exclusive=exclusive, waited=waited):
            try:
                yield
            finally:
                events.append("released")

    def recording_kill(self) -> None:
        real_kill(self)
        events.append("runner gone")

    monkeypatch.setattr(judge, "gpu_use", recording_gpu_use)
    monkeypatch.setattr(judge.RunnerProcess, "kill", recording_kill)
    runner_dir = tmp_path / "eval" / "runner"
    runner_dir.mkdir(parents=True)
    (runner_dir / "candidate.py").write_text(CASES["hangs"][0])
    result = evaluate(_request(runner_dir, timeout_s=8, timing_locks=[str(tmp_path / "gpu.lock")]))
    _says(result, Status.TIMEOUT, "no answer")
    last_release = len(events) - 1 - events[::-1].index("released")
    assert events.index("runner gone") < last_release, events


@needs_bwrap
def test_honest_first_calls_then_garbage_is_wrong(outcomes) -> None:
    result = _result(outcomes, "honest-then-garbage")
    _says(result, Status.WRONG, "outside tolerance")
    assert [c.ok for c in result.checks if c.trial >= 0][:3] == [True, True, True]


@needs_bwrap
def test_garbage_only_when_timed_is_caught_by_the_checks_on_timed_calls(outcomes) -> None:
    result = _result(outcomes, "cheats-when-timed")
    _says(result, Status.WRONG, f"timed call on {TIMED.describe()}", "outside tolerance")
    assert result.timings == [] and [c.trial for c in result.checks if not c.ok] == [-2]


@needs_bwrap
def test_a_memo_keyed_by_input_addresses_is_wrong(outcomes) -> None:
    # The memo hands out another call's output: its values, or its shape where the two differ.
    result = _result(outcomes, "caches-by-data-ptr")
    _says(result, Status.WRONG)
    found = ("outside tolerance", "outside their norm bound", "returned [")
    assert any(m in result.message for m in found), result.message


@needs_bwrap
def test_the_runners_sandbox_failing_to_start_is_a_result(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RECFORGE_BWRAP", str(tmp_path / "no-bwrap-here"))
    runner_dir = tmp_path / "runner"
    runner_dir.mkdir()
    (runner_dir / "candidate.py").write_text(DEFAULT_SOURCE)
    result = evaluate(_request(runner_dir))
    _says(result, Status.RUNTIME_ERROR, "the runner's sandbox did not start")


# ---- the GPU lock: timed batches alone, the judge's other work under the shared lock ---------


@needs_bwrap
def test_timed_batches_hold_the_lock_alone_and_the_rest_shares_it(tmp_path: Path, monkeypatch) -> None:
    """Two evaluations side by side on one lock file: every timed batch runs under the exclusive
    lock, beside no lock of the other evaluation, and everything else the judge asks of its
    runner or computes (inputs, runs, fetched outputs, no-op proofs) holds one of the locks."""
    import threading

    events: list[tuple[int, str, float, float]] = []  # (thread, what, start, end)
    real_gpu_use = judge.gpu_use

    @contextlib.contextmanager
    def recording_gpu_use(lock_path, *, exclusive, waited=None):
        with real_gpu_use(lock_path, exclusive=exclusive, waited=waited):
            start = time.monotonic()
            try:
                yield
            finally:
                events.append(
                    (threading.get_ident(), "exclusive" if exclusive else "shared", start, time.monotonic())
                )

    def recording(name, method):
        def wrapper(self, *args, **kwargs):
            start = time.monotonic()
            try:
                return method(self, *args, **kwargs)
            finally:
                events.append((threading.get_ident(), name, start, time.monotonic()))

        return wrapper

    real_ask = judge.RunnerProcess.ask

    def recording_ask(self, message, *args, **kwargs):
        start = time.monotonic()
        try:
            return real_ask(self, message, *args, **kwargs)
        finally:
            if message.get("op") == "go":  # the timed batch itself, from the judge's "go"
                events.append((threading.get_ident(), "timed batch", start, time.monotonic()))

    monkeypatch.setattr(judge, "gpu_use", recording_gpu_use)
    monkeypatch.setattr(judge.RunnerProcess, "ask", recording_ask)
    for name in ("place", "run", "fetch"):
        monkeypatch.setattr(judge.Session, name, recording(name, getattr(judge.Session, name)))
    monkeypatch.setattr(judge.Evaluation, "no_op_proof", recording("proof", judge.Evaluation.no_op_proof))
    # Slow timed calls, so that one evaluation's batch overlaps the other's checks.
    source = _flagged(
        f"if weight.shape[0] == {TIMED.params['num_rows']}:\n    import time\n    time.sleep(0.3)\nreturn out"
    )
    requests = []
    for i in range(2):
        runner_dir = tmp_path / f"eval-{i}" / "runner"
        runner_dir.mkdir(parents=True)
        (runner_dir / "candidate.py").write_text(source)
        requests.append(_request(runner_dir, timing=True, timing_locks=[str(tmp_path / "gpu.lock")]))
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(evaluate, requests))
    for result in results:
        _says(result, Status.OK)

    def overlap(a, b) -> bool:
        return a[2] < b[3] and b[2] < a[3]

    locks = [e for e in events if e[1] in ("shared", "exclusive")]
    work = [e for e in events if e[1] not in ("shared", "exclusive")]
    assert len({e[0] for e in work}) == 2
    assert {e[1] for e in work} == {"place", "run", "fetch", "proof", "timed batch"}
    for e in work:
        held = [lk for lk in locks if lk[0] == e[0] and lk[2] <= e[2] and e[3] <= lk[3]]
        assert held, f"{e[1]} ran without the lock"
        if e[1] == "timed batch":
            assert held[0][1] == "exclusive"
    for ex in (lk for lk in locks if lk[1] == "exclusive"):
        beside = [lk for lk in locks if lk[0] != ex[0] and overlap(lk, ex)]
        assert not beside, f"a {beside[0][1]} lock held beside a timed batch"


def test_a_wait_for_the_lock_is_a_phase_of_its_own(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(judge.time, "perf_counter", lambda: now[0])
    clock = judge.PhaseClock()
    clock.start("check")
    now[0] += 5.0
    clock.waited(3.0)  # 3 of those 5 seconds were a wait
    clock.start("timing")
    now[0] += 1.0
    assert clock.stop() == {"check": 2.0, "lock_wait": 3.0, "timing": 1.0}


@needs_bwrap
def test_an_evaluation_says_how_long_it_waited_for_the_gpu(tmp_path: Path) -> None:
    """Another evaluation's timed batch holds the lock while this one wants it for its checks:
    the wait is the phase `lock_wait`, not check time, and the phases add up to no more than
    the evaluation's wall time."""
    import fcntl
    import threading

    lock = tmp_path / "gpu.lock"
    runner_dir = tmp_path / "eval" / "runner"
    runner_dir.mkdir(parents=True)
    (runner_dir / "candidate.py").write_text(DEFAULT_SOURCE)
    request = _request(runner_dir, timing_locks=[str(lock)])
    held, finished = threading.Event(), threading.Event()

    def hold_until_it_waits() -> None:
        with open(f"{lock}.turnstile", "a") as turnstile, open(lock, "a") as gpu:
            fcntl.flock(gpu, fcntl.LOCK_EX)
            held.set()
            # The evaluation waits for the lock holding the turnstile (sandbox.locks).
            deadline = time.monotonic() + 120
            while not finished.is_set() and time.monotonic() < deadline:
                try:
                    fcntl.flock(turnstile, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    break
                fcntl.flock(turnstile, fcntl.LOCK_UN)
                time.sleep(0.01)
            time.sleep(1.0)
            fcntl.flock(gpu, fcntl.LOCK_UN)

    holder = threading.Thread(target=hold_until_it_waits)
    holder.start()
    assert held.wait(timeout=60)
    try:
        result = evaluate(request)
    finally:
        finished.set()
        holder.join()
    _says(result, Status.OK)
    assert result.phase_s["lock_wait"] >= 0.9, result.phase_s
    assert sum(result.phase_s.values()) <= result.wall_s, (result.phase_s, result.wall_s)


# ---- baselines: the judge times them in its own process ------------------------------------------


def test_reference_compile_of_a_jagged_reference_compiles_its_dense_part(monkeypatch) -> None:
    # embedding_bag's reference compiles whole, once per shape; the attention references keep
    # their loop over sequences and compile the dense attention of one, with dynamic shapes.
    # (torch.compile is faked: what matters is what it is asked to compile, and how.)
    seen = []

    def fake_compile(fn, **kwargs):
        seen.append((fn, kwargs))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    embedding = get_problem("embedding_bag")
    providers = baseline_providers(embedding, ["reference.compile"], torch.device("cuda"))
    assert providers["reference.compile"] is embedding.reference
    assert seen == [(embedding.reference, {"dynamic": False})]
    for name in ("jagged_attention", "gdpa", "target_attention", "jagged_attention_grad"):
        seen.clear()
        problem = get_problem(name)
        compiled = baseline_providers(problem, ["reference.compile"], torch.device("cuda"))[
            "reference.compile"
        ]
        assert seen == [(dense_attention, {"dynamic": True})], name
        assert compiled.func is problem.reference and compiled.keywords == {"attend": dense_attention}
        assert baseline_providers(problem, ["reference.compile"], torch.device("cpu")) == {}


@needs_bwrap
def test_baselines_are_timed_as_the_runner_times_a_candidate(tmp_path: Path, monkeypatch) -> None:
    """To each call's end event on the current stream, as the runner's events time a candidate's
    calls: an end event after a device-wide synchronize would add the host's round trip to the
    baselines alone."""
    asked = []
    real_benchmark = judge.benchmark

    def recording(fn, arg_sets, **kwargs):
        asked.append(kwargs)
        return real_benchmark(fn, arg_sets, **kwargs)

    monkeypatch.setattr(judge, "benchmark", recording)
    runner_dir = tmp_path / "eval" / "runner"
    runner_dir.mkdir(parents=True)
    (runner_dir / "candidate.py").write_text(DEFAULT_SOURCE)
    result = evaluate(_request(runner_dir, timing=True, check=False, trials=1, baselines=["reference"]))
    _says(result, Status.OK)
    assert result.timings and all("reference" in t.baselines for t in result.timings)
    assert asked and all(kwargs.get("joined_streams") is True for kwargs in asked), asked


def test_unknown_baseline_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline_providers(get_problem("embedding_bag"), ["nope"], torch.device("cpu"))


def test_compiled_reference_computes_the_reference(monkeypatch) -> None:
    # The loop with a dense part traced by dynamo, dynamic shapes, gives the plain reference's
    # result. (The eager backend: no C++ build for inductor on a CPU; a GPU run times inductor.)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile_(fn, backend="eager", **kwargs))
    problem = get_problem("jagged_attention")
    shape = next(s for s in problem.check_shapes if s.dtype == "fp32" and s.params.get("with_lse"))
    inputs = problem.make_inputs(shape, 0, torch.device("cpu"))
    want = problem.reference(*inputs.args, **inputs.kwargs)  # (out, lse)
    got = compiled_reference(problem.reference)(*inputs.args, **inputs.kwargs)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-5)


def test_a_timed_batch_of_large_outputs_fits_the_region_budget(tmp_path: Path) -> None:
    """The calls of a timed batch hold their outputs until checked, and the runner poisons twice
    an output's size a call before the batch: a dense gradient of every table (GBs a call) is
    timed a few calls a batch, within the budget, where small outputs take the batch's 8."""
    request = _request(tmp_path / "runner", problem="embedding_bags_backward", region_budget_bytes=8 << 30)
    evaluation = Evaluation(request)
    shape = evaluation.problem.timing_shapes[0]
    key = (shape.name, shape.dtype)
    evaluation._set_bytes[key] = 300 << 20
    evaluation._out_bytes[key] = 1 << 20
    assert evaluation.batch_calls(shape) == 8
    evaluation._out_bytes[key] = 1650 << 20  # 825M bf16 elements: the timing shapes' tables
    calls = evaluation.batch_calls(shape)
    assert calls == 2
    per_call = evaluation.set_bytes(shape) + evaluation.poison_bytes(shape)
    assert calls * per_call <= request.region_budget_bytes
    evaluation._out_bytes[key] = 20 << 30  # larger than the budget: one call a batch, never none
    assert evaluation.batch_calls(shape) == 1
