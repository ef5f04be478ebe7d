"""Where embedding_bags_update's time goes at a timing shape: the whole op at several launch knobs
(with each compiled variant's registers), beside an earlier version's module if named and
torch's sparse path, then the op's kernels by the profiler. The earlier module's result is
compared with this one's first (the weights and state after one call each, on copies). One CUDA
device; prints a table.

    python3 -m evals.studies.update_phases [SHAPE NAME SUBSTRING] [DTYPE] [EARLIER MODULE]
"""

from __future__ import annotations

import importlib
import sys

import torch

import kernels.embedding_bags_update as kernel
from sandbox.timing import benchmark
from search_space import get_problem

# (BLOCK_P, BLOCK_D, num_warps[, VECTORS]); None keeps the launch heuristic's, and VECTORS False
# moves rows an element at a time (not in 16-byte vectors).
CONFIGS = [
    (None, None, None),
    (None, None, None, False),
    (32, 32, 2),
    (128, 32, 4),
    (256, 32, 8),
    (64, 64, 4),
    (128, 64, 8),
    (32, 64, 2),
    (16, 128, 2),
    (32, 128, 4),
    (64, 16, 2),
    (128, 16, 4),
]
KNOB_NAMES = ("BLOCK_P", "BLOCK_D", "num_warps", "VECTORS")


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


def _after_one_call(module, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights and state after one call of module's update, on copies."""
    weights, state, *rest = inputs.args
    weights, state = weights.clone(), state.clone()
    module.embedding_bags_update(weights, state, *rest, **inputs.kwargs)
    return weights.float(), state


def main(pattern: str = "b64k-20f-short", dtype: str = "bf16", earlier: str = "") -> None:
    device = torch.device("cuda")
    problem = get_problem("embedding_bags_update")
    shape = next(s for s in problem.timing_shapes if pattern in s.name and s.dtype == dtype)
    inputs = problem.make_inputs(shape, 1, device)
    print(f"{shape.describe()}: {inputs.args[6].numel():,} ids")
    versions = [("", kernel)]
    if earlier:  # an earlier version's module beside this one, for a side-by-side run
        versions.append((earlier + " ", importlib.import_module(earlier)))
        (w_new, s_new), (w_old, s_old) = (_after_one_call(m, inputs) for _, m in versions)
        before = inputs.args[0].float()
        moved = (w_old - before).abs().max().item()
        print(
            f"{earlier} against this module after one call: weights differ by at most "
            f"{(w_new - w_old).abs().max().item():.3g} (steps up to {moved:.3g}), state by "
            f"{(s_new - s_old).abs().max().item() if s_new.numel() else 0.0:.3g}"
        )
        del w_new, s_new, w_old, s_old, before

    def stats(fn) -> float:
        return benchmark(fn, [(inputs.args, inputs.kwargs)], device=device, max_reps=20).median_us

    rows = []
    for label, module in versions:
        base = dict(module.KNOBS)
        for config in CONFIGS if not label else CONFIGS[:1]:
            knobs = dict(zip(KNOB_NAMES, config, strict=False))
            module.VECTORS = knobs.get("VECTORS", True)
            module.KNOBS.update(base, **{k: v for k, v in knobs.items() if k in base})
            us = stats(module.embedding_bags_update)
            rows.append((f"{label}whole op, {' '.join(f'{k}={v}' for k, v in knobs.items())}", us))
        module.KNOBS.update(base)
        module.VECTORS = True
    rows.extend((what, 0.0) for what in _compiled(kernel._runs_kernel))
    rows.append(
        ("torch.embedding_bag_sparse+step", stats(problem.baselines["torch.embedding_bag_sparse+step"]))
    )
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


if __name__ == "__main__":
    main(*sys.argv[1:])
