"""The default kernels of history_gather (search_space/history_gather.py) and of its gradient.

Forward:  out[t, :] = table[ids[t], :]  (+ bucket_table[bucket(t), :], added in fp32)
Backward: grad_table[r, :]        = sum_{t : ids[t] = r} grad_out[t, :]
          grad_bucket_table[k, :] = sum_{t : bucket(t) = k} grad_out[t, :]
where bucket(t) is bucket_ids[t], or (positional) t's distance from the last event of its
sequence, clamped to num_buckets - 1.

The forward gives each program BLOCK_T slots, every slot one independent row load (many row
loads in flight hide HBM latency on random rows). The slots are the positions themselves or,
given `order` (the positions with equal ids listed together), the positions in that order: the
repeats of an id then fall in one tile, whose loads of that row after the first hit the caches,
and each output row is still written once.

The table's gradient walks the positions in `order`: each program sums the runs of equal ids
in its tile (prefix sums, in fp64) and writes the rows of the ids that begin and end there; the
ids whose run crosses tiles leave per-tile partial sums that a second pass adds up, from the
tile where the run ends back to where it began. Each row of the gradient is written once, with
no atomics, the same way every run. The bucket gradient walks the positions in sequence order,
where a bucket comes in runs (a sequence's oldest events share the last positional bucket;
chronological events share age buckets): one fp32 atomic add per run and tile.

This module is also the knob template of both problems (history_gather and
history_gather_backward, the GRAD_ knobs): a search writes values into KNOBS; None keeps the
launch heuristic (_forward_config, _backward_config), which is what the default kernels run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KNOBS = {
    "BLOCK_T": None,
    "BLOCK_D": None,
    "EVICT_ROWS": "",
    "num_warps": None,
    "GRAD_BLOCK_J": None,
    "GRAD_BLOCK_D": None,
    "GRAD_num_warps": None,
}


@triton.jit
def _sequence_bounds(positions, offsets_ptr, mask, num_seqs, search_steps):
    """(start, end) of each position's sequence: a binary search for the last b with
    offsets[b] <= t (an empty sequence starts where the next one does, so that b is t's own)."""
    lo = tl.zeros_like(positions)
    hi = lo + num_seqs - 1
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        below = tl.load(offsets_ptr + mid, mask=mask, other=0) <= positions
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    start = tl.load(offsets_ptr + lo, mask=mask, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + lo + 1, mask=mask, other=0).to(tl.int64)
    return start, end


@triton.jit
def _run_sums(vals_JD, begins_J, BLOCK_J: tl.constexpr):
    """Each slot's sum over the slots of its run in the tile up to itself, where runs begin at
    the slots begins_J flags (and at slot 0): the prefix sum less the prefix before the run's
    first slot. The prefixes are fp64, so their difference keeps what a run's own fp32 sum
    would, however large the tile's other rows. (A segmented scan would say it directly, but
    the interpreter runs a scan with a custom combine one element at a time.)"""
    local_J = tl.arange(0, BLOCK_J)
    # The run's first slot: the last beginning at or before the slot.
    starts_JJ = begins_J[None, :] & (local_J[None, :] <= local_J[:, None])
    first_J = tl.max(tl.where(starts_JJ, local_J[None, :], 0), axis=1)
    prefix_JD = tl.cumsum(vals_JD.to(tl.float64), 0)
    before_JD = tl.gather(prefix_JD - vals_JD, tl.broadcast_to(first_J[:, None], vals_JD.shape), 0)
    return (prefix_JD - before_JD).to(tl.float32)


@triton.jit
def _history_gather_fwd_kernel(
    table_ptr,
    ids_ptr,
    order_ptr,
    offsets_ptr,
    bucket_ids_ptr,
    bucket_table_ptr,
    out_ptr,
    stride_table_row,
    stride_bucket_table_row,
    stride_out_row,
    total,
    dim,
    num_seqs,
    num_buckets,
    search_steps,
    HAS_ORDER: tl.constexpr,
    HAS_BUCKETS: tl.constexpr,
    POSITIONAL: tl.constexpr,
    EVICT_ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    slots_T = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_T = slots_T < total
    cols_D = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_TD = mask_T[:, None] & (cols_D < dim)[None, :]
    pos_T = tl.load(order_ptr + slots_T, mask=mask_T, other=0).to(tl.int64) if HAS_ORDER else slots_T
    rows_T = tl.load(ids_ptr + pos_T, mask=mask_T, other=0).to(tl.int64)
    vals_TD = tl.load(
        table_ptr + rows_T[:, None] * stride_table_row + cols_D[None, :],
        mask=mask_TD,
        other=0.0,
        eviction_policy=EVICT_ROWS,
    )
    if HAS_BUCKETS:
        if POSITIONAL:
            _, end_T = _sequence_bounds(pos_T, offsets_ptr, mask_T, num_seqs, search_steps)
            buckets_T = tl.minimum(end_T - 1 - pos_T, num_buckets - 1)
        else:
            buckets_T = tl.load(bucket_ids_ptr + pos_T, mask=mask_T, other=0).to(tl.int64)
        extra_TD = tl.load(
            bucket_table_ptr + buckets_T[:, None] * stride_bucket_table_row + cols_D[None, :],
            mask=mask_TD,
            other=0.0,
        )
        # Added in fp32 (two 16-bit rows add exactly there) and rounded once, to the output's dtype.
        vals_TD = vals_TD.to(tl.float32) + extra_TD.to(tl.float32)
    tl.store(
        out_ptr + pos_T[:, None] * stride_out_row + cols_D[None, :],
        vals_TD.to(out_ptr.dtype.element_ty),
        mask=mask_TD,
    )


@triton.jit
def _grad_table_kernel(
    grad_out_ptr,
    ids_ptr,
    order_ptr,
    grad_table_ptr,
    head_sum_ptr,
    tail_sum_ptr,
    tail_id_ptr,
    stride_grad_out_row,
    stride_grad_out_col,
    stride_grad_table_row,
    total,
    dim,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    local_J = tl.arange(0, BLOCK_J)
    slots_J = tile * BLOCK_J + local_J
    mask_J = slots_J < total
    cols_D = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_D = cols_D < dim
    pos_J = tl.load(order_ptr + slots_J, mask=mask_J, other=0).to(tl.int64)
    id_J = tl.load(ids_ptr + pos_J, mask=mask_J, other=-1).to(tl.int64)
    # An id's run begins where the previous slot holds another id and ends where the next does.
    has_prev_J = mask_J & (slots_J > 0)
    prev_pos_J = tl.load(order_ptr + slots_J - 1, mask=has_prev_J, other=0)
    prev_id_J = tl.load(ids_ptr + prev_pos_J, mask=has_prev_J, other=-1).to(tl.int64)
    has_next_J = slots_J + 1 < total
    next_pos_J = tl.load(order_ptr + slots_J + 1, mask=has_next_J, other=0)
    next_id_J = tl.load(ids_ptr + next_pos_J, mask=has_next_J, other=-1).to(tl.int64)
    begins_J = mask_J & (id_J != prev_id_J)
    ends_J = mask_J & (id_J != next_id_J)

    vals_JD = tl.load(
        grad_out_ptr + pos_J[:, None] * stride_grad_out_row + cols_D[None, :] * stride_grad_out_col,
        mask=mask_J[:, None] & mask_D[None, :],
        other=0.0,
    ).to(tl.float32)
    sums_JD = _run_sums(vals_JD, begins_J, BLOCK_J)
    # Whether the slot's run began in this tile (else in an earlier one).
    began_here_J = tl.cumsum(begins_J.to(tl.int32), 0) > 0
    tl.store(
        grad_table_ptr + id_J[:, None] * stride_grad_table_row + cols_D[None, :],
        sums_JD.to(grad_table_ptr.dtype.element_ty),
        mask=(ends_J & began_here_J)[:, None] & mask_D[None, :],
    )
    # What the second pass needs: the partial sum of the run that ends here but began in an
    # earlier tile (head), and of the run that goes on past this tile (tail) with its id.
    head_D = tl.sum(tl.where((ends_J & ~began_here_J)[:, None], sums_JD, 0.0), axis=0)
    goes_on_J = (local_J == tl.minimum(total - tile * BLOCK_J, BLOCK_J) - 1) & ~ends_J
    tail_D = tl.sum(tl.where(goes_on_J[:, None], sums_JD, 0.0), axis=0)
    tl.store(head_sum_ptr + tile * dim + cols_D, head_D, mask=mask_D)
    tl.store(tail_sum_ptr + tile * dim + cols_D, tail_D, mask=mask_D)
    tl.store(tail_id_ptr + tile, tl.max(tl.where(goes_on_J, id_J, -1), axis=0))


@triton.jit
def _grad_table_runs_kernel(
    grad_table_ptr,
    head_sum_ptr,
    tail_sum_ptr,
    tail_id_ptr,
    stride_grad_table_row,
    dim,
    BLOCK_D: tl.constexpr,
):
    """The rows of the ids whose run crosses tiles: tile q finishes the run that came into it
    (the previous tile's tail) if the run ends in q, adding the tails of the tiles before it
    back to the tile where the run began (an id's tiles are consecutive)."""
    tile = tl.program_id(0).to(tl.int64)
    run_id = tl.load(tail_id_ptr + tile - 1, mask=tile > 0, other=-1)
    finishes = (run_id >= 0) & (tl.load(tail_id_ptr + tile) != run_id)
    # No columns where no run finishes (a column bound, not `mask & finishes`: the interpreter
    # turns a scalar and a block of booleans into integers).
    cols_D = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_D = cols_D < tl.where(finishes, dim, 0)
    acc_D = tl.load(head_sum_ptr + tile * dim + cols_D, mask=mask_D, other=0.0)
    before = tile - 1
    walking = finishes
    while walking:
        acc_D += tl.load(tail_sum_ptr + before * dim + cols_D, mask=mask_D, other=0.0)
        before -= 1
        walking = tl.load(tail_id_ptr + before, mask=before >= 0, other=-1) == run_id
    tl.store(
        grad_table_ptr + run_id * stride_grad_table_row + cols_D,
        acc_D.to(grad_table_ptr.dtype.element_ty),
        mask=mask_D,
    )


@triton.jit
def _grad_buckets_kernel(
    grad_out_ptr,
    offsets_ptr,
    bucket_ids_ptr,
    grad_buckets_ptr,
    stride_grad_out_row,
    stride_grad_out_col,
    total,
    dim,
    num_seqs,
    num_buckets,
    search_steps,
    POSITIONAL: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    local_J = tl.arange(0, BLOCK_J)
    pos_J = tl.program_id(0).to(tl.int64) * BLOCK_J + local_J
    mask_J = pos_J < total
    cols_D = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_D = cols_D < dim
    if POSITIONAL:
        # The previous event of a sequence is one bucket further back, unless both are clamped
        # into the last bucket: the run boundaries follow from the sequence bounds alone.
        start_J, end_J = _sequence_bounds(pos_J, offsets_ptr, mask_J, num_seqs, search_steps)
        back_J = end_J - 1 - pos_J
        bucket_J = tl.minimum(back_J, num_buckets - 1)
        begins_J = (pos_J == start_J) | (back_J < num_buckets - 1)
        ends_J = (pos_J + 1 == end_J) | (back_J < num_buckets)
    else:
        # Equal buckets add up whatever the sequence: a run may cross sequences.
        bucket_J = tl.load(bucket_ids_ptr + pos_J, mask=mask_J, other=0).to(tl.int64)
        prev_J = tl.load(bucket_ids_ptr + pos_J - 1, mask=mask_J & (pos_J > 0), other=-1).to(tl.int64)
        next_J = tl.load(bucket_ids_ptr + pos_J + 1, mask=pos_J + 1 < total, other=-1).to(tl.int64)
        begins_J = bucket_J != prev_J
        ends_J = bucket_J != next_J
    vals_JD = tl.load(
        grad_out_ptr + pos_J[:, None] * stride_grad_out_row + cols_D[None, :] * stride_grad_out_col,
        mask=mask_J[:, None] & mask_D[None, :],
        other=0.0,
    ).to(tl.float32)
    sums_JD = _run_sums(vals_JD, begins_J, BLOCK_J)
    flush_J = mask_J & (ends_J | (local_J == BLOCK_J - 1))
    tl.atomic_add(
        grad_buckets_ptr + bucket_J[:, None] * dim + cols_D[None, :],
        sums_JD,
        mask=flush_J[:, None] & mask_D[None, :],
        sem="relaxed",
    )


def _search_steps(num_seqs: int) -> int:
    """Halvings that take a binary search over num_seqs sequences down to one."""
    return max(num_seqs - 1, 0).bit_length()


def _forward_config(dim: int, element_size: int, interpreted: bool = False) -> dict:
    """Launch parameters of the forward. On a GPU (untuned until measured on the H200): whole
    rows up to 256 columns, so that one id load serves a row, and about 16 KB of rows per tile,
    which with a few programs resident per SM keeps enough bytes in flight to cover HBM latency
    on random rows. Interpreted (CPU tensors), every op of a program is one NumPy call whatever
    its tile: few wide programs, whole rows up to 1024 columns."""
    if interpreted:
        return {"BLOCK_T": 128, "BLOCK_D": min(triton.next_power_of_2(max(dim, 16)), 1024), "num_warps": 4}
    block_d = min(triton.next_power_of_2(max(dim, 16)), 256)
    block_t = min(max(16384 // (block_d * element_size), 16), 128)
    return {"BLOCK_T": block_t, "BLOCK_D": block_d, "num_warps": 4}


def _backward_config(dim: int, interpreted: bool = False) -> dict:
    """Launch parameters of the gradients' kernels. On a GPU (untuned until measured on the
    H200): tiles of 32 events by up to 64 columns, whose fp64 prefix sums take 32 registers a
    thread in 4 warps. Interpreted: whole rows up to 1024 columns, the same 32 events (so that
    runs cross tiles on the check shapes too)."""
    if interpreted:
        return {"BLOCK_J": 32, "BLOCK_D": min(triton.next_power_of_2(max(dim, 16)), 1024), "num_warps": 4}
    return {"BLOCK_J": 32, "BLOCK_D": min(triton.next_power_of_2(max(dim, 16)), 64), "num_warps": 4}


def history_gather(
    table: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    *,
    order: torch.Tensor | None = None,
    bucket_ids: torch.Tensor | None = None,
    bucket_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """table [num_rows, D], ids [T], offsets [B + 1], order [T] or None, bucket_ids [T] or None,
    bucket_table [num_buckets, D] or None -> out [T, D] in table's dtype."""
    total, dim = ids.shape[0], table.shape[1]
    out = torch.empty((total, dim), dtype=table.dtype, device=table.device)
    if total == 0 or dim == 0:
        return out
    cfg = _forward_config(dim, table.element_size(), interpreted=table.device.type == "cpu")
    cfg = {name: value if KNOBS[name] is None else KNOBS[name] for name, value in cfg.items()}
    has_buckets = bucket_table is not None
    num_seqs = offsets.shape[0] - 1
    grid = (triton.cdiv(total, cfg["BLOCK_T"]), triton.cdiv(dim, cfg["BLOCK_D"]))
    _history_gather_fwd_kernel[grid](
        table,
        ids,
        order if order is not None else ids,
        offsets,
        bucket_ids if bucket_ids is not None else ids,
        bucket_table if has_buckets else table,
        out,
        table.stride(0),
        bucket_table.stride(0) if has_buckets else 0,
        out.stride(0),
        total,
        dim,
        num_seqs,
        bucket_table.shape[0] if has_buckets else 0,
        _search_steps(num_seqs),
        HAS_ORDER=order is not None,
        HAS_BUCKETS=has_buckets,
        POSITIONAL=has_buckets and bucket_ids is None,
        EVICT_ROWS=KNOBS["EVICT_ROWS"],
        **cfg,
    )
    return out


def history_gather_backward(
    grad_out: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor,
    num_rows: int,
    *,
    bucket_ids: torch.Tensor | None = None,
    num_buckets: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_out [T, D], ids [T], offsets [B + 1], order [T] (equal ids listed together) ->
    (dense grad_table [num_rows, D], grad_bucket_table [num_buckets, D]), in grad_out's dtype."""
    total, dim = grad_out.shape
    grad_table = torch.zeros((num_rows, dim), dtype=grad_out.dtype, device=grad_out.device)
    grad_buckets = torch.zeros((num_buckets, dim), dtype=torch.float32, device=grad_out.device)
    if total > 0 and dim > 0:
        cfg = _backward_config(dim, interpreted=grad_out.device.type == "cpu")
        cfg = {
            name: value if KNOBS["GRAD_" + name] is None else KNOBS["GRAD_" + name]
            for name, value in cfg.items()
        }
        num_tiles = triton.cdiv(total, cfg["BLOCK_J"])
        grid = (num_tiles, triton.cdiv(dim, cfg["BLOCK_D"]))
        head_sum = torch.empty((num_tiles, dim), dtype=torch.float32, device=grad_out.device)
        tail_sum = torch.empty((num_tiles, dim), dtype=torch.float32, device=grad_out.device)
        tail_id = torch.empty((num_tiles,), dtype=torch.int64, device=grad_out.device)
        _grad_table_kernel[grid](
            grad_out,
            ids,
            order,
            grad_table,
            head_sum,
            tail_sum,
            tail_id,
            grad_out.stride(0),
            grad_out.stride(1),
            grad_table.stride(0),
            total,
            dim,
            **cfg,
        )
        _grad_table_runs_kernel[grid](
            grad_table,
            head_sum,
            tail_sum,
            tail_id,
            grad_table.stride(0),
            dim,
            BLOCK_D=cfg["BLOCK_D"],
            num_warps=cfg["num_warps"],
        )
        if num_buckets > 0:
            num_seqs = offsets.shape[0] - 1
            _grad_buckets_kernel[grid](
                grad_out,
                offsets,
                bucket_ids if bucket_ids is not None else ids,
                grad_buckets,
                grad_out.stride(0),
                grad_out.stride(1),
                total,
                dim,
                num_seqs,
                num_buckets,
                _search_steps(num_seqs),
                POSITIONAL=bucket_ids is None,
                **cfg,
            )
    return grad_table, grad_buckets.to(grad_out.dtype)
