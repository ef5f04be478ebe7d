"""The host-compute watch (sandbox.host_ops) passes every kernel dispatch runs today, on this
machine's device (the interpreter on a CPU, compiled launches on a GPU), and sees host code that
computes on floating-point data."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest
import torch

from agent.incumbents import incumbents
from kernels.registry import KernelLibrary
from sandbox import host_ops
from sandbox.protocol import fresh_seed
from sandbox.runner import Runner, _kernel_classes
from search_space import get_problem, problem_names


def _load(source: str, entry: str, tmp_path: Path, name: str):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton reads a kernel's source through its module
    spec.loader.exec_module(module)
    return getattr(module, entry)


@pytest.mark.slow
@pytest.mark.parametrize("problem", problem_names())
def test_every_incumbent_runs_clean_under_the_watch(problem: str, tmp_path: Path, device) -> None:
    host_ops.prepare_triton(_kernel_classes())
    p = get_problem(problem)
    # The defaults (an empty library holds no other incumbent, whatever the architecture).
    for i, candidate in enumerate(incumbents(problem, KernelLibrary(tmp_path / "empty"), "any")):
        fn = _load(candidate.source, candidate.entry, tmp_path, f"incumbent_{problem}_{i}")
        for shape in p.check_shapes[:1]:
            inputs = p.make_inputs(shape, fresh_seed(), device)
            # As the runner watches this problem's calls, its inputs read-only (compared after
            # each launch, as on memory no mapping protects), but those the op updates.
            copies, given = p.host_copies_compute, [*inputs.args, *inputs.kwargs.values()]
            kept = [t for t, u in zip(inputs.tensors(), p.updated(inputs), strict=True) if not u]
            allowed = frozenset(p.host_float_ops)
            with host_ops.watching(True, allowed, copies_compute=copies, inputs=given, guarded=kept) as watch:
                fn(*inputs.args, **inputs.kwargs)
            assert watch.first is None, f"{candidate.entry} on {shape.describe()}: {watch.first}"


@pytest.mark.parametrize(
    ("host_code", "seen"),
    [
        (lambda w, i: w[i], "aten.index.Tensor"),
        (lambda w, i: w * 2, "aten.mul.Tensor"),
        (lambda w, i: w.view(torch.int32)[i], "aten.view.dtype"),
        (lambda w, i: w.tolist(), "Tensor.tolist"),
        (lambda w, i: float(w[0, 0]), "Tensor.__float__"),
        (lambda w, i: (i * 2).cumsum(0), None),  # integers: offsets, lengths, schedules
        (lambda w, i: w.new_empty(w.shape).copy_(w).t().contiguous(), None),  # bookkeeping
    ],
)
def test_the_watch_sees_host_compute_on_floating_point_data(host_code, seen: str | None) -> None:
    w, i = torch.randn(4, 3), torch.tensor([0, 2])
    with host_ops.watching(True, inputs=[w, i]) as watch:
        host_code(w, i)
    assert (watch.first is None) if seen is None else (seen in (watch.first or "")), watch.first


_BITS_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def bits(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m).to(tl.int32, bitcast=True), mask=m)


def copy_bits(x, out):
    bits[(1,)](x, out, x.numel(), BLOCK=64)
"""


@pytest.mark.parametrize(
    ("host_code", "seen"),
    [
        (lambda buf, idx: buf.cumsum(0), "aten.cumsum.default on int32 a kernel may have written"),
        (lambda buf, idx: buf[idx], "aten.index.Tensor on int32 a kernel may have written"),
        (
            lambda buf, idx: buf.clone() * 2,
            "aten.mul.Tensor on int32 a kernel may have written",
        ),  # copies too
        (lambda buf, idx: buf.to(torch.int64).sum(), "aten.sum.default on int64 a kernel may have written"),
        (lambda buf, idx: buf.tolist(), "Tensor.tolist on int32"),
        (lambda buf, idx: (idx * 2).cumsum(0), None),  # integers no kernel wrote: offsets, lengths
    ],
)
def test_the_watch_sees_host_compute_on_integers_a_kernel_wrote(
    host_code, seen, tmp_path: Path, device
) -> None:
    """A kernel can put a floating-point tensor's bits (or values) into an integer buffer; host
    code on that buffer, or on a copy of it, computes on the floats all the same."""
    host_ops.prepare_triton(_kernel_classes())
    copy_bits = _load(_BITS_KERNEL, "copy_bits", tmp_path, "bits_kernel")
    x, idx = torch.randn(40, device=device), torch.tensor([3, 1, 2], device=device)
    buf = torch.empty(40, dtype=torch.int32, device=device)
    with host_ops.watching(True, inputs=[x, idx]) as watch:
        copy_bits(x, buf)
        host_code(buf, idx)
    if seen is None:
        assert watch.first is None, watch.first
    else:
        assert seen in (watch.first or ""), watch.first


def test_host_code_never_writes_the_calls_inputs() -> None:
    """A write into an input (or a view of one) is not made, and is reported: an input used as a
    stash for the data's bits and put back before the call returns would pass every check."""
    x, i = torch.randn(8), torch.arange(8)
    keep = i.clone()
    with host_ops.watching(True, inputs=[x, i]) as watch:
        i[2:].copy_(torch.arange(6))
        i.add_(1)
    assert watch.first == "aten.copy_.default writing into the call's input (int64)", watch.first
    assert torch.equal(i, keep)
    with host_ops.watching(True, inputs=[x, i]) as watch:
        torch.arange(8).add_(1)  # the call's own tensors are its business
    assert watch.first is None, watch.first


def test_a_kernel_that_writes_an_input_is_seen(tmp_path: Path, device) -> None:
    """Where no read-only mapping stops it, a kernel's write into the call's input is found by
    comparing the inputs after each launch (whatever the interpreter writes back)."""
    host_ops.prepare_triton(_kernel_classes())
    copy_bits = _load(_BITS_KERNEL, "copy_bits", tmp_path, "bits_kernel_inputs")
    x = torch.randn(40, device=device)
    i = torch.zeros(40, dtype=torch.int32, device=device)
    out = torch.empty(40, dtype=torch.int32, device=device)
    with host_ops.watching(True, inputs=[x, i], guarded=[x, i]) as watch:
        copy_bits(x, out)  # reads an input, writes its own buffer
    assert watch.first is None, watch.first
    with host_ops.watching(True, inputs=[x, i], guarded=[x, i]) as watch:
        copy_bits(x, i)
    assert watch.first == "a kernel writing into the call's input (int32, [40])"


def test_no_kernel_launches_after_the_watch_finds_host_compute(tmp_path: Path, device) -> None:
    """Once the watch has found host compute the call's verdict is made, so a further launch is
    refused, naming the finding (a candidate that goes on would only spend the judge's time: one
    that stashed a table through its input a launch at a time ran on for 30 s interpreted)."""
    host_ops.prepare_triton(_kernel_classes())
    copy_bits = _load(_BITS_KERNEL, "copy_bits", tmp_path, "bits_kernel_after")
    x = torch.randn(40, device=device)
    out = torch.empty(40, dtype=torch.int32, device=device)
    with host_ops.watching(True, inputs=[x]) as watch:
        copy_bits(x, out)  # nothing found yet: it runs
        x * 2
        with pytest.raises(RuntimeError, match="no launch after the watch found aten.mul.Tensor"):
            copy_bits(x, torch.zeros_like(out))
    assert "aten.mul.Tensor" in (watch.first or ""), watch.first
    assert torch.equal(out, x.view(torch.int32))
    again = torch.zeros_like(out)
    copy_bits(x, again)  # outside a watch, launches run
    assert torch.equal(again, out)


@pytest.mark.parametrize("noop", [False, True], ids=["kernels", "no-op proof"])
@pytest.mark.parametrize("ending", [ValueError("gave up"), SystemExit(0)], ids=["raises", "exits"])
def test_the_runner_says_what_the_watch_found_however_the_call_ends(noop: bool, ending) -> None:
    """Host compute then an exception, or an exit, is reported as host compute (the judge makes
    it suspicious), in checks and in the no-op proof alike; without a finding, an exception in
    the no-op proof is the proof's "no output without kernels"."""

    def found_then_ends():
        torch.ones(3) * 2
        raise ending

    def ends():
        raise ValueError("gave up")

    runner = Runner(socket.socketpair()[0])
    message = {"calls": [{"id": 1, "args": [], "kwargs": {}}], "watch": True, "noop": noop}
    runner.fn = found_then_ends
    reply = runner.op_run(message, [])
    assert reply["ok"] is False and reply["error"]["kind"] == "host_compute", reply
    assert "aten.mul.Tensor" in reply["error"]["message"], reply
    runner.fn = ends
    reply = runner.op_run(message, [])
    if noop:
        assert reply == {"ok": True, "calls": [{"id": 1, "raised": "ValueError"}]}, reply
    else:
        assert reply["ok"] is False and reply["error"]["kind"] == "runtime_error", reply


def test_integers_cast_from_floating_point_data_are_the_data() -> None:
    """A cast is bookkeeping, but what it makes of floating-point values (scaled to integers,
    say) is the data: host compute on it counts."""
    x = torch.randn(16) * 2**20
    with host_ops.watching(True, inputs=[x]) as watch:
        fixed = x.to(torch.int64)  # the cast itself: bookkeeping
        assert watch.first is None
        fixed.cumsum(0)
    assert "aten.cumsum.default on int64 a kernel may have written" in (watch.first or ""), watch.first


def test_a_launch_marks_every_integer_tensor_the_call_made(tmp_path: Path, device) -> None:
    """A compiled kernel can write memory it was not given (pointer arithmetic from an argument),
    so after a launch every integer tensor the call made counts as a kernel's."""
    host_ops.prepare_triton(_kernel_classes())
    copy_bits = _load(_BITS_KERNEL, "copy_bits", tmp_path, "bits_kernel_made")
    x = torch.randn(40, device=device)
    with host_ops.watching(True, inputs=[x]) as watch:
        scratch = torch.zeros(40, dtype=torch.int64, device=device)
        scratch.cumsum(0)  # before any launch: integers the host made
        assert watch.first is None
        copy_bits(x, torch.empty(40, dtype=torch.int32, device=device))
        scratch.cumsum(0)
    assert "aten.cumsum.default on int64 a kernel may have written" in (watch.first or ""), watch.first


def test_the_autotuners_benchmark_watches_the_launches_it_times() -> None:
    """Only triton.testing's statistics run unwatched in an autotuner's benchmark: the launch it
    times (a heuristics function, the grid: the candidate's code) is watched."""

    class Fn:
        def run(self, *args, **kwargs):
            return torch.ones(3) * 2  # host compute where the launch runs

    class Tuner:
        fn = Fn()

    def bench(self, *args, config, **meta):
        torch.tensor([3.0, 1.0, 2.0]).quantile(0.5)  # the statistics
        self.fn.run(*args)
        return [1.0, 1.0, 1.0]

    tuner = Tuner()
    with host_ops.watching(True) as watch:
        assert host_ops._bench_unwatched(bench)(tuner, config=None) == [1.0, 1.0, 1.0]
    assert "aten.mul.Tensor" in (watch.first or ""), watch.first
    assert "run" not in vars(tuner.fn), "the launch is the class's own again"
    with host_ops.watching(True) as watch:
        host_ops._bench_unwatched(lambda self, config: torch.tensor([1.0]).quantile(0.5))(tuner, config=None)
    assert watch.first is None, watch.first


def test_integers_from_before_the_call_are_not_clean() -> None:
    """Integer data the call did not make since its last launch (a buffer kept from an earlier
    call, or made when the module was imported) may hold what an earlier kernel wrote there:
    host compute on it counts; reading a value or two does not."""
    kept = torch.zeros(64, dtype=torch.int64)  # as a module-level cache would hold it
    x = torch.randn(4)
    with host_ops.watching(True, inputs=[x]) as watch:
        int(kept[0])  # a flag
        assert watch.first is None
        kept.cumsum(0)
    assert "aten.cumsum.default on int64 a kernel may have written" in (watch.first or ""), watch.first
