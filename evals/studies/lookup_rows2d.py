"""embedding_bags' forward with a 2D step loop where a step takes one id of each bag (BLOCK_L = 1,
the short tile): the bags' ids, masks and rows as [BLOCK_B] and [BLOCK_B, BLOCK_D] tiles instead
of the general loop's [BLOCK_B, 1] and [BLOCK_B, 1, BLOCK_D]. Compiled for sm_90 by Triton 3.6
(the GPU hosts'), the short bf16 tile (64 x 1 x 64 on two warps) takes 128 registers a thread
this way against the general loop's 166 (8 programs an SM against 6; ncu counted the 166 on an
H100, BENCHMARKS.md 2026-12-07), where the lookup is latency-bound by the rows in flight.

Prints both modules' registers at the default tiles (this Triton's compiler), then each timing
shape's default beside the edited copy (evals/studies/beside.py: both checked against the
reference, timed alternately). The edit is made on the current kernel's source, so the study
stays valid as the kernel changes, or stops with the line it no longer finds. One CUDA device.

    python3 -m evals.studies.lookup_rows2d [SHAPE NAME SUBSTRING]
"""

from __future__ import annotations

import sys
from pathlib import Path

import kernels.embedding_bags as kernel
from evals.studies import beside, module_from_source
from evals.studies.registers import LOOKUP_TYPES, compile_report, lookup_launch

GENERAL = """    acc_BD = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    acc_BLD = tl.zeros([BLOCK_B, BLOCK_L, BLOCK_D], dtype=tl.float32)
"""
ROWS_2D = """    acc_BD = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    if BLOCK_L == 1:
        for step in tl.range(0, tl.max(len_B, axis=0), num_stages=NUM_STAGES):
            live_B = step < len_B
            rows_B = tl.load(indices_ptr + start_B + step, mask=live_B, other=0).to(tl.int64)
            vals_BD = tl.load(
                table_ptr + rows_B[:, None] * dim + cols_D[None, :],
                mask=live_B[:, None] & col_mask_D[None, :], other=0.0, eviction_policy=EVICT_ROWS,
            ).to(tl.float32)
            if HAS_PSW:
                vals_BD *= tl.load(psw_ptr + start_B + step, mask=live_B, other=0.0).to(tl.float32)[:, None]
            acc_BD += vals_BD
        return acc_BD
    acc_BLD = tl.zeros([BLOCK_B, BLOCK_L, BLOCK_D], dtype=tl.float32)
"""
NAME = "_lookup_rows2d"


def edited():
    """A copy of kernels/embedding_bags.py with the 2D step loop, imported as NAME."""
    source = Path(kernel.__file__).read_text()
    if source.count(GENERAL) != 1:
        raise SystemExit("the step loop's start is not once in kernels/embedding_bags.py")
    return module_from_source(source.replace(GENERAL, ROWS_2D), NAME)


def registers(module) -> list[tuple[str, int, int]]:
    """(tile, registers, spilled bytes) of `module`'s forward at the short and pooled bf16 tiles."""
    rows = []
    for mean_ids in (1.5, 20.0):
        constexprs, warps = lookup_launch(2, mean_ids)
        regs, spill, _ = compile_report(module._embedding_bags_fwd_kernel, LOOKUP_TYPES, constexprs, warps)
        tile = "x".join(str(constexprs[k]) for k in ("BLOCK_B", "BLOCK_L", "BLOCK_D"))
        rows.append((tile, regs, spill))
    return rows


def main(pattern: str = "") -> None:
    module = edited()
    for label, m in (("default", kernel), (NAME, module)):
        for tile, regs, spill in registers(m):
            print(f"{label:16} bf16 {tile:10} {regs:4} registers, {spill} bytes spilled", flush=True)
    beside.main("embedding_bags", NAME, pattern)


if __name__ == "__main__":
    main(*sys.argv[1:])
