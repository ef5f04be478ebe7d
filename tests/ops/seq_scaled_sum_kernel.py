"""The default kernel of the test suite's own op, seq_scaled_sum (tests/ops/seq_scaled_sum.py
declares it): one program per (sequence, column block) adds the sequence's rows in fp32, a tile
of BLOCK_L rows per step, and writes the scaled sum. Self-contained, like any candidate: it is
also the op's knob template (its KNOBS dict)."""

import torch
import triton
import triton.language as tl

KNOBS = {"BLOCK_L": 16, "BLOCK_D": 64, "num_warps": 4}


@triton.jit
def _seq_sum_kernel(x_ptr, offsets_ptr, out_ptr, dim, scale, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(offsets_ptr + seq).to(tl.int64)
    end = tl.load(offsets_ptr + seq + 1).to(tl.int64)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first in range(start, end, BLOCK_L):
        rows = first + tl.arange(0, BLOCK_L)
        mask = (rows[:, None] < end) & (cols[None, :] < dim)
        tile = tl.load(x_ptr + rows[:, None] * dim + cols[None, :], mask=mask, other=0.0)
        acc += tl.sum(tile.to(tl.float32), axis=0)
    tl.store(out_ptr + seq * dim + cols, (acc * scale).to(out_ptr.dtype.element_ty), mask=cols < dim)


def seq_scaled_sum(x, offsets, *, scale=1.0):
    """x [total, D] (contiguous), offsets [B + 1] -> out [B, D]: scale times each sequence's sum."""
    num_seqs, dim = offsets.numel() - 1, x.shape[1]
    out = torch.empty((num_seqs, dim), dtype=x.dtype, device=x.device)
    if num_seqs == 0 or dim == 0:
        return out
    grid = (num_seqs, triton.cdiv(dim, KNOBS["BLOCK_D"]))
    _seq_sum_kernel[grid](
        x, offsets, out, dim, scale,
        BLOCK_L=KNOBS["BLOCK_L"], BLOCK_D=KNOBS["BLOCK_D"], num_warps=KNOBS["num_warps"],
    )  # fmt: skip
    return out
