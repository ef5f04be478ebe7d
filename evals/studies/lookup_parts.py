"""embedding_bags' forward at each timing shape with parts of its work taken out, to see what the
lookup spends beside its random row gathers: the default kernel, then copies of its module
edited so that

- "one row": every id reads its table's first row. The ids are still loaded, into an offset
  the compiler cannot fold away, so only the random rows' traffic goes.
- "no output": the bags' sums are made and never stored. The store's mask holds a test that no
  sum meets.
- "one row, no output": the ids, the offsets and the loop alone.

Each row prints its time, its share of the default's, and the default's fraction of the copy
bandwidth measured in the same run. The default's output is checked against the reference; the
edited copies' are wrong by design. One CUDA device.

    python3 -m evals.studies.lookup_parts [SHAPE NAME SUBSTRING]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

import kernels.embedding_bags as kernel
from evals.bench_ops import measure_copy_bandwidth
from evals.studies import edited_module
from sandbox.protocol import compare
from sandbox.timing import benchmark
from search_space import get_problem

ROWS = (
    "            table_ptr + rows_BL[:, :, None] * dim + cols_D[None, None, :],\n",
    "            table_ptr + (rows_BL < 0).to(tl.int64)[:, :, None] * dim + cols_D[None, None, :],\n",
)
OUTPUT = (
    "        mask=(bags_B < limit)[:, None] & col_mask_D[None, :],\n",
    "        mask=(bags_B < limit)[:, None] & col_mask_D[None, :] & (acc_BD == -1.25e30),\n",
)
VARIANTS = {"one row": (ROWS,), "no output": (OUTPUT,), "one row, no output": (ROWS, OUTPUT)}


def _edited(name: str, edits: tuple[tuple[str, str], ...], where: Path):
    """A copy of kernels/embedding_bags.py with `edits` made, imported from a file of its own
    (Triton reads a kernel's source from its file)."""
    return edited_module(kernel, edits, f"_lookup_{name.replace(' ', '_').replace(',', '')}", where)


def main(pattern: str = "") -> None:
    device = torch.device("cuda")
    problem = get_problem("embedding_bags")
    copy_bw = measure_copy_bandwidth(device)
    with tempfile.TemporaryDirectory() as where:
        variants = {name: _edited(name, edits, Path(where)) for name, edits in VARIANTS.items()}
        for shape in [s for s in problem.timing_shapes if pattern in s.name]:
            inputs = problem.make_inputs(shape, 1, device)
            call = (inputs.args, inputs.kwargs)
            moved = problem.bytes(shape)
            ok, details = compare(
                kernel.embedding_bags_forward(*call[0], **call[1]),
                problem.reference(*inputs.args, **inputs.kwargs),
                problem.tolerance(shape.dtype),
            )
            default_us = benchmark(kernel.embedding_bags_forward, [call], device=device).median_us
            frac = f"{moved / (default_us * 1e-6) / copy_bw:.0%} of copy" if copy_bw else ""
            check = "ok" if ok else f"WRONG: {details['message'][:60]}"
            print(f"\n{shape.name} {shape.dtype}: {moved / 1e6:.0f} MB", flush=True)
            print(f"  {'default':20} {default_us:9.1f} us  {frac}  {check}", flush=True)
            for name, module in variants.items():
                us = benchmark(module.embedding_bags_forward, [call], device=device).median_us
                print(f"  {name:20} {us:9.1f} us  {us / default_us:5.2f} of the default", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
