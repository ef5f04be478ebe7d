"""The fused update's rows kernel at launch tiles that give each program more rows at once than
the sweeps of earlier sessions did (evals/studies/update_phases.py swept 256 to 512 elements a
program): a program's gathers are random rows, so the bytes it has in flight between dependent
loads set how much of the memory's latency is hidden. Each tile is BLOCK_I chunks x BLOCK_L ids
x BLOCK_D columns on num_warps warps, its loops in num_stages stages. The whole op is timed
(numbering included), its result checked against the default tile's (weights and state, from
the same copies), and the rows kernel's registers and spills printed after each shape.
One CUDA device; rows print as they are measured.

    python3 -m evals.studies.update_tiles [SHAPE NAME SUBSTRING] [DTYPE]
"""

from __future__ import annotations

import sys

import torch

import kernels.embedding_bags_update as kernel
from evals.studies.update_phases import _compiled
from sandbox.timing import benchmark
from search_space import get_problem

TILES = (
    (8, 1, 32, 2, 1),  # the default on a GPU
    (16, 1, 32, 2, 1),
    (32, 1, 32, 2, 1),
    (32, 1, 32, 4, 1),
    (64, 1, 32, 4, 1),
    (16, 1, 64, 2, 1),
    (32, 1, 64, 4, 1),
    (16, 2, 32, 2, 1),
    # Software-pipelined loops: a column block's (or a step's) gathers issued while the last's
    # are summed.
    (8, 1, 32, 2, 2),
    (8, 1, 32, 2, 3),
)
NAMES = ("BLOCK_I", "BLOCK_L", "BLOCK_D", "num_warps", "num_stages")


def _updated(inputs, weights, state, tile) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights and state after one call with `tile`, from copies of the pristine ones."""
    w, s = weights.clone(), state.clone()
    kernel.KNOBS.update(dict(zip(NAMES, tile, strict=True)))
    kernel.embedding_bags_update(w, s, *inputs.args[2:], **inputs.kwargs)
    return w, s


def main(pattern: str = "", dtype: str = "") -> None:
    device = torch.device("cuda")
    problem = get_problem("embedding_bags_update")
    base = dict(kernel.KNOBS)
    for shape in problem.timing_shapes:
        if pattern not in shape.name or (dtype and shape.dtype != dtype):
            continue
        inputs = problem.make_inputs(shape, 1, device)
        # Pristine copies: the timed calls update the inputs' own weights and state.
        weights, state = inputs.args[0].clone(), inputs.args[1].clone()
        print(f"\n{shape.describe()}: {inputs.args[6].numel():,} ids", flush=True)
        expected = _updated(inputs, weights, state, TILES[0])
        first = None
        for tile in TILES:
            got = _updated(inputs, weights, state, tile)
            same = all(
                torch.allclose(g.float(), e.float(), rtol=1e-5, atol=1e-7)
                for g, e in zip(got, expected, strict=True)
            )
            del got
            call = [(inputs.args, inputs.kwargs)]
            us = benchmark(kernel.embedding_bags_update, call, device=device, max_reps=10).median_us
            first = first or us
            label = " x ".join(map(str, tile[:3])) + f" w{tile[3]} s{tile[4]}"
            check = "ok" if same else "DIFFERS from the default tile"
            print(f"  {label:16} {us:9.1f} us  {first / us:5.2f}x the default  {check}", flush=True)
        kernel.KNOBS.update(base)
        for line in _compiled(kernel._rows_kernel):
            print(line)
        del inputs, expected
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
