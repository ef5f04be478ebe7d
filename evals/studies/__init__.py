"""One-off studies: sweeps, comparisons and probes behind figures in BENCHMARKS.md. Product
benchmarks (bench ops, bench sandbox) are evals/bench_*.py; nothing here is imported by them."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import torch


def default_at_each_shape(name: str) -> Iterator[tuple]:
    """(shape, the op's default kernel, the warm-up's input sets of `bench ops`) at each of the
    op's timing shapes on this device; each shape's sets freed before the next are drawn."""
    from evals.bench_common import BenchRun
    from kernels import ops
    from kernels.registry import DISPATCHER
    from search_space import get_problem

    problem, run = get_problem(name), BenchRun.here()
    ops.op(name)  # defines the op and its default kernel
    fn = DISPATCHER.default(name)
    for shape in problem.timing_shapes:
        sets = run.input_sets(problem, shape)
        yield shape, fn, sets
        del sets
        torch.cuda.empty_cache()


def each_op(study: Callable[[str], None], ops: tuple[str, ...]) -> None:
    """`study` of each op named on the command line, or of `ops`."""
    for name in sys.argv[1:] or ops:
        study(name)
