"""The default kernel of dense_to_jagged (search_space/dense_to_jagged.py): one program per
(BLOCK_T rows of the jagged output, BLOCK_D columns) finds each row's sequence by a binary
search over the offsets (no host sync and no index tensor), then copies the row from the
padded form, or writes zeros for a row past its padded length. Self-contained, like any
candidate: it is also the op's knob template (its KNOBS dict; a knob that is None takes the
launch tile's value, _tile)."""

import torch
import triton
import triton.language as tl

KNOBS = {"BLOCK_T": None, "BLOCK_D": None, "num_warps": None}


@triton.jit
def _dense_to_jagged_kernel(
    dense_ptr, offsets_ptr, out_ptr, total, num_seqs, padded_len, dim, seq_stride, position_stride,
    search_steps, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    # The sequence of each row: the last b in [0, B) with offsets[b] <= row (empty sequences
    # before it share its start), kept as offsets[lo] <= row < offsets[hi].
    lo = tl.zeros([BLOCK_T], dtype=tl.int64)
    hi = tl.zeros([BLOCK_T], dtype=tl.int64) + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        go_right = tl.load(offsets_ptr + mid).to(tl.int64) <= rows
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    positions = rows - tl.load(offsets_ptr + lo).to(tl.int64)
    in_rows = rows < total
    in_cols = cols[None, :] < dim
    source = dense_ptr + lo[:, None] * seq_stride + positions[:, None] * position_stride + cols[None, :]
    tile = tl.load(source, mask=(in_rows & (positions < padded_len))[:, None] & in_cols, other=0.0)
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


def dense_to_jagged(dense, offsets, *, total):
    """dense [B, N, D], offsets [B + 1] (int32 or int64, from 0 to total) -> [total, D]: row p of
    sequence b is dense[b, p] for p < N, zeros past N."""
    if dense.stride(2) != 1:
        dense = dense.contiguous()
    num_seqs, padded_len, dim = dense.shape
    out = torch.empty((total, dim), dtype=dense.dtype, device=dense.device)
    if total == 0 or dim == 0:
        return out
    rows, block_d, num_warps = _tile(
        KNOBS["BLOCK_T"], dim, out.element_size(), total, out.device.type == "cpu"
    )
    grid = (triton.cdiv(total, rows), triton.cdiv(dim, block_d))
    _dense_to_jagged_kernel[grid](
        dense, offsets, out, total, num_seqs, padded_len, dim, dense.stride(0), dense.stride(1),
        max(1, (num_seqs - 1).bit_length()), BLOCK_T=rows, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    return out
