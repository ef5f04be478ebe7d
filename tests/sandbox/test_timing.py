"""sandbox.timing.benchmark's hooks for code under test: timed calls on arguments the caller
gives each of them (`fresh`), some of their outputs checked (`check`), and the rotation over the
given sets unchanged where a caller gives neither (the judge's baselines)."""

from __future__ import annotations

import weakref

import pytest
import torch

from sandbox.timing import benchmark


class Recorder:
    """fn for benchmark: records the argument each call got and returns it doubled."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(int(x))
        return 2 * x


def _sets(*values: int) -> list[tuple[tuple, dict]]:
    return [((torch.tensor(v),), {}) for v in values]


def test_without_hooks_the_calls_rotate_over_the_sets() -> None:
    fn = Recorder()
    stats = benchmark(fn, _sets(1, 2), device=torch.device("cpu"))
    assert fn.seen == [1, 2, 1] and stats.reps == 3


def test_timed_calls_run_on_the_fresh_sets_and_their_checks_get_the_outputs() -> None:
    fn = Recorder()
    fresh = _sets(10, 11, 12)
    asked, checked = [], []

    def check(i, args, kwargs):
        asked.append(i)
        if i == 1:
            # Made before the call: it sees the inputs as they were.
            return lambda out: checked.append((int(args[0]), int(out)))
        return None

    stats = benchmark(fn, _sets(1), device=torch.device("cpu"), fresh=lambda i: fresh[i], check=check)
    assert fn.seen == [10, 11, 12] and stats.reps == 3
    assert asked == [0, 1, 2] and checked == [(11, 22)]


def test_a_calls_check_is_gone_before_the_next_call_is_checked() -> None:
    # A check may hold a copy of its set (an update's): it must not outlive its call.
    fresh = _sets(10, 11, 12)
    held: list[weakref.ref] = []
    alive_at_check: list[bool] = []

    class Copy:
        pass

    def check(i, args, kwargs):
        alive_at_check.append(any(ref() is not None for ref in held))
        copy = Copy()
        held.append(weakref.ref(copy))
        return lambda out: copy

    benchmark(Recorder(), _sets(1), device=torch.device("cpu"), fresh=lambda i: fresh[i], check=check)
    assert alive_at_check == [False, False, False]


def test_max_reps_bounds_the_calls_to_the_sets_there_are() -> None:
    fn = Recorder()
    fresh = _sets(10, 11)
    benchmark(fn, _sets(1), device=torch.device("cpu"), fresh=lambda i: fresh[i], max_reps=2)
    assert fn.seen == [10, 11]


@pytest.mark.gpu
def test_on_a_gpu_the_warm_up_runs_on_the_sets_and_the_timed_calls_on_the_fresh_ones() -> None:
    device = torch.device("cuda")
    seen: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.data_ptr())
        return x + 1

    warm = [((torch.zeros(1024, device=device),), {})]
    fresh = [((torch.full((1024,), float(i), device=device),), {}) for i in range(12)]
    outputs = {}

    def check(i, args, kwargs):
        return lambda out: outputs.__setitem__(i, float(out[0]))

    stats = benchmark(fn, warm, device=device, fresh=lambda i: fresh[i], check=check, max_reps=12)
    timed = seen[-stats.reps :]
    assert timed == [args[0].data_ptr() for args, _ in fresh[: stats.reps]]
    assert set(seen[: -stats.reps]) == {warm[0][0][0].data_ptr()}
    assert outputs == {i: i + 1.0 for i in range(stats.reps)}
