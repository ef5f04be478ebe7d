"""The default kernel of jagged_split (search_space/jagged_split.py): one program per
(BLOCK_T input rows, BLOCK_D columns) finds each row's sequence by a binary search over the
offsets, then writes the row to the first part (a sequence's first rows) or to the second.
Self-contained, like any candidate: it is also the op's knob template (its KNOBS dict; a knob
that is None takes the launch tile's value, _tile)."""

import torch
import triton
import triton.language as tl

KNOBS = {"BLOCK_T": None, "BLOCK_D": None, "num_warps": None}


@triton.jit
def _jagged_split_kernel(
    values_ptr, offsets_ptr, first_offsets_ptr, first_ptr, second_ptr, total, num_seqs, dim,
    row_stride, search_steps, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    lo = tl.zeros([BLOCK_T], dtype=tl.int64)
    hi = tl.zeros([BLOCK_T], dtype=tl.int64) + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        go_right = tl.load(offsets_ptr + mid).to(tl.int64) <= rows
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    start = tl.load(offsets_ptr + lo).to(tl.int64)
    first_start = tl.load(first_offsets_ptr + lo).to(tl.int64)
    first_len = tl.load(first_offsets_ptr + lo + 1).to(tl.int64) - first_start
    position = rows - start
    in_rows = rows < total
    in_cols = cols[None, :] < dim
    tile = tl.load(values_ptr + rows[:, None] * row_stride + cols[None, :], mask=in_rows[:, None] & in_cols)
    to_first = (in_rows & (position < first_len))[:, None] & in_cols
    to_second = (in_rows & (position >= first_len))[:, None] & in_cols
    tl.store(first_ptr + (first_start + position)[:, None] * dim + cols[None, :], tile, mask=to_first)
    # The second part's sequence b starts at offsets[b] - first_offsets[b].
    second_rows = start - first_start + position - first_len
    tl.store(second_ptr + second_rows[:, None] * dim + cols[None, :], tile, mask=to_second)


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


def jagged_split(values, offsets, first_offsets, *, first_total):
    """values [T, D] with offsets [B + 1], first_offsets [B + 1] (each sequence's first part,
    first_offsets[-1] = first_total) -> (first [first_total, D], second [T - first_total, D]):
    sequence b's first rows, and the rest (offsets - first_offsets)."""
    if values.stride(1) != 1:
        values = values.contiguous()
    num_seqs, (total, dim) = offsets.numel() - 1, values.shape
    first = torch.empty((first_total, dim), dtype=values.dtype, device=values.device)
    second = torch.empty((total - first_total, dim), dtype=values.dtype, device=values.device)
    if total == 0 or dim == 0:
        return first, second
    rows, block_d, num_warps = _tile(
        KNOBS["BLOCK_T"], dim, values.element_size(), total, values.device.type == "cpu"
    )
    grid = (triton.cdiv(total, rows), triton.cdiv(dim, block_d))
    _jagged_split_kernel[grid](
        values, offsets, first_offsets, first, second, total, num_seqs, dim, values.stride(0),
        max(1, (num_seqs - 1).bit_length()), BLOCK_T=rows, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    return first, second
