"""The training update of table-batched embeddings, fused into their backward: the library's
default kernels (the math: search_space/embedding_bags_update.py; the layout:
search_space/packed_tables.py).

No dense gradient, and no atomics on weights: the ids are sorted once by their row's key (the
row's index in the row-wise state, unique across tables), so the ids of one row lie together
(a run of sorted positions). Then

1. each program takes BLOCK_P consecutive sorted positions. It resolves each position's
   gradient row (its bag, feature, place in grad_out, factor) and table row, gathers the
   gradient rows BLOCK_D columns at a time, and sums each run inside the tile by a segmented
   scan. A run wholly inside the tile (nearly every row: most are looked up once or twice, and
   sorting puts a table's rows together, so a tile's rows share one dim) is updated there and
   then, once; rows wider than BLOCK_D take a second pass under adagrad, whose step needs the
   row's norm. A run that crosses a tile's edge (a hot id, or a row cut by the edge) leaves its
   part of the tile's sum in a buffer: the tile's first run if it came from the tile before,
   its last if it goes on into the next;
2. one program per tile finishes the run that starts in it and goes on past it, if any: sums
   its tiles' parts and updates the row once.

Host code only makes the ids' row keys from the call's integer inputs and sorts them (torch ops
before any launch, on integers no kernel can have written); a kernel finds the ids' bags. Every
launch is sized from the number of ids, so nothing is read back: the call never syncs the host.

This module is also the problem's knob template: a search writes values into KNOBS; None keeps
the launch heuristic (_config) for that knob.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KNOBS = {
    "BLOCK_P": None,
    "BLOCK_D": None,
    "num_warps": None,
    "num_stages": None,
}
VECTORS = True  # False: rows move an element at a time, never in 16-byte vectors (for studies)


@triton.jit
def _bags_kernel(offsets_ptr, bag_ptr, nnz, num_bags, steps, BLOCK: tl.constexpr):
    """bag[p] = the bag of id p: how many bags end at or before p (an empty bag ends where it
    starts, so it is no id's), by a binary search of `steps` halvings over [0, num_bags]: the
    same work in every program whatever the bags' lengths, and neighbouring ids take mostly the
    same path (the same offsets loaded)."""
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = lo + num_bags
    for _ in range(steps):
        mid = (lo + hi) // 2
        past = (lo < hi) & (tl.load(offsets_ptr + mid + 1, mask=lo < hi, other=0) <= pos)
        lo, hi = tl.where(past, mid + 1, lo), tl.where(past, hi, mid)
    tl.store(bag_ptr + pos, lo, mask=pos < nnz)


@triton.jit
def _round(w, where, seed, STOCHASTIC: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """fp32 w in the weights' dtype: to nearest, or stochastically (unbiased): rounded toward zero,
    then one unit away from zero with probability the remainder's fraction of that unit."""
    if STOCHASTIC:
        low = w.to(OUT_DTYPE, fp_downcast_rounding="rtz")
        high = (low.to(tl.int16, bitcast=True) + 1).to(OUT_DTYPE, bitcast=True)
        low32, high32 = low.to(tl.float32), high.to(tl.float32)
        frac = tl.abs(w - low32) / tl.maximum(tl.abs(high32 - low32), 1e-38)
        up = tl.rand(seed, where) < frac
        return tl.where(up, high, low)
    return w.to(OUT_DTYPE)


@triton.jit
def _scale(state_ptr, grad_sq_I, key_I, dim_I, mask_I, lr, eps, ADAGRAD: tl.constexpr):
    """Each row's step size: SGD's lr, or adagrad's from its state, which this stores back with
    the row's mean squared gradient added (grad_sq: its sum over the row's columns)."""
    if ADAGRAD:
        total_I = tl.load(state_ptr + key_I, mask=mask_I, other=0.0)
        total_I += grad_sq_I / tl.maximum(dim_I, 1).to(tl.float32)
        tl.store(state_ptr + key_I, total_I, mask=mask_I)
        return lr / (tl.sqrt(total_I) + eps)
    return tl.zeros_like(grad_sq_I) + lr


@triton.jit
def _apply(weights_ptr, grad_ID, step_I, row_at_I, cols_D, mask_ID, seed, STOCHASTIC: tl.constexpr):
    """w -= step * grad on a block of columns of BLOCK_I rows (row_at: each row's first element
    in weights), rounded to the weights' dtype."""
    where_ID = row_at_I[:, None] + cols_D[None, :]
    w_ID = tl.load(weights_ptr + where_ID, mask=mask_ID, other=0.0).to(tl.float32)
    w_ID -= step_I[:, None] * grad_ID
    out = _round(w_ID, where_ID, seed, STOCHASTIC, weights_ptr.dtype.element_ty)
    tl.store(weights_ptr + where_ID, out, mask=mask_ID)


@triton.jit
def _same_run_sum(run_a, sum_a, run_b, sum_b):
    """The segmented scan's step: b's sum, plus a's where both lie in one run."""
    return run_b, tl.where(run_a == run_b, sum_a + sum_b, sum_b)


@triton.jit
def _run_sums(grad_out_ptr, grad_at_P, scale_P, run_PD, cols_D, mask_PD, SCALED: tl.constexpr):
    """Each position's gradient row on a block of columns, plus those of its run's earlier
    positions in the tile (an inclusive segmented scan): at a run's last position in the tile,
    the run's sum there. [BLOCK_P, BLOCK_D] fp32."""
    g_PD = tl.load(grad_out_ptr + grad_at_P[:, None] + cols_D[None, :], mask=mask_PD, other=0.0)
    g_PD = g_PD.to(tl.float32)
    if SCALED:
        g_PD *= scale_P[:, None]
    _, sums_PD = tl.associative_scan((run_PD, g_PD), 0, _same_run_sum)
    return sums_PD


@triton.jit
def _runs(
    weights_ptr, state_ptr, grad_out_ptr, partial_ptr, partial_stride, lr, eps, seed,
    key_P, run_P, grad_at_P, scale_P, row_at_P, dim_P, valid_P, whole_P, part_P, slot_P,
    ADAGRAD: tl.constexpr, SCALED: tl.constexpr, STOCHASTIC: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """The tile's runs summed and its whole ones updated, BLOCK_D columns at a time: when no row
    is wider than BLOCK_D, in one pass; otherwise in two under adagrad (the rows' norms first,
    then the step: the gradients are gathered twice, the second time mostly from L2) and one
    under SGD. The parts of the runs that cross the tile's edges go to their slots. ALIGN
    divides every row's start and dim (x // ALIGN * ALIGN tells the compiler)."""
    grad_at_P = grad_at_P // ALIGN * ALIGN
    row_at_P = row_at_P // ALIGN * ALIGN
    dim_P = dim_P // ALIGN * ALIGN
    run_PD = run_P[:, None] + tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.int32)
    widest = tl.minimum(tl.max(dim_P, axis=0), partial_stride)  # max_dim: the caller's bound on dims
    cols_D = tl.arange(0, BLOCK_D)
    if widest <= BLOCK_D:
        mask_PD = valid_P[:, None] & (cols_D[None, :] < dim_P[:, None])
        sums_PD = _run_sums(grad_out_ptr, grad_at_P, scale_P, run_PD, cols_D, mask_PD, SCALED)
        step_P = _scale(state_ptr, tl.sum(sums_PD * sums_PD, axis=1), key_P, dim_P, whole_P, lr, eps, ADAGRAD)
        _apply(weights_ptr, sums_PD, step_P, row_at_P, cols_D, whole_P[:, None] & mask_PD, seed, STOCHASTIC)
        where_PD = partial_ptr + slot_P[:, None] * partial_stride + cols_D[None, :]
        tl.store(where_PD, sums_PD, mask=part_P[:, None] & mask_PD)
    else:
        grad_sq_P = tl.zeros([BLOCK_P], dtype=tl.float32)
        if ADAGRAD:
            for c0 in range(0, widest, BLOCK_D):
                mask_PD = valid_P[:, None] & ((c0 + cols_D)[None, :] < dim_P[:, None])
                sums_PD = _run_sums(grad_out_ptr, grad_at_P, scale_P, run_PD, c0 + cols_D, mask_PD, SCALED)
                grad_sq_P += tl.sum(sums_PD * sums_PD, axis=1)
                where_PD = partial_ptr + slot_P[:, None] * partial_stride + (c0 + cols_D)[None, :]
                tl.store(where_PD, sums_PD, mask=part_P[:, None] & mask_PD)
        step_P = _scale(state_ptr, grad_sq_P, key_P, dim_P, whole_P, lr, eps, ADAGRAD)
        for c0 in range(0, widest, BLOCK_D):
            mask_PD = valid_P[:, None] & ((c0 + cols_D)[None, :] < dim_P[:, None])
            sums_PD = _run_sums(grad_out_ptr, grad_at_P, scale_P, run_PD, c0 + cols_D, mask_PD, SCALED)
            apply_PD = whole_P[:, None] & mask_PD
            _apply(weights_ptr, sums_PD, step_P, row_at_P, c0 + cols_D, apply_PD, seed, STOCHASTIC)
            if not ADAGRAD:
                where_PD = partial_ptr + slot_P[:, None] * partial_stride + (c0 + cols_D)[None, :]
                tl.store(where_PD, sums_PD, mask=part_P[:, None] & mask_PD)


@triton.jit
def _resolve(order_ptr, bag_ptr, offsets_ptr, psw_ptr, w_off_ptr, r_off_ptr, d_off_ptr, pos, key, valid,
             batch, stride_grad, POOL_MEAN: tl.constexpr, HAS_PSW: tl.constexpr):  # fmt: skip
    """What sorted positions need of their id: where its gradient row starts in grad_out, its
    factor (the per-sample weight, the mean's 1 / length; 1.0 when neither), where its table row
    starts in weights, and the row's dim. Any shape of positions."""
    i = tl.load(order_ptr + pos, mask=valid, other=0)
    b = tl.load(bag_ptr + i, mask=valid, other=0).to(tl.int64)
    f = b // batch
    col0 = tl.load(d_off_ptr + f, mask=valid, other=0)
    dim = tl.load(d_off_ptr + f + 1, mask=valid, other=0) - col0
    grad_at = (b - f * batch) * stride_grad + col0
    scale = tl.full(pos.shape, 1.0, dtype=tl.float32)
    if HAS_PSW:
        scale *= tl.load(psw_ptr + i, mask=valid, other=0.0).to(tl.float32)
    if POOL_MEAN:
        length = tl.load(offsets_ptr + b + 1, mask=valid, other=1) - tl.load(
            offsets_ptr + b, mask=valid, other=0
        )
        scale /= tl.maximum(length, 1).to(tl.float32)
    row = key - tl.load(r_off_ptr + f, mask=valid, other=0)
    row_at = tl.load(w_off_ptr + f, mask=valid, other=0) + row * dim
    return grad_at, scale, row_at, dim


@triton.jit
def _runs_kernel(
    weights_ptr, state_ptr, grad_out_ptr, keys_ptr, order_ptr, bag_ptr, offsets_ptr, psw_ptr,
    w_off_ptr, r_off_ptr, d_off_ptr, partial_ptr, partial_stride, nnz, batch, stride_grad, lr, eps, seed,
    ADAGRAD: tl.constexpr, POOL_MEAN: tl.constexpr, HAS_PSW: tl.constexpr, STOCHASTIC: tl.constexpr,
    VEC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Tile t: sorted positions [t * BLOCK_P, (t + 1) * BLOCK_P). Its whole runs are updated here
    (see _runs); the part of the run that came from the tile before goes to slot 2t, that of
    the run going on into the next tile to slot 2t + 1 (one run may be both: it fills slot 2t).
    Tiles where every row start and dim is a multiple of VEC elements (16 bytes) move rows in
    16-byte vectors; the compiler is told so by _runs' ALIGN, and untold moves an element at a
    time."""
    first = tl.program_id(0).to(tl.int64) * BLOCK_P
    last = tl.minimum(first + BLOCK_P, nnz) - 1
    pos_P = first + tl.arange(0, BLOCK_P)
    valid_P = pos_P < nnz
    key_P = tl.load(keys_ptr + pos_P, mask=valid_P, other=-1)  # keys are never negative
    prior_P = tl.load(keys_ptr + pos_P - 1, mask=valid_P & (pos_P > 0), other=-1)
    next_P = tl.load(keys_ptr + pos_P + 1, mask=pos_P + 1 < nnz, other=-1)
    run_P = tl.cumsum((valid_P & (key_P != prior_P)).to(tl.int32), axis=0)
    # The tile's edges, as [BLOCK_P] blocks of one value.
    first_P, last_P = first + 0 * pos_P, last + 0 * pos_P
    key_first, key_last = tl.load(keys_ptr + first_P), tl.load(keys_ptr + last_P)
    came_in = tl.load(keys_ptr + first_P - 1, mask=first_P > 0, other=-1) == key_first
    goes_on = tl.load(keys_ptr + last_P + 1, mask=last_P + 1 < nnz, other=-1) == key_last
    head_P = valid_P & (key_P == key_first) & came_in  # the run from the tile before
    whole_P = valid_P & (key_P != next_P) & ~head_P  # a run's last position, its first in the tile
    tail_P = (pos_P == last) & goes_on & ~head_P  # the run that starts here and goes on
    part_P = (head_P & ((key_P != next_P) | (pos_P == last))) | tail_P
    slot_P = 2 * tl.program_id(0).to(tl.int64) + tail_P.to(tl.int64)
    grad_at_P, scale_P, row_at_P, dim_P = _resolve(
        order_ptr, bag_ptr, offsets_ptr, psw_ptr, w_off_ptr, r_off_ptr, d_off_ptr, pos_P, key_P, valid_P,
        batch, stride_grad, POOL_MEAN, HAS_PSW,
    )  # fmt: skip
    odd_P = valid_P & ((grad_at_P % VEC != 0) | (row_at_P % VEC != 0) | (dim_P % VEC != 0))
    if tl.max(odd_P.to(tl.int32), axis=0) == 0:
        _runs(weights_ptr, state_ptr, grad_out_ptr, partial_ptr, partial_stride, lr, eps, seed,
              key_P, run_P, grad_at_P, scale_P, row_at_P, dim_P, valid_P, whole_P, part_P, slot_P,
              ADAGRAD, POOL_MEAN or HAS_PSW, STOCHASTIC, BLOCK_P, BLOCK_D, VEC)  # fmt: skip
    else:
        _runs(weights_ptr, state_ptr, grad_out_ptr, partial_ptr, partial_stride, lr, eps, seed,
              key_P, run_P, grad_at_P, scale_P, row_at_P, dim_P, valid_P, whole_P, part_P, slot_P,
              ADAGRAD, POOL_MEAN or HAS_PSW, STOCHASTIC, BLOCK_P, BLOCK_D, 1)  # fmt: skip


@triton.jit
def _crossing_runs_kernel(
    weights_ptr, state_ptr, keys_ptr, order_ptr, bag_ptr, w_off_ptr, r_off_ptr, d_off_ptr, partial_ptr,
    partial_stride, nnz, batch, lr, eps, seed,
    ADAGRAD: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program t finishes the run that starts in tile t and goes on into the next, if any: its
    part there (slot 2t + 1) and in each later tile it reaches (slot 2u of tile u), summed and
    stepped once. Its tile holds a whole row."""
    t = tl.program_id(0).to(tl.int64)
    first = t * BLOCK_P
    last = tl.minimum(first + BLOCK_P, nnz) - 1
    key = tl.load(keys_ptr + last)
    goes_on = tl.load(keys_ptr + last + 1, mask=last + 1 < nnz, other=-1) == key
    came_in = tl.load(keys_ptr + first - 1, mask=first > 0, other=-1) == key
    if goes_on & ~(came_in & (tl.load(keys_ptr + first) == key)):
        at = last + tl.zeros([1], dtype=tl.int64)
        keys = key + tl.zeros([1], dtype=key.dtype)
        _, _, row_at, dim = _resolve(
            order_ptr, bag_ptr, order_ptr, order_ptr, w_off_ptr, r_off_ptr, d_off_ptr, at, keys, at >= 0,
            batch, 0, False, False,
        )  # fmt: skip
        cols = tl.arange(0, BLOCK_D)
        mask = cols[None, :] < dim[:, None]
        grad = tl.load(partial_ptr + (2 * t + 1) * partial_stride + cols[None, :], mask=mask, other=0.0)
        q = last + 1
        while tl.load(keys_ptr + q, mask=q < nnz, other=-1) == key:
            grad += tl.load(
                partial_ptr + 2 * (q // BLOCK_P) * partial_stride + cols[None, :], mask=mask, other=0.0
            )
            q += BLOCK_P
        step = _scale(state_ptr, tl.sum(grad * grad, axis=1), keys, dim, at >= 0, lr, eps, ADAGRAD)
        _apply(weights_ptr, grad, step, row_at, cols, mask, seed, STOCHASTIC)


def _config(max_dim: int, interpreted: bool) -> dict:
    """Launch parameters of the runs kernel. On a GPU: tiles of 64 positions x 32 columns on four
    warps (a guess until evals/studies/update_phases.py sweeps them). Interpreted, where each op
    of each program is a NumPy call, few wide programs: 64 positions of whole rows."""
    if interpreted:
        return {"BLOCK_P": 64, "BLOCK_D": triton.next_power_of_2(max_dim), "num_warps": 1, "num_stages": 1}
    return {"BLOCK_P": 64, "BLOCK_D": 32, "num_warps": 4, "num_stages": 1}


# Sort keys (each row's index in the state) are int32 when the rows are fewer than this: a radix
# sort of half the passes. Rows number at most the weights' elements (a row holds at least one)
# or the state's entries, whichever is more.
INT32_KEYS_BELOW = 2**31


def sort_ids(
    row_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    batch: int,
    *,
    int32_keys: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """nnz > 0 ids sorted by row (on the device, no sync): every id's bag (int32 below 2^31
    bags); its row's key (its index in the state; int32 where the rows allow, for a sort of half
    the passes), the keys sorted and their order.

    Torch ops make the keys from the call's integer inputs and sort them before any launch: the
    sandbox's host-compute watch refuses host ops on integers a kernel may have written. A kernel
    finds the bags."""
    nnz, device = indices.numel(), indices.device
    positions = torch.arange(nnz, dtype=offsets.dtype, device=device)
    # Each id's feature: how many features end at or before it (a search over F offsets).
    feature = torch.searchsorted(offsets[batch::batch].contiguous(), positions, right=True, out_int32=True)
    dtype = torch.int32 if int32_keys else torch.int64
    sorted_keys, order = torch.sort(row_offsets.to(dtype)[feature] + indices.to(dtype), stable=True)
    bags = offsets.numel() - 1
    bag = torch.empty(nnz, dtype=torch.int32 if bags < 2**31 else torch.int64, device=device)
    _bags_kernel[(triton.cdiv(nnz, 1024),)](offsets, bag, nnz, bags, bags.bit_length(), BLOCK=1024)
    return bag, sorted_keys, order


def embedding_bags_update(
    weights: torch.Tensor,
    state: torch.Tensor,
    grad_out: torch.Tensor,
    weight_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    dim_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    *,
    max_dim: int,
    optimizer: str = "adagrad",
    lr: float = 0.01,
    eps: float = 1e-8,
    pooling: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> None:
    """Updates weights (and adagrad's state) in place; see the module's docstring."""
    nnz = indices.numel()
    if nnz == 0:
        return
    num_features = weight_offsets.numel()
    batch = (offsets.numel() - 1) // num_features
    grad_out = grad_out.contiguous()
    cfg = _config(max_dim, interpreted=weights.device.type == "cpu")
    cfg = {name: value if KNOBS[name] is None else KNOBS[name] for name, value in cfg.items()}
    block_p, block_d = cfg["BLOCK_P"], min(cfg["BLOCK_D"], triton.next_power_of_2(max_dim))
    int32_keys = max(weights.numel(), state.numel()) < INT32_KEYS_BELOW
    bag, sorted_keys, order = sort_ids(row_offsets, indices, offsets, batch, int32_keys=int32_keys)
    tiles = triton.cdiv(nnz, block_p)
    partial = torch.empty((2 * tiles, max_dim), dtype=torch.float32, device=weights.device)
    has_psw = per_sample_weights is not None
    adagrad = optimizer == "adagrad"
    stochastic = bool(stochastic_rounding)
    _runs_kernel[(tiles,)](
        weights, state, grad_out, sorted_keys, order, bag, offsets,
        per_sample_weights if has_psw else grad_out, weight_offsets, row_offsets, dim_offsets, partial,
        max_dim, nnz, batch, grad_out.stride(0), lr, eps, seed,
        ADAGRAD=adagrad, POOL_MEAN=pooling == "mean", HAS_PSW=has_psw, STOCHASTIC=stochastic,
        VEC=16 // weights.element_size() if VECTORS else 1,  # grad_out's dtype is the weights'
        BLOCK_P=block_p, BLOCK_D=block_d, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    _crossing_runs_kernel[(tiles,)](
        weights, state, sorted_keys, order, bag, weight_offsets, row_offsets, dim_offsets, partial,
        max_dim, nnz, batch, lr, eps, seed,
        ADAGRAD=adagrad, STOCHASTIC=stochastic, BLOCK_P=block_p, BLOCK_D=triton.next_power_of_2(max_dim),
        num_warps=4,
    )  # fmt: skip
