"""What the lookup's empty programs cost. The forward's grid holds the host's bound on each bag
block's column blocks, (total_dim + F * (BLOCK_D - 1)) / BLOCK_D, since the features' dims are
on the device: at every timing shape about 30% of that bound holds no columns (b64k-f26-short:
45 of 65), so where a program takes one block, 30% of the programs load the dims, find no
block and end; in a persistent grid, 30% of the loops' turns do.

Two versions beside the default, by the profiler (device time of the forward kernel, as
lookup_profile.py), alternately, three times, at each timing shape; outputs compared with the
default's, bit for bit:
- "exact grid": the host reads the dims (a sync, outside the timed kernel) and launches only
  the blocks that hold columns: what removing the empty programs is worth at most;
- "early end": the default's grid, each program's loop bounded on the device by the blocks that
  hold columns (one reduction over the features before the loop): what is left of it without
  the host knowing the dims.

    python3 -m evals.studies.empty_blocks [SHAPE NAME SUBSTRING]

One CUDA device; rows print as they are measured.
"""

from __future__ import annotations

import sys

import kernels.embedding_bags as kernel
from evals.studies import edited_module
from evals.studies.lookup_profile import beside
from search_space import get_problem

EXACT_GRID = [
    (
        '    column_blocks = (total_dim + num_features * (cfg["BLOCK_D"] - 1)) // cfg["BLOCK_D"]\n',
        "    dims = (dim_offsets[1:] - dim_offsets[:-1]).cpu()\n"
        '    column_blocks = int(((dims + cfg["BLOCK_D"] - 1) // cfg["BLOCK_D"]).sum())\n',
    )
]
EARLY_END = [
    (
        "    for p in tl.range(tl.program_id(0), num_blocks, tl.num_programs(0)):\n",
        "    real = tl.minimum(num_blocks, tl.max(ends_F, axis=0) * num_bag_blocks)\n"
        "    for p in tl.range(tl.program_id(0), real, tl.num_programs(0)):\n",
    )
]


def main(pattern: str = "") -> None:
    versions = [
        ("default", kernel),
        ("exact grid", edited_module(kernel, EXACT_GRID, "_bags_exact_grid")),
        ("early end", edited_module(kernel, EARLY_END, "_bags_early_end")),
    ]
    shapes = get_problem("embedding_bags").timing_shapes
    beside(versions, [s for s in shapes if pattern in s.name], check=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
