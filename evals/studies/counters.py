"""A problem's default kernels called at one timing shape, for Nsight Compute to read their
hardware counters: the call runs WARM times (compiles, autotuning and the allocator's first
blocks), then once more, each on the same inputs, with an NVTX range named "profiled" around the
last. Under ncu, profile the last call's kernels only:

    ncu --clock-control none --nvtx --nvtx-include "profiled/" -k regex:_rows_kernel \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats \\
        python3 -m evals.studies.counters embedding_bags_update b64k-20f-short bf16

An update problem changes its inputs in place; the counters of one call do not depend on it.
Without ncu it prints the call's median time (sandbox.timing), so a run shows what the
profiled call costs unprofiled. One CUDA device.
"""

from __future__ import annotations

import sys

import torch

from kernels import ops
from kernels.registry import DISPATCHER
from sandbox.timing import benchmark
from search_space import get_problem

WARM = 3


def main(problem_name: str, pattern: str, dtype: str = "bf16") -> None:
    device = torch.device("cuda")
    problem = get_problem(problem_name)
    matches = [s for s in problem.timing_shapes if pattern in s.name and s.dtype == dtype]
    if not matches:
        names = ", ".join(f"{s.name} {s.dtype}" for s in problem.timing_shapes)
        raise SystemExit(f"{problem_name} has no timing shape matching {pattern!r} in {dtype}: {names}")
    shape = matches[0]
    inputs = problem.make_inputs(shape, 1, device)
    ops.op(problem_name)  # defines the op and its default kernel
    op = DISPATCHER.default(problem_name)
    for _ in range(WARM):
        op(*inputs.args, **inputs.kwargs)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profiled")
    op(*inputs.args, **inputs.kwargs)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    us = benchmark(op, [(inputs.args, inputs.kwargs)], device=device, max_reps=10).median_us
    print(f"{problem_name} {shape.describe()}: {us:.1f} us a call (median, L2 flushed)")


if __name__ == "__main__":
    main(*sys.argv[1:])
