"""embedding_bags' forward at each timing shape under several launch tiles (its KNOBS), beside
torch's per-feature lookups, as GB/s and the fraction of the copy bandwidth measured in the same
run. One CUDA device; prints a table per shape.

    python3 -m evals.studies.bags_tiles [SHAPE NAME SUBSTRING] [FIRST N TILES] [EARLIER MODULE]

With an earlier version's module (e.g. `git show COMMIT:kernels/embedding_bags.py >
evals/studies/_bags_before.py`, then `evals.studies._bags_before`), each shape first times its
default and this one's, alternately, twice each, before the tiles.
"""

from __future__ import annotations

import importlib
import sys

import torch

import kernels.embedding_bags as kernel
from evals.bench_ops import measure_copy_bandwidth
from sandbox.protocol import compare
from sandbox.timing import benchmark
from search_space import get_problem

# (BLOCK_B, BLOCK_L, BLOCK_D, ACC_3D, num_warps[, PROGRAMS[, VECTORS[, FLAT[, SLICES_TOGETHER]]]]);
# None keeps the launch heuristic's. PROGRAMS: a persistent grid of that many programs, each
# looping over blocks (132 SMs on an H100 or H200); VECTORS False: rows move an element at a
# time, as before 16-byte vectors (the kernel's VECTORS switch); FLAT: a block's ids in chunks of
# BLOCK_B x BLOCK_L, whatever their bags, summed into bags on the tensor cores; SLICES_TOGETHER:
# a block's column slices read by neighbouring programs. After the default (and without
# vectors), the twenty-ninth session's question: a row's column slices read by neighbouring
# programs (SLICES_TOGETHER), at the default tile and with wider slices; then the twenty-fifth
# session's: FLAT at several chunks and warps; then earlier sweeps' tiles.
F = (None, True, True)  # PROGRAMS None, VECTORS, FLAT
T = (None, True, None, True)  # PROGRAMS None, VECTORS, FLAT None, SLICES_TOGETHER
TILES = (
    (None, None, None, None, None),
    (None, None, None, None, None, *T),
    (None, None, 128, None, None, *T),
    (None, None, 128, None, 4, *T),
    (None, None, 128, None, 4),
    (None, None, 32, None, None, *T),
    (None, None, 256, None, 4, *T),
    (None, None, None, None, None, None, False),
    (None, None, None, None, None, *F),
    (None, None, None, None, 4, *F),
    (16, 2, 64, None, 2, *F),
    (16, 4, 64, None, 4, *F),
    (32, 2, 64, None, 4, *F),
    (64, 1, 64, None, 4, *F),
    (16, 8, 64, None, 4, *F),
    (32, 4, 64, None, 8, *F),
    (16, 4, 128, None, 4, *F),
    (32, 2, 128, None, 8, *F),
    (16, 4, 32, None, 2, *F),
    (32, 2, 32, None, 2),
    (32, 1, 64, None, 2),
    (64, 1, 64, None, 2),
    (64, 1, 64, None, 4),
    (16, 2, 64, None, 2),
    (32, 2, 64, None, 4),
    (32, 4, 64, None, 4),
    (32, 1, 128, None, 4),
    (16, 2, 128, None, 4),
    (64, 1, 32, None, 2),
    (16, 2, 32, None, 1),
    (None, None, None, None, None, 132 * 16),
    (16, 2, 32, True, 1),
    (16, 4, 64, None, 2),
    (32, 2, 64, None, 2, 132 * 16),
    (16, 1, 256, None, 4),
    (32, 2, 64, None, 2),
    (8, 2, 64, None, 1),
    (4, 8, 64, False, 2),
    (8, 4, 128, False, 4),
    # Pooled batches (bags of up to 120 ids, most short): more ids of fewer bags a step, so a
    # block's long bag takes fewer steps while its short ones wait.
    (8, 4, 64, None, 2),
    (8, 8, 64, None, 2),
    (4, 16, 64, None, 2),
    (16, 4, 64, None, 4),
)
NAMES = ("BLOCK_B", "BLOCK_L", "BLOCK_D", "ACC_3D", "num_warps", "PROGRAMS", "VECTORS", "FLAT")
NAMES += ("SLICES_TOGETHER",)


def main(pattern: str = "", first: str = "", earlier: str = "") -> None:
    device = torch.device("cuda")
    problem = get_problem("embedding_bags")
    copy_bw = measure_copy_bandwidth(device)
    base = dict(kernel.KNOBS)
    for shape in [s for s in problem.timing_shapes if pattern in s.name]:
        inputs = problem.make_inputs(shape, 1, device)
        call = (inputs.args, inputs.kwargs)
        want = problem.reference(*inputs.args, **inputs.kwargs)
        moved = problem.bytes(shape)
        print(f"\n{shape.name} {shape.dtype}: {moved / 1e6:.0f} MB", flush=True)
        torch_fn = problem.baselines["torch.embedding_bag_per_feature"]
        torch_us = benchmark(torch_fn, [call], device=device).median_us

        def show(label: str, us: float, moved=moved, torch_us=torch_us) -> None:
            # Each row as soon as it is measured: a run cut short keeps what it timed.
            gbs = moved / (us * 1e-6) / 1e9
            frac = f"{moved / (us * 1e-6) / copy_bw:5.0%}" if copy_bw else "  n/a"
            print(f"  {label:70} {us:9.1f} us {gbs:7.0f} GB/s {frac} {torch_us / us:5.2f}x", flush=True)

        show("torch.embedding_bag_per_feature", torch_us)
        if earlier:
            before = importlib.import_module(earlier)
            for label, module in [(f"{earlier} default", before), ("default", kernel)] * 2:
                got = module.embedding_bags_forward(*call[0], **call[1])
                ok, details = compare(got, want, problem.tolerance(shape.dtype))
                us = benchmark(module.embedding_bags_forward, [call], device=device).median_us
                show(label if ok else f"{label} WRONG: {details['message'][:40]}", us)
        for tile in TILES[: int(first)] if first else TILES:
            settings = dict(zip(NAMES, tile, strict=False))
            kernel.VECTORS = settings.pop("VECTORS", True)
            kernel.KNOBS.update(base, **settings)
            label = " ".join(f"{k}={v}" for k, v in zip(NAMES, tile, strict=False))
            try:  # a tile this device or Triton cannot launch is a row of the table, not the end
                got = kernel.embedding_bags_forward(*call[0], **call[1])
            except Exception as exc:  # noqa: BLE001 - reported, and the sweep goes on
                print(f"  {label} FAILED: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            ok, details = compare(got, want, problem.tolerance(shape.dtype))
            if not ok:
                print(f"  {label} WRONG: {details['message'][:80]}", flush=True)
                continue
            show(label, benchmark(kernel.embedding_bags_forward, [call], device=device).median_us)
        kernel.KNOBS.update(base)
        kernel.VECTORS = True


if __name__ == "__main__":
    main(*sys.argv[1:])
