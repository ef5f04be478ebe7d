"""Where embedding_bags_update's time goes at a timing shape: the host's sort and numbering, the
rows kernel and the long-rows kernel timed apart, then the whole op at several launch knobs,
beside torch's sparse path. One CUDA device; prints a table.

    python3 -m evals.studies.update_phases [SHAPE NAME SUBSTRING] [DTYPE] [EARLIER MODULE]
"""

from __future__ import annotations

import importlib
import sys

import torch
import triton

import kernels.embedding_bags_update as kernel
from sandbox.timing import benchmark
from search_space import get_problem


def _compiled(fn) -> list[str]:
    """Registers, spills and shared memory of each compiled variant of a Triton kernel."""
    caches = getattr(fn, "device_caches", None)
    found = []
    if caches:
        for entry in caches.values():
            found.extend(entry[0].values())
    else:
        for entry in getattr(fn, "cache", {}).values():
            found.extend(entry.values())
    return [
        f"  {fn.__name__} {k.metadata.num_warps} warps: {k.n_regs} regs, {k.n_spills} spills, "
        f"{k.metadata.shared} B shared"
        for k in found
    ]


def main(pattern: str = "b64k-20f-short", dtype: str = "bf16", earlier: str = "") -> None:
    device = torch.device("cuda")
    problem = get_problem("embedding_bags_update")
    shape = next(s for s in problem.timing_shapes if pattern in s.name and s.dtype == dtype)
    inputs = problem.make_inputs(shape, 1, device)
    weights, state, grad_out, w_off, r_off, d_off, indices, offsets = inputs.args
    nnz, batch = indices.numel(), (offsets.numel() - 1) // w_off.numel()
    print(f"{shape.describe()}: {nnz:,} ids")

    def prep():  # the kernel's own host step
        return kernel.number_chunks(r_off, indices, offsets, batch, kernel.KNOBS["CHUNK"], int32_keys=True)

    def stats(fn, args=((), {})):
        return benchmark(fn, [args], device=device, max_reps=20).median_us

    rows = [("host: searchsorted, sort, number chunks", stats(prep))]
    versions = [("", kernel)]
    if earlier:  # an earlier version's module beside this one, for a side-by-side run
        versions.append((earlier + " ", importlib.import_module(earlier)))
    # (BLOCK_I, BLOCK_L, BLOCK_D, num_warps[, VECTORS]); None keeps the launch heuristic's, and
    # VECTORS False moves rows an element at a time (as before 16-byte vectors).
    configs = [(None,) * 4, (None, None, None, None, False), (2, 1, 128, 1), (1, 1, 256, 1), (2, 1, 256, 2)]
    configs += [(4, 1, 128, 2), (1, 1, 128, 1), (2, 1, 64, 1), (4, 1, 64, 2), (2, 1, 32, 1), (8, 1, 32, 2)]
    for label, module in versions:
        base = dict(module.KNOBS)
        for config in configs if not label else configs[:2]:
            names = ("BLOCK_I", "BLOCK_L", "BLOCK_D", "num_warps", "VECTORS")
            knobs = dict(zip(names, config, strict=False))
            module.VECTORS = knobs.get("VECTORS", True)
            module.KNOBS.update(base, **{k: v for k, v in knobs.items() if k in base})
            us = stats(module.embedding_bags_update, (inputs.args, inputs.kwargs))
            rows.append((f"{label}whole op, {' '.join(f'{k}={v}' for k, v in knobs.items())}", us))
        module.KNOBS.update(base)
        module.VECTORS = True
        rows.extend((f"{label}{what}", 0.0) for what in _compiled(module._rows_kernel))
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
