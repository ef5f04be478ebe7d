"""The embedding stack's training step as issue 19 counts it: the pooled lookup forward, then
the backward fused with the optimizer, both through `kernels.ops`, at the fused update's timing
shapes (search_space/embedding_bags_update.py; the model's sparse arch makes the same two calls
a step). Beside it, torch's per-feature embedding_bag forward and its sparse backward plus
optimizer step (each problem's torch baseline).

Each provider is timed over three input sets in rotation, an L2 flush before each call
(sandbox.timing.benchmark); the step's share of the copy bandwidth is the forward's minimum
bytes plus the update's over the step's time. Both ops' results are checked by `bench ops`
(`--op embedding_bags`, `--op embedding_bags_update`); this study times only. One CUDA device.

    python3 -m evals.studies.embedding_step [SHAPE NAME SUBSTRING]
"""

from __future__ import annotations

import sys

import torch

from evals.bench_ops import measure_copy_bandwidth
from sandbox.timing import benchmark
from search_space import embedding_bags, embedding_bags_update, get_problem

SETS = 3


def _forward_args(update_inputs) -> tuple[tuple, dict]:
    """The lookup's arguments for the tables, ids and bags of an update's inputs."""
    weights, _, grad_out, weight_offsets, _, dim_offsets, indices, offsets = update_inputs.args
    kw = update_inputs.kwargs
    kwargs = {
        "total_dim": grad_out.shape[1],
        "max_dim": kw["max_dim"],
        "mode": kw["pooling"],
        "per_sample_weights": kw["per_sample_weights"],
    }
    return (weights, weight_offsets, dim_offsets, indices, offsets), kwargs


def _providers():
    from kernels import ops

    torch_forward = embedding_bags.PROBLEM.baselines["torch.embedding_bag_per_feature"]
    torch_update = embedding_bags_update.PROBLEM.baselines["torch.embedding_bag_sparse+step"]

    def step(forward, update):
        """One call of the lookup, then one of the update, on an update's inputs (either may be
        None: that op is left out)."""

        def call(inputs):
            if forward is not None:
                args, kwargs = _forward_args(inputs)
                forward(*args, **kwargs)
            if update is not None:
                update(*inputs.args, **inputs.kwargs)

        return call

    return {
        "forward": step(ops.embedding_bags, None),
        "update": step(None, ops.embedding_bags_update),
        "forward + update": step(ops.embedding_bags, ops.embedding_bags_update),
        "torch forward + update": step(torch_forward, torch_update),
    }


def main(pattern: str = "", device: str = "cuda") -> None:
    """Prints a row per shape and provider. On a CPU (interpreted Triton, the interpreted timing
    shape, no copy bandwidth) only to show the study runs."""
    device = torch.device(device)
    problem = get_problem("embedding_bags_update")
    cuda = device.type == "cuda"
    copy_bw = measure_copy_bandwidth(device) if cuda else None
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s" if copy_bw else "no copy bandwidth (not a GPU)")
    print(f"{'shape':34} {'provider':24} {'us':>9} {'of copy':>8}")
    for shape in problem.timing_shapes if cuda else problem.interpreted_timing_shapes:
        if pattern not in shape.name:
            continue
        fwd_bytes, upd_bytes = embedding_bags.bytes_moved(shape), problem.bytes(shape)
        sets = [((problem.make_inputs(shape, seed, device),), {}) for seed in range(1, SETS + 1)]
        name = f"{shape.name} {shape.dtype}"
        for label, fn in _providers().items():
            nbytes = {"forward": fwd_bytes, "update": upd_bytes}.get(label, fwd_bytes + upd_bytes)
            us = benchmark(fn, sets, device=device, max_reps=30).median_us
            share = f"{nbytes / (us * 1e-6) / copy_bw:8.0%}" if copy_bw else "     n/a"
            print(f"{name:34} {label:24} {us:9.1f} {share}", flush=True)
        del sets
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
