"""The training update of table-batched embeddings, fused into their backward: the library's
default kernels (the math: search_space/embedding_bags_update.py; the layout:
search_space/packed_tables.py).

No dense gradient, and no atomics on weights: the ids are sorted once by their row's key (the
row's index in the row-wise state, unique across tables), so the ids of one row lie together.
The sorted ids are cut into chunks, a new one at every row's first id and at every multiple of
CHUNK positions, so a chunk holds at most CHUNK ids of one row. Then

0. one wide launch resolves each sorted position once and numbers the chunks: a chunk's record
   (its row's key, table row and dim; its first id's gradient row and factor) lets a program
   load all it needs of its chunks in one trip, with no chain of dependent loads from an id
   to its bag, feature, table and gradient row;
1. each program sums the gradients of BLOCK_I chunks, BLOCK_D columns at a time (a
   [BLOCK_I, BLOCK_L, BLOCK_D] tile of gathered gradient rows per step; rows wider than
   BLOCK_D take a second pass under adagrad, whose step needs the row's norm). A row whose
   ids all lie in its chunk (most rows) is updated at once; a longer row (a hot id, held by
   many bags) leaves its chunks' sums in a buffer;
2. one program per CHUNK positions finishes the long row that crosses its position, if any:
   sums its chunks' sums and updates it once.

The ids' bags, their row keys sorted and the chunks' count come from the kit
(kernels/kit/embeddings.py: torch makes the keys from the call's integer inputs and sorts them
before any launch; kernels find the bags and count the chunks). Every launch is sized from the
number of ids, so nothing is read back: the call never syncs the host.

This module is also the problem's knob template: a search writes values into KNOBS; None keeps
the launch heuristic (_config) for that knob.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kit.embeddings import CHUNK_BLOCK, chunk_numbers, count_chunks, register_cap, sort_by_row

KNOBS = {
    "BLOCK_I": None,
    "BLOCK_L": None,
    "BLOCK_D": None,
    "CHUNK": 64,
    "num_warps": None,
    "num_stages": None,
    "maxnreg": None,
}
VECTORS = True  # False: rows move an element at a time, never in 16-byte vectors (for studies)


@triton.jit
def _sorted_kernel(
    order_ptr, bag_ptr, keys_ptr, before_ptr, offsets_ptr, psw_ptr, w_off_ptr, r_off_ptr, d_off_ptr,
    starts_ptr, grad_at_ptr, scale_ptr, c_key_ptr, c_row_at_ptr, c_dim_ptr, c_grad_at_ptr,
    c_scale_ptr, long_row_at_ptr, long_dim_ptr, misaligned_ptr, nnz, batch, stride_grad,
    POOL_MEAN: tl.constexpr, HAS_PSW: tl.constexpr, CHUNK: tl.constexpr, VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Each sorted position p resolved once, where the loads of a thousand positions overlap, and
    the chunks numbered (the kit's chunk_numbers; starts[c]: chunk c's first position). Chunk
    c's record at c: its row's key (-1 for a long row's chunk), where its table row starts in
    weights, its dim, where its first id's gradient row starts in grad_out and that id's factor
    (per-sample weight, the mean's 1 / length); a chunk's later ids keep theirs at p, and a long
    row's table row and dim are kept at p // CHUNK. *misaligned: 1 where a start or dim is not a
    multiple of VEC but all are of VEC / 2, 2 where not even that (see _rows_kernel)."""
    pos, valid, key, row_start, new, chunk = chunk_numbers(keys_ptr, before_ptr, tl.program_id(0), nnz, CHUNK,
                                                           BLOCK)  # fmt: skip
    tl.store(starts_ptr + chunk, pos, mask=new)
    later = valid & ~new
    i = tl.load(order_ptr + pos, mask=valid, other=0)
    b = tl.load(bag_ptr + i, mask=valid, other=0)
    f = b // batch
    col0 = tl.load(d_off_ptr + f, mask=valid, other=0)
    dim = tl.load(d_off_ptr + f + 1, mask=valid, other=0) - col0
    place = grad_at_ptr.dtype.element_ty
    grad_at = (b - f * batch).to(place) * stride_grad + col0.to(place)
    tl.store(grad_at_ptr + pos, grad_at, mask=later)
    tl.store(c_grad_at_ptr + chunk, grad_at, mask=new)
    if HAS_PSW or POOL_MEAN:
        scale = tl.full([BLOCK], 1.0, dtype=tl.float32)
        if HAS_PSW:
            scale *= tl.load(psw_ptr + i, mask=valid, other=0.0).to(tl.float32)
        if POOL_MEAN:
            length = tl.load(offsets_ptr + b + 1, mask=valid, other=1)
            length -= tl.load(offsets_ptr + b, mask=valid, other=0)
            scale /= tl.maximum(length, 1).to(tl.float32)
        tl.store(scale_ptr + pos, scale, mask=later)
        tl.store(c_scale_ptr + chunk, scale, mask=new)
    row = key - tl.load(r_off_ptr + f, mask=valid, other=0)
    row_at = (tl.load(w_off_ptr + f, mask=valid, other=0) + row * dim).to(c_row_at_ptr.dtype.element_ty)
    # A row's chunk is its whole row unless the row runs on to the next multiple of CHUNK.
    past = (pos // CHUNK + 1) * CHUNK
    on = tl.load(keys_ptr + past, mask=new & row_start & (past < nnz), other=-1) == key
    whole = row_start & ((past >= nnz) | ~on)
    tl.store(c_key_ptr + chunk, tl.where(whole, key, -1), mask=new)
    tl.store(c_row_at_ptr + chunk, row_at, mask=new)
    tl.store(c_dim_ptr + chunk, dim.to(tl.int32), mask=new)
    tl.store(long_row_at_ptr + pos // CHUNK, row_at, mask=valid & (pos % CHUNK == 0))
    tl.store(long_dim_ptr + pos // CHUNK, dim.to(tl.int32), mask=valid & (pos % CHUNK == 0))
    starts = grad_at | row_at | dim
    odd = (valid & (starts % VEC != 0)).to(tl.int32)
    if VEC >= 4:  # 1 where only VEC / 2 (8 bytes) divides them, 2 where not even that
        odd += (valid & (starts % (VEC // 2) != 0)).to(tl.int32)
    else:
        odd *= 2
    level = tl.max(odd, axis=0)
    if level > 0:
        tl.atomic_max(misaligned_ptr, level)


@triton.jit
def _bits(seed, where):
    """32 random bits for each weight (where: its place in weights) and step (seed's low 32 bits),
    by an integer hash (Philox's ten rounds made the update 1.12x slower: update_rounding.py in
    evals/studies). Places past 2^32 fold their upper half into one word: in weights of more
    elements, some pairs of places draw the same bits (each still rounds without bias)."""
    where = where.to(tl.int64)
    x = (where & 0xFFFFFFFF).to(tl.uint32) ^ (where >> 32).to(tl.uint32) * tl.full([], 0x9E3779B9, tl.uint32)
    x ^= tl.cast(seed, tl.uint32) * tl.full([], 0x85EBCA6B, tl.uint32)
    x = (x ^ (x >> 16)) * tl.full([], 0x7FEB352D, tl.uint32)
    x = (x ^ (x >> 15)) * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _round(w, where, seed, STOCHASTIC: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """fp32 w in the weights' dtype: to nearest, or stochastically (unbiased): one unit away from
    zero with probability the remainder's fraction of that unit. bf16 is fp32's upper half: 16
    random bits added to the lower half carry into the upper with exactly that probability."""
    if STOCHASTIC:
        if OUT_DTYPE.is_bf16():
            up = w.to(tl.uint32, bitcast=True) + (_bits(seed, where) & 0xFFFF)
            rounded = (up & 0xFFFF0000).to(tl.float32, bitcast=True)
            return tl.where(w == w, rounded, w).to(OUT_DTYPE)  # NaN stays NaN
        low = w.to(OUT_DTYPE, fp_downcast_rounding="rtz")
        high = (low.to(tl.int16, bitcast=True) + 1).to(OUT_DTYPE, bitcast=True)
        low32, high32 = low.to(tl.float32), high.to(tl.float32)
        frac = tl.abs(w - low32) / tl.maximum(tl.abs(high32 - low32), 1e-38)
        u = (_bits(seed, where) >> 8).to(tl.float32) * (1.0 / 16777216.0)  # 24 bits: [0, 1)
        return tl.where(u < frac, high, low)
    return w.to(OUT_DTYPE)


@triton.jit
def _state(state_ptr, key_I, mask_I, ADAGRAD: tl.constexpr):
    """Each row's adagrad state, loaded before its gradients are gathered (so that the two loads'
    latencies overlap); rows out of mask_I take 1, not 0: lr / eps can overflow fp16 in their
    unstored lanes. SGD keeps no state."""
    if ADAGRAD:
        return tl.load(state_ptr + key_I, mask=mask_I, other=1.0)
    return tl.zeros(key_I.shape, dtype=tl.float32)


@triton.jit
def _scale(state_ptr, total_I, grad_sq_I, key_I, dim_I, mask_I, lr, eps, ADAGRAD: tl.constexpr):
    """Each row's step size: SGD's lr, or adagrad's from its state total_I, which this stores back
    with the row's mean squared gradient added (grad_sq: its sum over the row's columns)."""
    if ADAGRAD:
        total_I += grad_sq_I / tl.maximum(dim_I, 1).to(tl.float32)
        tl.store(state_ptr + key_I, total_I, mask=mask_I)
        return lr / (tl.sqrt(total_I) + eps)
    return tl.zeros_like(grad_sq_I) + lr


@triton.jit
def _apply(weights_ptr, w_ID, grad_ID, step_I, where_ID, mask_ID, seed, STOCHASTIC: tl.constexpr):
    """w -= step * grad on a block of columns of BLOCK_I rows (w_ID: their weights, loaded from
    where_ID before the gradients were gathered), rounded to the weights' dtype."""
    w_ID = w_ID.to(tl.float32) - step_I[:, None] * grad_ID
    out = _round(w_ID, where_ID, seed, STOCHASTIC, weights_ptr.dtype.element_ty)
    tl.store(weights_ptr + where_ID, out, mask=mask_ID)


@triton.jit
def _gather_sum(
    grad_out_ptr,
    grad_at_ptr,
    scale_ptr,
    begin_I,
    end_I,
    valid_I,
    first_I,
    first_s_I,
    longest,
    cols_D,
    col_mask_ID,
    SCALED: tl.constexpr,
    BLOCK_L: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """The summed gradient of each chunk's ids on a block of columns: [BLOCK_I, BLOCK_D] fp32,
    BLOCK_L ids of every chunk gathered per step; the first id's gradient row starts at first_I
    (its factor first_s_I: the chunk's record), the others' are loaded. ALIGN divides every
    gradient row's start (see _rows)."""
    grad_ID = tl.zeros([begin_I.shape[0], cols_D.shape[0]], dtype=tl.float32)
    for step in tl.range(0, longest, BLOCK_L):
        at_IL = begin_I[:, None] + step + tl.arange(0, BLOCK_L)[None, :]
        mask_IL = valid_I[:, None] & (at_IL < end_I[:, None])
        first_IL = at_IL == begin_I[:, None]
        g_at_IL = tl.load(grad_at_ptr + at_IL, mask=mask_IL & ~first_IL, other=0)
        g_at_IL = tl.where(first_IL, first_I[:, None], g_at_IL) // ALIGN * ALIGN
        g_ILD = tl.load(
            grad_out_ptr + g_at_IL[:, :, None] + cols_D[None, None, :],
            mask=mask_IL[:, :, None] & col_mask_ID[:, None, :],
            other=0.0,
        ).to(tl.float32)
        if SCALED:
            s_IL = tl.load(scale_ptr + at_IL, mask=mask_IL & ~first_IL, other=0.0)
            g_ILD *= tl.where(first_IL, first_s_I[:, None], s_IL)[:, :, None]
        grad_ID += tl.sum(g_ILD, axis=1)
    return grad_ID


@triton.jit
def _rows_kernel(
    weights_ptr, state_ptr, grad_out_ptr, grad_at_ptr, scale_ptr, starts_ptr, c_key_ptr, c_row_at_ptr,
    c_dim_ptr, c_grad_at_ptr, c_scale_ptr, partial_ptr, partial_stride, nnz, lr, eps, seed, misaligned_ptr,
    ADAGRAD: tl.constexpr, SCALED: tl.constexpr, STOCHASTIC: tl.constexpr, CHUNK: tl.constexpr,
    VEC: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    SLICE_D: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """_rows, told where every row start and dim is a multiple of VEC elements (16 bytes): the
    starts are loaded from memory, and untold the compiler moves rows an element at a time.
    Misaligned, it takes SLICE_D columns at a time (a quarter of BLOCK_D): a kernel holds its
    costlier path's registers (evals/studies/registers.py).
    Where HALF = VEC / 2 elements (8 bytes: a bf16 row of 4) divides every start and dim, the
    same tile in vectors of up to 8 bytes (a thread holds 4 columns): a dim-4 feature sends a
    batch there (odd_dims.py). In 2-byte dtypes only (HALF 1: compiled out)."""
    misaligned = tl.load(misaligned_ptr)
    if misaligned == 0:
        _rows(weights_ptr, state_ptr, grad_out_ptr, grad_at_ptr, scale_ptr, starts_ptr, c_key_ptr,
              c_row_at_ptr, c_dim_ptr, c_grad_at_ptr, c_scale_ptr, partial_ptr, partial_stride, nnz, lr, eps,
              seed, ADAGRAD, SCALED, STOCHASTIC, CHUNK, BLOCK_I, BLOCK_L, BLOCK_D, VEC)  # fmt: skip
    elif (HALF > 1) & (misaligned == 1):
        _rows(weights_ptr, state_ptr, grad_out_ptr, grad_at_ptr, scale_ptr, starts_ptr, c_key_ptr,
              c_row_at_ptr, c_dim_ptr, c_grad_at_ptr, c_scale_ptr, partial_ptr, partial_stride, nnz, lr, eps,
              seed, ADAGRAD, SCALED, STOCHASTIC, CHUNK, BLOCK_I, BLOCK_L, BLOCK_D, HALF)  # fmt: skip
    else:
        _rows(weights_ptr, state_ptr, grad_out_ptr, grad_at_ptr, scale_ptr, starts_ptr, c_key_ptr,
              c_row_at_ptr, c_dim_ptr, c_grad_at_ptr, c_scale_ptr, partial_ptr, partial_stride, nnz, lr, eps,
              seed, ADAGRAD, SCALED, STOCHASTIC, CHUNK, BLOCK_I, BLOCK_L, SLICE_D, 1)  # fmt: skip


@triton.jit
def _rows(
    weights_ptr, state_ptr, grad_out_ptr, grad_at_ptr, scale_ptr, starts_ptr, c_key_ptr, c_row_at_ptr,
    c_dim_ptr, c_grad_at_ptr, c_scale_ptr, partial_ptr, partial_stride, nnz, lr, eps, seed,
    ADAGRAD: tl.constexpr, SCALED: tl.constexpr, STOCHASTIC: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """BLOCK_I chunks, BLOCK_D columns at a time: when no row of the program is wider than
    BLOCK_D, in one pass; otherwise in two under adagrad (the rows' norms first, then the step:
    the gradients are gathered twice, the second time mostly from L2) and one under SGD. ALIGN
    divides every row's start and dim (x // ALIGN * ALIGN tells the compiler)."""
    # Chunks number at most nnz, and starts holds nnz past the last: one trip loads the starts
    # and records of the program's chunks (none waits for their count), and the records of
    # chunks past the last (never written) are masked where they are used.
    chunks_I = tl.program_id(0).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)
    in_I = chunks_I < nnz
    begin_I = tl.load(starts_ptr + chunks_I, mask=in_I, other=nnz)
    end_I = tl.load(starts_ptr + chunks_I + 1, mask=in_I, other=nnz)
    key_I = tl.load(c_key_ptr + chunks_I, mask=in_I, other=-1)
    row_at_I = tl.load(c_row_at_ptr + chunks_I, mask=in_I, other=0) // ALIGN * ALIGN
    dim_I = tl.load(c_dim_ptr + chunks_I, mask=in_I, other=0)
    first_I = tl.load(c_grad_at_ptr + chunks_I, mask=in_I, other=0)
    valid_I = begin_I < nnz
    first_s_I = tl.load(c_scale_ptr + chunks_I, mask=valid_I, other=0.0) if SCALED else first_I
    dim_I = tl.where(valid_I, dim_I, 0) // ALIGN * ALIGN
    whole_I = valid_I & (key_I >= 0)  # the record's key is -1 for a long row's chunk
    # A long row's chunks leave their sums: slot 2c for the chunk at position c * CHUNK, 2c + 1 for
    # one that starts its row inside [c * CHUNK, (c + 1) * CHUNK) (only a row's first chunk does).
    slot_I = 2 * (begin_I // CHUNK) + (begin_I % CHUNK != 0).to(tl.int64)
    part_I = valid_I & ~whole_I
    longest = tl.max(end_I - begin_I, axis=0)
    widest = tl.minimum(tl.max(dim_I, axis=0), partial_stride)  # max_dim: the caller's bound on dims
    cols_D = tl.arange(0, BLOCK_D)
    total_I = _state(state_ptr, key_I, whole_I, ADAGRAD)
    if widest <= BLOCK_D:
        col_mask_ID = cols_D[None, :] < dim_I[:, None]
        mask_ID = whole_I[:, None] & col_mask_ID
        where_ID = row_at_I[:, None] + cols_D[None, :]
        w_ID = tl.load(weights_ptr + where_ID, mask=mask_ID, other=0.0)
        grad_ID = _gather_sum(
            grad_out_ptr, grad_at_ptr, scale_ptr, begin_I, end_I, valid_I, first_I, first_s_I, longest,
            cols_D, col_mask_ID, SCALED, BLOCK_L, ALIGN,
        )  # fmt: skip
        grad_sq_I = tl.sum(grad_ID * grad_ID, axis=1)
        step_I = _scale(state_ptr, total_I, grad_sq_I, key_I, dim_I, whole_I, lr, eps, ADAGRAD)
        _apply(weights_ptr, w_ID, grad_ID, step_I, where_ID, mask_ID, seed, STOCHASTIC)
        where_ID = partial_ptr + slot_I[:, None] * partial_stride + cols_D[None, :]
        tl.store(where_ID, grad_ID, mask=part_I[:, None] & col_mask_ID)
    else:
        grad_sq_I = tl.zeros([BLOCK_I], dtype=tl.float32)
        if ADAGRAD:
            for c0 in range(0, widest, BLOCK_D):
                col_mask_ID = (c0 + cols_D)[None, :] < dim_I[:, None]
                grad_ID = _gather_sum(  # only rows updated here need their norm
                    grad_out_ptr, grad_at_ptr, scale_ptr, begin_I, end_I, whole_I, first_I, first_s_I,
                    longest, c0 + cols_D, col_mask_ID, SCALED, BLOCK_L, ALIGN,
                )  # fmt: skip
                grad_sq_I += tl.sum(grad_ID * grad_ID, axis=1)
        step_I = _scale(state_ptr, total_I, grad_sq_I, key_I, dim_I, whole_I, lr, eps, ADAGRAD)
        for c0 in range(0, widest, BLOCK_D):
            col_mask_ID = (c0 + cols_D)[None, :] < dim_I[:, None]
            mask_ID = whole_I[:, None] & col_mask_ID
            where_ID = row_at_I[:, None] + (c0 + cols_D)[None, :]
            w_ID = tl.load(weights_ptr + where_ID, mask=mask_ID, other=0.0)
            grad_ID = _gather_sum(
                grad_out_ptr, grad_at_ptr, scale_ptr, begin_I, end_I, valid_I, first_I, first_s_I, longest,
                c0 + cols_D, col_mask_ID, SCALED, BLOCK_L, ALIGN,
            )  # fmt: skip
            _apply(weights_ptr, w_ID, grad_ID, step_I, where_ID, mask_ID, seed, STOCHASTIC)
            where_ID = partial_ptr + slot_I[:, None] * partial_stride + (c0 + cols_D)[None, :]
            tl.store(where_ID, grad_ID, mask=part_I[:, None] & col_mask_ID)


@triton.jit
def _long_rows_kernel(
    weights_ptr,
    state_ptr,
    keys_ptr,
    long_row_at_ptr,
    long_dim_ptr,
    partial_ptr,
    partial_stride,
    nnz,
    lr,
    eps,
    seed,
    ADAGRAD: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program c finishes the long row (over CHUNK ids) whose chunks first reach a multiple of
    CHUNK at position p = c * CHUNK: one that starts at p and runs past p + CHUNK, or one that
    started inside the previous CHUNK positions and runs into p. Its tile holds a whole row."""
    p = tl.program_id(0).to(tl.int64) * CHUNK
    key = tl.load(keys_ptr + p)
    before = tl.load(keys_ptr + p - 1, mask=p > 0, other=-1)
    from_before = (p > 0) & (before == key)
    if from_before:
        started_here = tl.load(keys_ptr + p - CHUNK, mask=p >= CHUNK, other=-1) != key
    else:
        started_here = (p + CHUNK < nnz) & (
            tl.load(keys_ptr + p + CHUNK, mask=p + CHUNK < nnz, other=-1) == key
        )
    if started_here:
        at = p // CHUNK + tl.zeros([1], dtype=tl.int64)
        row_at = tl.load(long_row_at_ptr + at)
        dim = tl.load(long_dim_ptr + at)
        cols = tl.arange(0, BLOCK_D)
        mask = cols[None, :] < dim[:, None]
        where = row_at[:, None] + cols[None, :]
        w = tl.load(weights_ptr + where, mask=mask, other=0.0)
        keys = key + tl.zeros([1], dtype=tl.int64)
        total = _state(state_ptr, keys, keys >= 0, ADAGRAD)
        grad = tl.zeros([1, BLOCK_D], dtype=tl.float32)
        if from_before:  # the row's first chunk, inside the previous CHUNK positions
            slot = 2 * (p // CHUNK - 1) + 1
            grad += tl.load(partial_ptr + slot * partial_stride + cols[None, :], mask=mask, other=0.0)
        q = p
        while tl.load(keys_ptr + q, mask=q < nnz, other=-1) == key:
            slot = 2 * (q // CHUNK)
            grad += tl.load(partial_ptr + slot * partial_stride + cols[None, :], mask=mask, other=0.0)
            q += CHUNK
        step = _scale(state_ptr, total, tl.sum(grad * grad, axis=1), keys, dim, keys >= 0, lr, eps, ADAGRAD)
        _apply(weights_ptr, w, grad, step, where, mask, seed, STOCHASTIC)


def _config(max_dim: int, interpreted: bool) -> dict:
    """Launch parameters of the rows kernel. On a GPU (studies on an H100: update_tiles.py;
    BENCHMARKS.md, 2026-12-07): 8 chunks x 1 id x 32 columns a step on two warps (wider tiles
    were slower), held to 48 registers a thread under Triton 3.6 (bf16 adagrad took 53: 21
    programs an SM, not 18; 1.06x this kernel; the kit's register_cap: none under others).
    Interpreted, each op a NumPy call: few wide programs, 64 chunks x 4 ids of whole rows."""
    if interpreted:
        return {"BLOCK_I": 64, "BLOCK_L": 4, "BLOCK_D": triton.next_power_of_2(max_dim), "num_warps": 1,
                "num_stages": 1, "maxnreg": None}  # fmt: skip
    return {"BLOCK_I": 8, "BLOCK_L": 1, "BLOCK_D": 32, "num_warps": 2, "num_stages": 1,
            "maxnreg": register_cap(48)}  # fmt: skip


# Places in a buffer (a gradient row's start in grad_out, a table row's in weights) are int32 in
# buffers of fewer elements than this.
INT32_PLACES_BELOW = 2**31


def _places(buffer: torch.Tensor) -> torch.dtype:
    return torch.int32 if buffer.numel() < INT32_PLACES_BELOW else torch.int64


# Sort keys (each row's index in the state) are int32 below this many rows (at most the weights'
# elements or the state's entries, whichever is more): a radix sort of half the passes.
INT32_KEYS_BELOW = 2**31


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
    chunk = KNOBS["CHUNK"]
    block_d = min(cfg["BLOCK_D"], triton.next_power_of_2(max_dim))
    int32_keys = max(weights.numel(), state.numel()) < INT32_KEYS_BELOW
    bag, sorted_keys, order = sort_by_row(row_offsets, indices, offsets, batch, int32_keys=int32_keys)
    before, _ = count_chunks(sorted_keys, chunk)
    device = indices.device
    # Each sorted position resolved once, and the chunks' records (see _sorted_kernel): places in
    # int32 where the buffers allow (fewer registers and bytes).
    starts = torch.full((nnz + 1,), nnz, dtype=torch.int64, device=device)
    grad_at, c_grad_at = (torch.empty(nnz, dtype=_places(grad_out), device=device) for _ in range(2))
    c_row_at = torch.empty(nnz, dtype=_places(weights), device=device)
    c_key = torch.empty_like(sorted_keys)
    c_dim = torch.empty(nnz, dtype=torch.int32, device=device)
    long_row_at = torch.empty(triton.cdiv(nnz, chunk), dtype=c_row_at.dtype, device=device)
    long_dim = torch.empty(triton.cdiv(nnz, chunk), dtype=torch.int32, device=device)
    has_psw = per_sample_weights is not None
    scaled = has_psw or pooling == "mean"
    scale, c_scale = (torch.empty(nnz if scaled else 1, dtype=torch.float32, device=device) for _ in range(2))
    misaligned = torch.zeros(1, dtype=torch.int32, device=device)
    vec = 16 // weights.element_size() if VECTORS else 1  # grad_out's dtype is the weights'
    _sorted_kernel[(before.numel(),)](
        order, bag, sorted_keys, before, offsets, per_sample_weights if has_psw else scale, weight_offsets,
        row_offsets, dim_offsets, starts, grad_at, scale, c_key, c_row_at, c_dim, c_grad_at, c_scale,
        long_row_at, long_dim, misaligned, nnz, batch, grad_out.stride(0),
        POOL_MEAN=pooling == "mean", HAS_PSW=has_psw, CHUNK=chunk, VEC=vec, BLOCK=CHUNK_BLOCK, num_warps=8,
    )  # fmt: skip
    partial = torch.empty((2 * triton.cdiv(nnz, chunk), max_dim), dtype=torch.float32, device=weights.device)
    adagrad = optimizer == "adagrad"
    stochastic = bool(stochastic_rounding)
    _rows_kernel[(triton.cdiv(nnz, cfg["BLOCK_I"]),)](
        weights, state, grad_out, grad_at, scale, starts, c_key, c_row_at, c_dim, c_grad_at, c_scale,
        partial, max_dim, nnz, lr, eps, seed, misaligned,
        ADAGRAD=adagrad, SCALED=scaled, STOCHASTIC=stochastic, CHUNK=chunk, VEC=vec,
        BLOCK_I=cfg["BLOCK_I"], BLOCK_L=cfg["BLOCK_L"], BLOCK_D=block_d, SLICE_D=max(block_d // 4, 1),
        HALF=vec // 2 if vec == 8 else 1,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"],
    )  # fmt: skip
    _long_rows_kernel[(triton.cdiv(nnz, chunk),)](
        weights, state, sorted_keys, long_row_at, long_dim, partial, max_dim, nnz, lr, eps, seed,
        ADAGRAD=adagrad, STOCHASTIC=stochastic, CHUNK=chunk, BLOCK_D=triton.next_power_of_2(max_dim),
        num_warps=4,
    )  # fmt: skip
