"""The op benchmark holds the kernels it reports to the judge's rule: every timed call of a
provider on inputs it has never seen, and some timed outputs checked against the reference
(evals.bench_common.FreshInputs). A kernel that answers again from the outputs of inputs it has
seen gains nothing, and one that answers with another call's outputs is marked wrong."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch
from memos import Memo, always, by_address, by_sample
from rich.console import Console

from evals import bench_common, bench_ops
from evals.bench_common import (
    FRESH_MAX_SETS,
    FRESH_MIN_SETS,
    FRESH_WORKING_SETS,
    Checked,
    FreshInputs,
    checked_calls,
)
from evals.bench_ops import run_op_benchmark
from kernels import DISPATCHER, ops
from search_space import get_problem
from search_space.problem import Inputs


def _kernel(op: str) -> Callable:
    """The op's hand-written default kernel (the op defined first)."""
    ops.op(op)
    return DISPATCHER.default(op)


def _run(monkeypatch, op: str, providers: dict[str, Callable]) -> dict[str, dict]:
    monkeypatch.setattr(bench_ops, "_providers", lambda *args: providers)
    console = Console(file=io.StringIO(), width=250)
    rows = run_op_benchmark(op, console=console)
    return {r["provider"]: r for r in rows}


def test_a_kernel_that_memoizes_its_outputs_is_never_answered_from_memory_when_timed(monkeypatch) -> None:
    kernel = _kernel("embedding_bags")
    memos = {"by address": Memo(kernel, by_address), "by sample": Memo(kernel, by_sample)}
    rows = _run(monkeypatch, "embedding_bags", dict(memos))
    for name, memo in memos.items():
        row = rows[name]
        assert row["correct"] and row["checked_calls"] >= 1, row
        timed = memo.answered[-row["timed_calls"] :]
        assert timed and not any(timed), (name, memo.answered)


def test_a_kernel_answering_with_another_calls_outputs_is_marked_wrong(monkeypatch) -> None:
    stale = Memo(_kernel("embedding_bags"), always)
    rows = _run(monkeypatch, "embedding_bags", {"stale": stale})
    assert rows["stale"]["correct"] is False and rows["stale"]["checked_calls"] >= 1


def test_an_update_is_checked_against_the_reference_on_its_inputs_before_the_call(monkeypatch) -> None:
    # The op updates its tables and optimizer state in place: a check that compared with the
    # reference on the set the call had already updated would fail the honest kernel.
    rows = _run(monkeypatch, "embedding_bags_update", {"kernel": _kernel("embedding_bags_update")})
    row = rows["kernel"]
    assert row["correct"] and row["checked_calls"] >= 1, row


def test_a_provider_named_in_without_is_left_out(monkeypatch) -> None:
    kernel = _kernel("jagged_to_padded_dense")
    monkeypatch.setattr(bench_ops, "_providers", lambda *args: {"kept": kernel, "left out": kernel})
    console = Console(file=io.StringIO())
    rows = run_op_benchmark("jagged_to_padded_dense", console=console, without=["left out"])
    assert {r["provider"] for r in rows} == {"kept"}


@pytest.mark.parametrize("op", ["embedding_bags", "jagged_to_padded_dense"])
def test_fresh_inputs_are_sets_of_their_own_of_the_warm_ups_forms(op: str) -> None:
    problem = get_problem(op)
    shape = problem.interpreted_timing_shapes[0]
    device = torch.device("cpu")
    fresh = FreshInputs(problem, shape, device, forms=1, checks=2)
    # Each set at its own addresses, none a copy of another.
    pointers = [t.data_ptr() for inputs in fresh.sets for t in inputs.tensors() if t.numel()]
    assert len(pointers) == len(set(pointers))
    assert len({by_sample(i.args, i.kwargs) for i in fresh.sets}) == len(fresh.sets)
    # The interpreter checks all its timed calls, and every provider times every set.
    assert fresh.checked == frozenset(range(len(fresh)))
    timing = fresh.timing(Checked())
    assert timing["min_reps"] == timing["max_reps"] == len(fresh)


class _LargeSets:
    """A problem whose every set is one tensor of SET_BYTES."""

    SET_BYTES = 4096

    def make_inputs(self, shape, seed: int, device: torch.device) -> Inputs:
        return Inputs(args=(torch.zeros(self.SET_BYTES // 4, device=device),), kwargs={})

    def without_statistics(self, inputs: Inputs) -> Inputs:
        return inputs


@pytest.mark.parametrize("room", [0, 1, 5, 40])
def test_fresh_inputs_keep_to_the_budget_but_draw_the_minimum(monkeypatch, room: int) -> None:
    # A budget of `room` sets beside the pass's working sets: as many sets as fit, never fewer
    # than the minimum (the interpreter's own bound lifted, the budget a GPU's).
    problem, size = _LargeSets(), _LargeSets.SET_BYTES
    budget = (room + FRESH_WORKING_SETS) * size
    monkeypatch.setattr(bench_common, "INTERPRETED_FRESH_SETS", FRESH_MAX_SETS)
    monkeypatch.setattr(bench_common, "fresh_budget", lambda device: budget)
    fresh = FreshInputs(problem, None, torch.device("cpu"), forms=1, checks=1)
    assert len(fresh) == max(room, FRESH_MIN_SETS)


def test_checks_fall_anywhere_after_the_first_timed_call() -> None:
    seen = set().union(*(checked_calls(10, 1, every=False) for _ in range(400)))
    assert seen == set(range(1, 10))
    assert checked_calls(1, 1, every=False) == {0}
    assert checked_calls(3, 1, every=True) == {0, 1, 2}
