"""The default kernel of jagged_to_padded_dense (search_space/jagged_to_padded_dense.py): one
program per (sequence, BLOCK_L padded positions, BLOCK_D columns) copies the rows it covers and
writes the padding value over the rest, so every element of the output is written once and
nothing is read twice. Self-contained, like any candidate: it is also the op's knob template
(its KNOBS dict; a knob that is None takes the launch tile's value, _tile)."""

import math

import torch
import triton
import triton.language as tl

KNOBS = {"BLOCK_L": None, "BLOCK_D": None, "num_warps": None}


@triton.jit
def _jagged_to_padded_dense_kernel(
    values_ptr, offsets_ptr, out_ptr, padded_len, dim, position_blocks, row_stride, padding_value,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0) // position_blocks
    positions = (tl.program_id(0) % position_blocks) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(offsets_ptr + seq).to(tl.int64)
    length = tl.load(offsets_ptr + seq + 1).to(tl.int64) - start
    in_cols = cols[None, :] < dim
    rows = start + positions
    tile = tl.load(
        values_ptr + rows[:, None] * row_stride + cols[None, :],
        mask=(positions < length)[:, None] & in_cols,
        other=padding_value,
    )
    out_rows = seq.to(tl.int64) * padded_len + positions
    in_positions = (positions < padded_len)[:, None]
    tl.store(out_ptr + out_rows[:, None] * dim + cols[None, :], tile, mask=in_positions & in_cols)


# The launch tile, for each knob that is None. On a GPU, 32 rows x 128 columns on 4 warps: in an
# H100 sweep of 8 to 17 tiles at every timing shape (evals/studies/jagged_tiles.py; BENCHMARKS.md,
# 2026-12-06, twenty-ninth session) the best was within 0% to 7% of it, no one tile led across
# shapes, and one tile timed twice differed by up to 12%. Interpreted (on the CPU, each op of
# each program a NumPy call), fewer, wider programs: BLOCK_D covers the row (up to 8 KB), the
# rows fill a 256 KB tile up to the next power of two of `extent` (the rows the grid covers), a
# warp per 4 KB.
def _tile(rows, dim, itemsize, extent, interpreted):
    if not interpreted:
        return rows or 32, KNOBS["BLOCK_D"] or 128, KNOBS["num_warps"] or 4
    block_d = KNOBS["BLOCK_D"] or min(triton.next_power_of_2(dim), 8192 // itemsize)
    rows = rows or min(262144 // (block_d * itemsize), 256, triton.next_power_of_2(extent))
    return rows, block_d, KNOBS["num_warps"] or max(1, min(8, rows * block_d * itemsize // 4096))


def _rounded(value, dtype):
    """value rounded to nearest-even in a 16-bit dtype's significand, as torch.full rounds it,
    so that the kernel's own cast (which the interpreter truncates) has nothing left to round
    (the normal range; fp16's subnormals keep the kernel's cast)."""
    bits = {torch.bfloat16: 8, torch.float16: 11}.get(dtype)
    if bits is None or value == 0 or not math.isfinite(value):
        return value
    mantissa, exponent = math.frexp(value)
    return math.ldexp(round(mantissa * 2**bits), exponent - bits)


def jagged_to_padded_dense(values, offsets, *, max_len, padding_value=0.0):
    """values [T, D], offsets [B + 1] (int32 or int64, from 0 to T) -> [B, max_len, D]: row p of
    sequence b at [b, p] for p < max_len (rows past max_len are dropped), padding_value elsewhere."""
    if values.stride(1) != 1:
        values = values.contiguous()
    num_seqs, dim = offsets.numel() - 1, values.shape[1]
    out = torch.empty((num_seqs, max_len, dim), dtype=values.dtype, device=values.device)
    if num_seqs == 0 or max_len == 0 or dim == 0:
        return out
    padding = _rounded(float(padding_value), values.dtype)
    rows, block_d, num_warps = _tile(
        KNOBS["BLOCK_L"], dim, out.element_size(), max_len, out.device.type == "cpu"
    )
    position_blocks = triton.cdiv(max_len, rows)
    grid = (num_seqs * position_blocks, triton.cdiv(dim, block_d))
    _jagged_to_padded_dense_kernel[grid](
        values, offsets, out, max_len, dim, position_blocks, values.stride(0), padding,
        BLOCK_L=rows, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    return out
