"""The attention benchmark: its FLOP convention, its rows at the interpreted shape on a CPU, and
the `bench ops --family` option."""

from __future__ import annotations

import io

import pytest
import torch
from memos import Memo, always, by_sample
from rich.console import Console
from typer.testing import CliRunner

from agent.cli import app
from evals import bench_attention
from evals.bench_attention import (
    GRAPHED,
    launch_bounds,
    pass_flops,
    run_attention_benchmark,
    timed_per_pass,
    without_bounds,
)
from evals.bench_ops import family_ops
from kernels import ops
from search_space import get_problem, target_attention

runner = CliRunner()


def test_pass_flops_convention() -> None:
    assert pass_flops(10.0, "fwd") == 10.0
    assert pass_flops(10.0, "bwd") == 25.0  # five products per pair instead of two
    assert pass_flops(10.0, "fwd+bwd") == 35.0


def test_family_ops() -> None:
    assert family_ops("attention") == ["gdpa", "jagged_attention", "target_attention"]
    assert "embedding_bag" in family_ops("embedding") and "gdpa" not in family_ops("embedding")
    assert set(family_ops("all")) >= {"embedding_bag", "gdpa", "jagged_attention", "target_attention"}
    with pytest.raises(ValueError, match="unknown op family"):
        family_ops("conv")


def test_attention_bench_rows_on_the_interpreted_shape(monkeypatch) -> None:
    # A stand-in for kernels.ops.target_attention (being written elsewhere): the rows are what is
    # tested here, not a kernel.
    monkeypatch.setattr(bench_attention, "kernel_under_test", lambda op: (target_attention.torch_padded, ""))
    console = Console(file=io.StringIO(), width=200)
    streamed: list[dict] = []
    rows = run_attention_benchmark("target_attention", console=console, on_row=streamed.append)
    assert streamed == rows, "every row is handed on as it is measured, in order"
    by = {(r["provider"], r["pass"]): r for r in rows}
    providers = {"kernels.ops", "reference", "torch.padded", "torch.replicate_kv", "torch.flex_attention"}
    assert {p for p, _ in by} == providers | {GRAPHED}
    assert {s for _, s in by} == {"fwd", "bwd", "fwd+bwd"}
    assert by[(GRAPHED, "fwd")]["skipped"] == "CUDA graphs need a GPU"
    assert by[(GRAPHED, "bwd")]["skipped"] == "forward only (the replayed forward)"
    shape = target_attention.INTERPRETED_TIMING_SHAPES[0]
    forward_flops = target_attention.flops(shape)
    for provider in providers:
        row = by[(provider, "fwd")]
        assert row["correct"] is True and row["p50_us"] > 0 and row["flops"] == forward_flops
        assert row["tflops"] == pytest.approx(forward_flops / row["p50_us"] / 1e6)
        assert row["interpreted"] is True and row["peak_mem_bytes"] is None
    kernel = by[("kernels.ops", "fwd")]
    assert set(kernel["speedup_vs"]) == providers - {"kernels.ops"}
    assert by[("torch.padded", "fwd")]["kernel_speedup"] > 0
    for pass_name in ("bwd", "fwd+bwd"):
        for provider in ("kernels.ops", "torch.padded", "torch.replicate_kv"):
            row = by[(provider, pass_name)]
            assert row["p50_us"] > 0 and row["flops"] == pass_flops(forward_flops, pass_name)
        assert "forward only" in by[("reference", pass_name)]["skipped"]
        assert "backward on CPU" in by[("torch.flex_attention", pass_name)]["skipped"]
    assert "target_attention on cpu" in console.file.getvalue()


BASELINES = ["reference", "torch.padded", "torch.replicate_kv", "torch.flex_attention"]


def _kernel_rows(monkeypatch, kernel, passes: tuple[str, ...]) -> dict[str, dict]:
    """The kernel's rows (by pass) with `kernel` as kernels.ops.target_attention, alone."""
    monkeypatch.setattr(bench_attention, "kernel_under_test", lambda op: (kernel, ""))
    console = Console(file=io.StringIO(), width=200)
    rows = run_attention_benchmark("target_attention", console=console, passes=passes, without=BASELINES)
    return {r["pass"]: r for r in rows if r["provider"] == "kernels.ops"}


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="on a GPU the warm-up's calls come first: the interpreter's are all timed",
)
def test_a_kernel_that_memoizes_its_outputs_is_never_answered_from_memory(monkeypatch) -> None:
    # Each pass on sets of its own: the forward and backward's forwards never meet the forward
    # pass's inputs again.
    memo = Memo(target_attention.torch_padded, by_sample)
    rows = _kernel_rows(monkeypatch, memo, ("fwd", "fwd+bwd"))
    assert all(r["correct"] and r["checked_calls"] == r["timed_calls"] for r in rows.values()), rows
    assert memo.answered and not any(memo.answered), memo.answered


def test_a_kernel_answering_with_another_calls_output_is_marked_wrong(monkeypatch) -> None:
    rows = _kernel_rows(monkeypatch, Memo(target_attention.torch_padded, always), ("fwd",))
    assert rows["fwd"]["correct"] is False and "(timed call" in rows["fwd"]["message"]


def test_the_backward_passes_gradients_are_checked(monkeypatch) -> None:
    def doubled_gradients(*args, **kwargs):
        out = target_attention.torch_padded(*args, **kwargs)
        return out + (out - out.detach())  # the output's value, twice its gradient

    honest = _kernel_rows(monkeypatch, target_attention.torch_padded, ("bwd", "fwd+bwd"))
    assert all(r["correct"] is True and r["checked_calls"] >= 1 for r in honest.values()), honest
    wrong = _kernel_rows(monkeypatch, doubled_gradients, ("fwd", "bwd", "fwd+bwd"))
    assert wrong["fwd"]["correct"] is True
    assert wrong["bwd"]["correct"] is False and wrong["fwd+bwd"]["correct"] is False


def test_the_declarations_say_what_is_timed_per_pass_and_which_bounds_may_be_left_out() -> None:
    assert [op for op in family_ops("all") if timed_per_pass(op)] == [
        "gdpa",
        "jagged_attention",
        "target_attention",
    ]
    assert not timed_per_pass("embedding_bag") and not timed_per_pass("jagged_attention_grad")
    assert launch_bounds("gdpa") == ("max_q_len", "max_kv_len")
    assert launch_bounds("target_attention") == ("max_candidates", "max_history")
    assert launch_bounds("jagged_attention") == ()  # max_seq_len is required: no replayed row
    assert launch_bounds("embedding_bag") == ()
    with pytest.raises(ValueError, match="no gradients with a gradient op"):
        run_attention_benchmark("embedding_bag", console=Console(file=io.StringIO()))


@pytest.mark.parametrize("op", ["gdpa", "target_attention"])
def test_launch_bounds_give_the_synced_output(op: str, empty_library) -> None:
    # The problems' inputs carry the launch bounds (the bench's replayed row needs them): with
    # them the op gives what the call without them (which measures the lengths itself) gives,
    # on every interpreted timing shape.
    problem = get_problem(op)
    for shape in problem.interpreted_timing_shapes:
        inputs = problem.make_inputs(shape, 0, torch.device("cpu"))
        bounds = {k: inputs.kwargs[k] for k in launch_bounds(op) if inputs.kwargs.get(k) is not None}
        assert bounds and all(isinstance(v, int) and v > 0 for v in bounds.values()), bounds
        want = getattr(ops, op)(*inputs.args, **without_bounds(op, inputs.kwargs))
        got = getattr(ops, op)(*inputs.args, **inputs.kwargs)
        assert torch.equal(got, want), (op, shape.name, bounds)


def test_bench_ops_needs_an_op_or_a_family() -> None:
    for argv in (["bench", "ops"], ["bench", "ops", "--op", "gdpa", "--family", "attention"]):
        result = runner.invoke(app, argv)
        assert result.exit_code == 2 and "--op NAME or --family" in result.output
    result = runner.invoke(app, ["bench", "ops", "--family", "conv"])
    assert result.exit_code == 2 and "unknown op family 'conv'" in result.output


def test_bench_ops_output_must_be_writable(tmp_path) -> None:
    missing = tmp_path / "no-such-dir" / "rows.jsonl"
    result = runner.invoke(app, ["bench", "ops", "--op", "gdpa", "--output", str(missing)])
    assert result.exit_code == 2 and "--output" in result.output and "No such file" in result.output
