"""Where embedding_bags_update's time goes at a timing shape: the host's sort and numbering, the
rows kernel and the long-rows kernel timed apart, then the whole op at several launch knobs,
beside torch's sparse path. One CUDA device; prints a table.

    python3 -m evals.studies.update_phases [SHAPE NAME SUBSTRING] [DTYPE]
"""

from __future__ import annotations

import sys

import torch
import triton

import kernels.embedding_bags_update as kernel
from sandbox.timing import benchmark
from search_space import get_problem


def main(pattern: str = "b64k-20f-short", dtype: str = "bf16") -> None:
    device = torch.device("cuda")
    problem = get_problem("embedding_bags_update")
    shape = next(s for s in problem.timing_shapes if pattern in s.name and s.dtype == dtype)
    inputs = problem.make_inputs(shape, 1, device)
    weights, state, grad_out, w_off, r_off, d_off, indices, offsets = inputs.args
    nnz, batch = indices.numel(), (offsets.numel() - 1) // w_off.numel()
    print(f"{shape.describe()}: {nnz:,} ids")

    def prep():
        positions = torch.arange(nnz, dtype=offsets.dtype, device=device)
        bag = torch.searchsorted(offsets[1:], positions, right=True)
        keys = r_off[bag // batch] + indices
        sorted_keys, order = torch.sort(keys, stable=True)
        starts_chunk = torch.ones(nnz, dtype=torch.int32, device=device)
        starts_chunk[1:] = sorted_keys[1:] != sorted_keys[:-1]
        starts_chunk |= positions % kernel.KNOBS["CHUNK"] == 0
        return torch.cumsum(starts_chunk, 0, dtype=torch.int32)

    def stats(fn, args=((), {})):
        return benchmark(fn, [args], device=device, max_reps=20).median_us

    rows = [("host: searchsorted, sort, number chunks", stats(prep))]
    base = dict(kernel.KNOBS)
    for block_i in (None, 8, 16, 32):
        for warps in (None, 4, 8):
            kernel.KNOBS.update(base, BLOCK_I=block_i, num_warps=warps)
            us = stats(kernel.embedding_bags_update, (inputs.args, inputs.kwargs))
            rows.append((f"whole op, BLOCK_I={block_i} num_warps={warps}", us))
    kernel.KNOBS.update(base)
    torch_us = stats(problem.baselines["torch.embedding_bag_sparse+step"], (inputs.args, inputs.kwargs))
    rows.append(("torch.embedding_bag_sparse+step", torch_us))
    # The kernels alone (the rest is host work), by the profiler.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            kernel.embedding_bags_update(*inputs.args, **inputs.kwargs)
        torch.cuda.synchronize()
    for event in prof.key_averages():
        if event.self_device_time_total > 0:
            rows.append((f"device: {event.key[:66]}", event.self_device_time_total / 3))
    for name, us in rows:
        print(f"{name:75} {us:10.1f} us")
    print(triton.__version__, torch.__version__)


if __name__ == "__main__":
    main(*sys.argv[1:])
