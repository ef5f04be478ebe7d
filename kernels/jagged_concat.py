"""The default kernel of jagged_concat (search_space/jagged_concat.py): one program per
(BLOCK_T output rows, BLOCK_D columns) finds each row's sequence by a binary search over the
output's offsets (first_offsets + second_offsets, added as they are read), then copies the row
from the first part or the second. Self-contained, like any candidate: it is also the op's
knob template (its KNOBS dict; a knob that is None takes the launch tile's value, _tile)."""

import torch
import triton
import triton.language as tl

KNOBS = {"BLOCK_T": None, "BLOCK_D": None, "num_warps": None}


@triton.jit
def _jagged_concat_kernel(
    first_ptr, first_offsets_ptr, second_ptr, second_offsets_ptr, out_ptr, total, num_seqs, dim,
    first_stride, second_stride, search_steps, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    # The sequence of each output row: the last b with first_offsets[b] + second_offsets[b] <= row.
    lo = tl.zeros([BLOCK_T], dtype=tl.int64)
    hi = tl.zeros([BLOCK_T], dtype=tl.int64) + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        start = tl.load(first_offsets_ptr + mid).to(tl.int64) + tl.load(second_offsets_ptr + mid).to(tl.int64)
        go_right = start <= rows
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    first_start = tl.load(first_offsets_ptr + lo).to(tl.int64)
    first_len = tl.load(first_offsets_ptr + lo + 1).to(tl.int64) - first_start
    second_start = tl.load(second_offsets_ptr + lo).to(tl.int64)
    position = rows - first_start - second_start
    in_rows = rows < total
    in_cols = cols[None, :] < dim
    from_first = (in_rows & (position < first_len))[:, None] & in_cols
    from_second = (in_rows & (position >= first_len))[:, None] & in_cols
    a = tl.load(first_ptr + (first_start + position)[:, None] * first_stride + cols[None, :], mask=from_first)
    second_rows = second_start + position - first_len
    b = tl.load(second_ptr + second_rows[:, None] * second_stride + cols[None, :], mask=from_second)
    tile = tl.where(from_first, a, b)
    tl.store(out_ptr + rows[:, None] * dim + cols[None, :], tile, mask=in_rows[:, None] & in_cols)


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


def jagged_concat(first, first_offsets, second, second_offsets):
    """first [T1, D] with first_offsets [B + 1], second [T2, D] with second_offsets [B + 1] ->
    [T1 + T2, D]: sequence b's rows of first, then its rows of second (the result's offsets are
    first_offsets + second_offsets)."""
    if first.stride(1) != 1:
        first = first.contiguous()
    if second.stride(1) != 1:
        second = second.contiguous()
    num_seqs, dim = first_offsets.numel() - 1, first.shape[1]
    total = first.shape[0] + second.shape[0]
    out = torch.empty((total, dim), dtype=first.dtype, device=first.device)
    if total == 0 or dim == 0:
        return out
    rows, block_d, num_warps = _tile(
        KNOBS["BLOCK_T"], dim, out.element_size(), total, out.device.type == "cpu"
    )
    grid = (triton.cdiv(total, rows), triton.cdiv(dim, block_d))
    _jagged_concat_kernel[grid](
        first, first_offsets, second, second_offsets, out, total, num_seqs, dim,
        first.stride(0), second.stride(0), max(1, (num_seqs - 1).bit_length()),
        BLOCK_T=rows, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    return out
