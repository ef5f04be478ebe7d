"""Table-batched pooled embedding lookup: the library's default kernel (search_space/embedding_bags.py).

out[b, dim_offsets[f] + c] = reduce_{i in bag (f, b)} psw[i] * W_f[indices[i], c],
W_f row r = weights[weight_offsets[f] + r * dim_f :][:dim_f]

One launch serves every feature. A forward program takes one block of bags and one block of
columns of one feature (a narrow feature launches only the programs its dim needs): BLOCK_B bags
advance together and gather a [BLOCK_B, BLOCK_L, BLOCK_D] tile of rows per step (many loads in
flight hide HBM latency on random rows), accumulated in fp32, rounded once. PROGRAMS caps the
grid (a persistent launch; by default in 16-bit types from 96K blocks, _programs). Blocks go
feature by feature, or bag block by bag block where 16-bit output rows start off 32-byte
sectors (BAGS_MAJOR, _block_of). Rows move in 16-byte vectors wherever alignment allows (_pool_block).
A block advances until its longest bag ends; FLAT (_flat_sums) takes a block's ids in order
instead, every lane busy, summed into bags on the tensor cores (slower at every timing shape:
off by default).

The tables' dense gradient (the unfused path's) is kernels/embedding_bags_backward.py's.

This module is also the problem's knob template: a search writes values into KNOBS; None keeps
the launch heuristic (_forward_config; _programs for PROGRAMS) for that knob.
Arguments are checked by the op (search_space.embedding_bags).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kit.embeddings import register_cap

KNOBS = {
    "BLOCK_B": None,
    "BLOCK_L": None,
    "BLOCK_D": None,
    "ACC_3D": None,
    "EVICT_ROWS": "",
    "num_warps": None,
    "num_stages": 1,
    "PROGRAMS": None,
    "FLAT": None,
    "SLICES_TOGETHER": None,
    "BAGS_MAJOR": None,
    "maxnreg": None,
}

# Rows move in 16-byte vectors wherever a block's alignment allows (_pool_block); False: an element
# at a time (for studies). Not a knob: it is only slower.
VECTORS = True

# A call whose bags hold at most this many ids on average holds short features only (one to three
# ids): the bucket's regime (search_space.embedding_bags.SHORT_MEAN_IDS).
SHORT_MEAN_IDS = 2.0


@triton.jit
def _block_of(
    p, num_blocks, num_bag_blocks, num_bags, num_features, f_F, lo_F, dim_F, blocks_F, ends_F,
    weight_offsets_ptr, offsets_ptr, BLOCK_B: tl.constexpr, SLICES_TOGETHER: tl.constexpr,
    BAGS_MAJOR: tl.constexpr,
):  # fmt: skip
    """Block p: its feature's first output column and dim, its column block, its table's offset,
    its bags, their bound (0 past the last block or feature: nothing is loaded or stored), and
    the bags' starts and lengths (the block's loads of the offsets).

    Blocks are numbered feature by feature: within a feature, either every bag block of column
    block 0, then of column block 1, ... (the slices of one row are read num_bag_blocks programs
    apart), or (SLICES_TOGETHER) every column block of bag block 0, then of bag block 1, ...: the
    slices of a row are read by neighbouring programs, at about the same time. Or (BAGS_MAJOR,
    where SLICES_TOGETHER is off) bag block by bag block, each one's features and column blocks
    in turn (blocks past the last bag block store nothing): neighbouring programs write the
    parts of the same output rows."""
    if SLICES_TOGETHER:
        feature = tl.sum((ends_F * num_bag_blocks <= p).to(tl.int32), axis=0)
        feature = tl.where(p < num_blocks, feature, num_features)
        this_F = f_F == feature
        q = p - tl.sum(tl.where(this_F, (ends_F - blocks_F) * num_bag_blocks, 0), axis=0)
        slices = tl.maximum(tl.sum(tl.where(this_F, blocks_F, 0), axis=0), 1)  # 1 past the last
        col_block = q % slices
        bag_block = q // slices
    else:
        if BAGS_MAJOR:
            column_blocks = tl.maximum(tl.max(ends_F, axis=0), 1)
            block = p % column_blocks
            bag_block = p // column_blocks
        else:
            block = p // num_bag_blocks
            bag_block = p % num_bag_blocks
        feature = tl.sum((ends_F <= block).to(tl.int32), axis=0)
        feature = tl.where(p < num_blocks, feature, num_features)
        this_F = f_F == feature
        col_block = block - tl.sum(tl.where(this_F, ends_F - blocks_F, 0), axis=0)
    first_col = tl.sum(tl.where(this_F, lo_F, 0), axis=0)
    dim = tl.sum(tl.where(this_F, dim_F, 0), axis=0)  # 0 past the last feature
    table = tl.load(weight_offsets_ptr + tl.minimum(feature, num_features - 1))
    bags_B = bag_block.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    limit = tl.where(feature < num_features, num_bags, 0)
    bag_mask_B = bags_B < limit
    keyed_B = feature.to(tl.int64) * num_bags + bags_B  # bag (feature, b) in the feature-major offsets
    start_B = tl.load(offsets_ptr + keyed_B, mask=bag_mask_B, other=0).to(tl.int64)
    len_B = tl.load(offsets_ptr + keyed_B + 1, mask=bag_mask_B, other=0).to(tl.int64) - start_B
    return first_col, dim, col_block, table, bags_B, limit, start_B, len_B


@triton.jit
def _pool_block(
    weights_ptr, indices_ptr, psw_ptr, out_ptr, stride_out_row,
    first_col, dim, col_block, table, bags_B, limit, start_B, len_B,
    HAS_PSW: tl.constexpr, MODE_MEAN: tl.constexpr, ACC_3D: tl.constexpr, EVICT_ROWS: tl.constexpr,
    NUM_STAGES: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    VEC: tl.constexpr, FLAT: tl.constexpr, SLICE_D: tl.constexpr,
):  # fmt: skip
    """One block's pooled bags (_block_of's description of it) into the output. The dims and
    offsets are read from memory, so the compiler would move rows an element at a time: where
    this block's table, dim, first column and the output's row stride are multiples of VEC
    elements (16 bytes), the same code runs on x // VEC * VEC of each (which the compiler then
    knows), in 16-byte vectors. In 2-byte dtypes, where only the output's starts are multiples
    of VEC / 2 (a dim-4 feature shifts every later column and odd sample's row so: odd_dims.py),
    table rows still move so, and sums go out in 8 bytes. Where all starts allow 8 bytes only,
    HD columns (the block, or half at one id a step: registers) in 8-byte vectors; else SLICE_D
    columns at a time (_slice_d; whole tiles took twice the registers)."""
    H: tl.constexpr = max(VEC // 2, 1)
    rows = (dim % VEC == 0) & (table % VEC == 0)
    if rows & (first_col % VEC == 0) & (stride_out_row % VEC == 0):  # always where VEC is 1
        _pool_rows(
            weights_ptr, indices_ptr, psw_ptr, out_ptr, stride_out_row // VEC * VEC,
            first_col // VEC * VEC, dim // VEC * VEC, col_block, table // VEC * VEC,
            bags_B, limit, start_B, len_B,
            HAS_PSW, MODE_MEAN, ACC_3D, EVICT_ROWS, NUM_STAGES, BLOCK_B, BLOCK_L, BLOCK_D, FLAT,
        )  # fmt: skip
    elif (VEC == 8) & rows & (first_col % H == 0) & (stride_out_row % H == 0):
        _pool_rows(
            weights_ptr, indices_ptr, psw_ptr, out_ptr, stride_out_row // H * H,
            first_col // H * H, dim // VEC * VEC, col_block, table // VEC * VEC,
            bags_B, limit, start_B, len_B,
            HAS_PSW, MODE_MEAN, ACC_3D, EVICT_ROWS, NUM_STAGES, BLOCK_B, BLOCK_L, BLOCK_D, FLAT,
        )  # fmt: skip
    elif SLICE_D == BLOCK_D:  # fp32 (_slice_d): the measured code, with no loop around it
        _pool_rows(
            weights_ptr, indices_ptr, psw_ptr, out_ptr, stride_out_row,
            first_col, dim, col_block, table, bags_B, limit, start_B, len_B,
            HAS_PSW, MODE_MEAN, ACC_3D, EVICT_ROWS, NUM_STAGES, BLOCK_B, BLOCK_L, BLOCK_D, FLAT,
        )  # fmt: skip
    else:
        tl.static_assert(BLOCK_D % SLICE_D == 0)
        HD: tl.constexpr = BLOCK_D if BLOCK_L > 1 else BLOCK_D // 2
        if (dim % H == 0) & (table % H == 0) & (first_col % H == 0) & (stride_out_row % H == 0):
            for s in range(0, tl.cdiv(tl.minimum(dim - col_block * BLOCK_D, BLOCK_D), HD)):
                _pool_rows(
                    weights_ptr, indices_ptr, psw_ptr, out_ptr, stride_out_row // H * H,
                    first_col // H * H, dim // H * H, col_block * (BLOCK_D // HD) + s, table // H * H,
                    bags_B, limit, start_B, len_B,
                    HAS_PSW, MODE_MEAN, ACC_3D, EVICT_ROWS, NUM_STAGES, BLOCK_B, BLOCK_L, HD, FLAT,
                )  # fmt: skip
        else:
            for s in range(0, tl.cdiv(tl.minimum(dim - col_block * BLOCK_D, BLOCK_D), SLICE_D)):
                _pool_rows(
                    weights_ptr, indices_ptr, psw_ptr, out_ptr, stride_out_row,
                    first_col, dim, col_block * (BLOCK_D // SLICE_D) + s, table,
                    bags_B, limit, start_B, len_B,
                    HAS_PSW, MODE_MEAN, ACC_3D, EVICT_ROWS, NUM_STAGES, BLOCK_B, BLOCK_L, SLICE_D, FLAT,
                )  # fmt: skip


@triton.jit
def _pool_rows(
    weights_ptr, indices_ptr, psw_ptr, out_ptr, stride_out_row,
    first_col, dim, col_block, table, bags_B, limit, start_B, len_B,
    HAS_PSW: tl.constexpr, MODE_MEAN: tl.constexpr, ACC_3D: tl.constexpr, EVICT_ROWS: tl.constexpr,
    NUM_STAGES: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    FLAT: tl.constexpr,
):  # fmt: skip
    """_pool_block's work: the bags' sums, by steps of BLOCK_L ids of each bag, or (FLAT) by
    chunks of the block's ids in order."""
    cols_D = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask_D = cols_D < dim
    table_ptr = weights_ptr + table
    if FLAT:
        acc_BD = _flat_sums(
            table_ptr, indices_ptr, psw_ptr, dim, cols_D, col_mask_D, bags_B < limit, start_B, len_B,
            HAS_PSW, EVICT_ROWS, BLOCK_B, BLOCK_B * BLOCK_L, BLOCK_D,
        )  # fmt: skip
    else:
        acc_BD = _step_sums(
            table_ptr, indices_ptr, psw_ptr, dim, cols_D, col_mask_D, start_B, len_B,
            HAS_PSW, ACC_3D, EVICT_ROWS, NUM_STAGES, BLOCK_B, BLOCK_L, BLOCK_D,
        )  # fmt: skip
    if MODE_MEAN:
        acc_BD = acc_BD / tl.maximum(len_B, 1).to(tl.float32)[:, None]
    tl.store(
        out_ptr + bags_B[:, None] * stride_out_row + first_col + cols_D[None, :],
        acc_BD.to(out_ptr.dtype.element_ty),
        mask=(bags_B < limit)[:, None] & col_mask_D[None, :],
    )


@triton.jit
def _flat_sums(
    table_ptr, indices_ptr, psw_ptr, dim, cols_D, col_mask_D, live_B, start_B, len_B,
    HAS_PSW: tl.constexpr, EVICT_ROWS: tl.constexpr, BLOCK_B: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The bags' sums [BLOCK_B, BLOCK_D], taking the block's ids (contiguous: its bags are) in
    order, CHUNK at a time whatever bag each is in: no lane waits for the block's longest bag.
    Each chunk's rows go to their bags through a product with the chunk's membership matrix
    [BLOCK_B, CHUNK] on the tensor cores: TF32, exact for 0/1 (or 16-bit) factors times 16-bit
    rows; fp32 takes three TF32 products (about 22 bits). An inf or NaN in a table row makes NaN
    of the other bags of its chunk too. Ids between the block's first and last are read."""
    lo = tl.min(tl.where(live_B, start_B, 1 << 62), axis=0)
    end_B = start_B + len_B
    hi = tl.max(tl.where(live_B, end_B, 0), axis=0)
    acc_BD = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    for q in tl.range(lo, hi, CHUNK):
        q_C = q + tl.arange(0, CHUNK)
        in_C = q_C < hi
        rows_C = tl.load(indices_ptr + q_C, mask=in_C, other=0).to(tl.int64)
        vals_CD = tl.load(
            table_ptr + rows_C[:, None] * dim + cols_D[None, :],
            mask=in_C[:, None] & col_mask_D[None, :],
            other=0.0,
            eviction_policy=EVICT_ROWS,
        )
        factor_BC = ((start_B[:, None] <= q_C[None, :]) & (q_C[None, :] < end_B[:, None])).to(tl.float32)
        if HAS_PSW:
            factor_BC *= tl.load(psw_ptr + q_C, mask=in_C, other=0.0).to(tl.float32)[None, :]
        if vals_CD.dtype == tl.float32 or (HAS_PSW and psw_ptr.dtype.element_ty == tl.float32):
            acc_BD = tl.dot(factor_BC, vals_CD.to(tl.float32), acc_BD, input_precision="tf32x3")
        else:  # 0/1 or a bf16 or fp16 weight, times a bf16 or fp16 value: exact in TF32
            acc_BD = tl.dot(factor_BC, vals_CD.to(tl.float32), acc_BD, input_precision="tf32")
    return acc_BD


@triton.jit
def _step_sums(
    table_ptr, indices_ptr, psw_ptr, dim, cols_D, col_mask_D, start_B, len_B,
    HAS_PSW: tl.constexpr, ACC_3D: tl.constexpr, EVICT_ROWS: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The bags' sums [BLOCK_B, BLOCK_D], BLOCK_L ids of every bag a step."""
    acc_BD = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    acc_BLD = tl.zeros([BLOCK_B, BLOCK_L, BLOCK_D], dtype=tl.float32)
    # Bags that are done mask their loads off (no traffic) until the block's longest finishes.
    for step in tl.range(0, tl.max(len_B, axis=0), BLOCK_L, num_stages=NUM_STAGES):
        j_L = step + tl.arange(0, BLOCK_L)
        pos_BL = start_B[:, None] + j_L[None, :]
        mask_BL = j_L[None, :] < len_B[:, None]
        rows_BL = tl.load(indices_ptr + pos_BL, mask=mask_BL, other=0).to(tl.int64)
        vals_BLD = tl.load(
            table_ptr + rows_BL[:, :, None] * dim + cols_D[None, None, :],
            mask=mask_BL[:, :, None] & col_mask_D[None, None, :],
            other=0.0,
            eviction_policy=EVICT_ROWS,
        )
        vals_BLD = vals_BLD.to(tl.float32)
        if HAS_PSW:
            vals_BLD *= tl.load(psw_ptr + pos_BL, mask=mask_BL, other=0.0).to(tl.float32)[:, :, None]
        if ACC_3D:
            acc_BLD += vals_BLD
        else:
            acc_BD += tl.sum(vals_BLD, axis=1)
    if ACC_3D:
        acc_BD = tl.sum(acc_BLD, axis=1)
    return acc_BD


@triton.jit
def _embedding_bags_fwd_kernel(
    weights_ptr,
    weight_offsets_ptr,
    dim_offsets_ptr,
    indices_ptr,
    offsets_ptr,
    psw_ptr,
    out_ptr,
    stride_out_row,
    num_bags,
    num_bag_blocks,
    num_blocks,
    num_features,
    HAS_PSW: tl.constexpr,
    MODE_MEAN: tl.constexpr,
    FEATURES: tl.constexpr,
    ACC_3D: tl.constexpr,
    EVICT_ROWS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    VEC: tl.constexpr,
    FLAT: tl.constexpr,
    SLICES_TOGETHER: tl.constexpr,
    BAGS_MAJOR: tl.constexpr,
    SLICE_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Each feature has num_bag_blocks x cdiv(d, BLOCK_D) blocks (dim d), numbered feature by
    # feature or bag block by bag block (_block_of), on one axis (a second would stop at 65535).
    # `num_blocks` is a bound taken on the host: blocks past the last feature's (or bag block's)
    # store nothing. A program takes blocks p, p + grid, ...: several in a persistent launch.
    f_F = tl.arange(0, FEATURES)
    in_F = f_F < num_features
    lo_F = tl.load(dim_offsets_ptr + f_F, mask=in_F, other=0)
    dim_F = tl.load(dim_offsets_ptr + f_F + 1, mask=in_F, other=0) - lo_F
    blocks_F = (dim_F + BLOCK_D - 1) // BLOCK_D
    ends_F = tl.cumsum(blocks_F, axis=0)
    for p in tl.range(tl.program_id(0), num_blocks, tl.num_programs(0)):
        first_col, dim, col_block, table, bags_B, limit, start_B, len_B = _block_of(
            p, num_blocks, num_bag_blocks, num_bags, num_features,
            f_F, lo_F, dim_F, blocks_F, ends_F, weight_offsets_ptr, offsets_ptr, BLOCK_B, SLICES_TOGETHER,
            BAGS_MAJOR,
        )  # fmt: skip
        _pool_block(
            weights_ptr, indices_ptr, psw_ptr, out_ptr, stride_out_row,
            first_col, dim, col_block, table, bags_B, limit, start_B, len_B,
            HAS_PSW, MODE_MEAN, ACC_3D, EVICT_ROWS, NUM_STAGES, BLOCK_B, BLOCK_L, BLOCK_D, VEC, FLAT, SLICE_D,
        )  # fmt: skip


def _whole_row(max_dim: int) -> int:
    # Interpreted programs take whole rows (up to 1024 columns): one column block per feature.
    return min(triton.next_power_of_2(max(max_dim, 16)), 1024)


def _forward_config(max_dim: int, element_size: int, mean_ids: float, interpreted: bool = False) -> dict:
    """Launch parameters of the forward, from sweeps of its timing shapes (evals/studies/bags_tiles.py).

    An H100 sweep of every timing shape (BENCHMARKS.md, 2026-12-06) found 64 columns a slice best
    in both dtypes: short bags, 64 bags x 1 id a step on two warps; bf16 pooled batches (bags of
    up to 120 ids), 32 bags x 2 ids, in 16-bit types held to 128 registers a thread under Triton
    3.6 (with per-sample weights it took more: 1.13x at b256k-f20-mixed-weighted; the short
    tile's 166 lost 5% to 12% held so; no cap under other Tritons: the kit's register_cap);
    fp32 pooled batches, 16 bags x 2 ids, 3D accumulator.

    Interpreted (CPU tensors), each op of each program is a NumPy call whatever its tile, so few
    wide programs run fastest: 16 bags x 16 ids of whole rows per step."""
    maxnreg = None
    if interpreted:
        tile = (16, 16, _whole_row(max_dim), False)
    elif mean_ids <= SHORT_MEAN_IDS:
        tile = (64, 1, 64, False)
    elif element_size == 4:
        tile = (16, 2, 64, True)
    else:
        tile, maxnreg = (32, 2, 64, False), register_cap(128)
    # Off (H100, BENCHMARKS.md): FLAT, 0.45x to 0.79x these tiles; SLICES_TOGETHER, 0.97x to 1.05x.
    names = ("BLOCK_B", "BLOCK_L", "BLOCK_D", "ACC_3D")
    fixed = {"num_warps": 2, "FLAT": False, "SLICES_TOGETHER": False, "maxnreg": maxnreg}
    return dict(zip(names, tile, strict=True)) | fixed


def _slice_d(cfg: dict, vec: int, element_size: int) -> int:
    """A misaligned block's column slice (_pool_block): a VECth of the block's for 2-byte elements
    (the aligned path's registers: evals/studies/registers.py; FLAT's product takes 16 or more);
    in fp32 the whole block (with slices the short fp32 shape ran at 0.73x on an H100)."""
    if element_size == 4:
        return cfg["BLOCK_D"]
    return min(cfg["BLOCK_D"], max(cfg["BLOCK_D"] // vec, 16 if cfg["FLAT"] else 1))


def _programs(num_blocks: int, element_size: int) -> int:
    """The grid where PROGRAMS is None: a program a block, but in 16-bit types from 96K blocks a
    program per 48 of them, 2112 at least (bf16 on an H100: 1.10x at b256k-f20-short, 1.05x at
    b256k-f20-mixed-weighted, 0.99x at b128k-f32-mixed; in fp32 it lost 1% to 4%, and below 96K
    blocks grids of 16 or 32 programs an SM lost 9% or more: BENCHMARKS.md, 2026-12-07,
    thirty-seventh session)."""
    if element_size == 2 and num_blocks >= 96 * 1024:
        return max(2112, num_blocks // 48)
    return num_blocks


def _bags_major(total_dim: int, element_size: int) -> bool:
    """The block order where BAGS_MAJOR is None: in 16-bit types, bag block by bag block where
    the output's rows start off 32-byte sectors (a feature of 4, 8 or 12 columns puts most rows
    there), whose parts other programs write; written close together, a sector is whole in L2
    before it goes to memory (BENCHMARKS.md, 2026-12-07, thirty-eighth session: H100, 1.09x at
    b64k-f27-short-d4, 1.15x at b256k-f20-short with a dim-4 feature; at aligned rows this order
    lost 5% to 12%). fp32 keeps the features' order: there it was timed only in a form with costs
    of its own. Features of such dims inside a row of aligned stride are not seen here (the dims
    are on the device): they keep the features' order too."""
    return element_size == 2 and total_dim * element_size % 32 != 0


def embedding_bags_forward(
    weights: torch.Tensor,
    weight_offsets: torch.Tensor,
    dim_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    *,
    total_dim: int,
    max_dim: int,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """weights [N], weight_offsets [F], dim_offsets [F + 1], indices [nnz], offsets [F * B + 1],
    psw [nnz] or None -> out [B, total_dim]. Reads nothing back from the device."""
    num_features = weight_offsets.numel()
    num_bags = (offsets.numel() - 1) // num_features
    out = torch.empty((num_bags, total_dim), dtype=weights.dtype, device=weights.device)
    if num_bags == 0:
        return out
    mean_ids = indices.numel() / (offsets.numel() - 1)
    cfg = _forward_config(max_dim, weights.element_size(), mean_ids, interpreted=weights.device.type == "cpu")
    cfg = {name: value if KNOBS[name] is None else KNOBS[name] for name, value in cfg.items()}
    has_psw = per_sample_weights is not None
    # Every feature's column blocks: at most cdiv(dim_f, BLOCK_D) <= (dim_f + BLOCK_D - 1) / BLOCK_D
    # each, summed from the dims' total (the dims themselves are on the device).
    column_blocks = (total_dim + num_features * (cfg["BLOCK_D"] - 1)) // cfg["BLOCK_D"]
    num_bag_blocks = triton.cdiv(num_bags, cfg["BLOCK_B"])
    num_blocks = column_blocks * num_bag_blocks
    # A persistent launch caps the grid (PROGRAMS); each program then loops over blocks.
    programs = min(num_blocks, KNOBS["PROGRAMS"] or _programs(num_blocks, weights.element_size()))
    vec = 16 // weights.element_size() if VECTORS else 1
    bags_major = KNOBS["BAGS_MAJOR"]
    if bags_major is None:
        bags_major = _bags_major(total_dim, weights.element_size())
    _embedding_bags_fwd_kernel[(programs,)](
        weights,
        weight_offsets,
        dim_offsets,
        indices,
        offsets,
        per_sample_weights if has_psw else weights,
        out,
        out.stride(0),
        num_bags,
        num_bag_blocks,
        num_blocks,
        num_features,
        HAS_PSW=has_psw,
        MODE_MEAN=mode == "mean",
        FEATURES=triton.next_power_of_2(num_features),
        EVICT_ROWS=KNOBS["EVICT_ROWS"],
        NUM_STAGES=KNOBS["num_stages"],
        VEC=vec,
        SLICE_D=_slice_d(cfg, vec, weights.element_size()),
        BAGS_MAJOR=bags_major,
        num_stages=1,
        **cfg,
    )
    return out
