"""Whether the L2 flush before each timed call costs the call its own time: each op's default
kernel at each timing shape timed after the flush that reads a 128 MB buffer and after the one
that writes it (sandbox.flush.L2Flush, either way; the write is the default), alternately,
twice each. A written flush leaves the L2 full of dirty lines, which the timed call may write
back to HBM in its own window. Prints medians and p20-p80 per flush.

    python3 -m evals.studies.flush [OP ...]
"""

from __future__ import annotations

import torch

from evals.studies import default_at_each_shape, each_op
from sandbox.flush import L2Flush
from sandbox.timing import benchmark

OPS = ("dense_to_jagged", "jagged_split", "jagged_concat", "jagged_to_padded_dense")


def study(name: str) -> None:
    device = torch.device("cuda")
    flushes = {"read": L2Flush(device, reads=True), "written": L2Flush(device, reads=False)}
    print(f"\n{name}")
    for shape, fn, sets in default_at_each_shape(name):
        cells = []
        for label in ("read", "written") * 2:
            stats = benchmark(fn, sets, device=device, joined_streams=True, flush=flushes[label])
            cells.append(f"{label} {stats.median_us:7.1f} ({stats.p20_us:.1f}-{stats.p80_us:.1f})")
        print(f"  {shape.name:18} {shape.dtype:5} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    each_op(study, OPS)
