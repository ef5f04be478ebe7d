"""Pooled embedding-bag lookup: the library's hand-written default kernels.

Forward:  out[b, :] = reduce_{i in [offsets[b], offsets[b+1])} psw[i] * weight[indices[i], :]
Backward: grad_weight[indices[i], :] += psw[i] * grad_out[b, :] (/ len(b) for mean)
          grad_psw[i] = <grad_out[b, :], weight[indices[i], :]>

The forward advances a few bags together and gathers a [BLOCK_B, BLOCK_L, BLOCK_D] tile of
rows per step (many independent loads in flight hide HBM latency on random rows), in fp32.
The backward scatters with fp32 atomics into a dense fp32 gradient: ids repeat within and
across bags.

This module is also the embedding_bag problem's knob template (search_space/embedding_bag.py):
a search writes values into KNOBS; None keeps the launch heuristic (_forward_config) for that
knob, which is what the default kernel runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KNOBS = {
    "BLOCK_B": None,
    "BLOCK_L": None,
    "BLOCK_D": None,
    "ACC_3D": None,
    "EVICT_ROWS": "",
    "num_warps": None,
    "num_stages": 1,
}

# A call whose bags hold at most this many ids on average is of the short regime, as its shape
# bucket says (search_space.embedding_bag.SHORT_BAG_MEAN_IDS).
SHORT_BAG_MEAN_IDS = 4.0


@triton.jit
def _embedding_bag_fwd_kernel(
    weight_ptr,
    indices_ptr,
    offsets_ptr,
    psw_ptr,
    out_ptr,
    stride_weight_row,
    stride_out_row,
    num_bags,
    dim,
    HAS_PSW: tl.constexpr,
    MODE_MEAN: tl.constexpr,
    ACC_3D: tl.constexpr,
    EVICT_ROWS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # BLOCK_B bags advance together, BLOCK_L positions each per step: one step issues
    # BLOCK_B * BLOCK_L independent row gathers, which is what hides HBM latency on random
    # rows. Bags that are done mask their loads off (no traffic) until the longest finishes.
    bags_B = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    bag_mask_B = bags_B < num_bags
    cols_D = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask_D = cols_D < dim
    start_B = tl.load(offsets_ptr + bags_B, mask=bag_mask_B, other=0).to(tl.int64)
    len_B = tl.load(offsets_ptr + bags_B + 1, mask=bag_mask_B, other=0).to(tl.int64) - start_B
    acc_BD = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    acc_BLD = tl.zeros([BLOCK_B, BLOCK_L, BLOCK_D], dtype=tl.float32)
    for step in tl.range(0, tl.max(len_B, axis=0), BLOCK_L, num_stages=NUM_STAGES):
        j_L = step + tl.arange(0, BLOCK_L)
        pos_BL = start_B[:, None] + j_L[None, :]
        mask_BL = j_L[None, :] < len_B[:, None]
        rows_BL = tl.load(indices_ptr + pos_BL, mask=mask_BL, other=0).to(tl.int64)
        vals_BLD = tl.load(
            weight_ptr + rows_BL[:, :, None] * stride_weight_row + cols_D[None, None, :],
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
    if MODE_MEAN:
        acc_BD = acc_BD / tl.maximum(len_B, 1).to(tl.float32)[:, None]
    tl.store(
        out_ptr + bags_B[:, None] * stride_out_row + cols_D[None, :],
        acc_BD.to(out_ptr.dtype.element_ty),
        mask=bag_mask_B[:, None] & col_mask_D[None, :],
    )


@triton.jit
def _embedding_bag_bwd_kernel(
    grad_out_ptr,
    indices_ptr,
    offsets_ptr,
    psw_ptr,
    grad_weight_ptr,
    stride_grad_out_row,
    stride_grad_weight_row,
    dim,
    HAS_PSW: tl.constexpr,
    MODE_MEAN: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bag = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    start = tl.load(offsets_ptr + bag).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1).to(tl.int64)
    grad_D = tl.load(grad_out_ptr + bag * stride_grad_out_row + cols, mask=col_mask, other=0.0)
    grad_D = grad_D.to(tl.float32)
    if MODE_MEAN:
        grad_D = grad_D / tl.maximum(end - start, 1).to(tl.float32)
    for pos0 in range(start, end, BLOCK_L):
        pos = pos0 + tl.arange(0, BLOCK_L)
        pos_mask = pos < end
        rows = tl.load(indices_ptr + pos, mask=pos_mask, other=0).to(tl.int64)
        upd_LD = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32) + grad_D[None, :]
        if HAS_PSW:
            upd_LD *= tl.load(psw_ptr + pos, mask=pos_mask, other=0.0).to(tl.float32)[:, None]
        tl.atomic_add(
            grad_weight_ptr + rows[:, None] * stride_grad_weight_row + cols[None, :],
            upd_LD,
            mask=pos_mask[:, None] & col_mask[None, :],
            sem="relaxed",
        )


def _whole_row(dim: int) -> int:
    # Interpreted programs take whole rows (up to 1024 columns): one program per bag block.
    return min(triton.next_power_of_2(max(dim, 16)), 1024)


def _block_d(dim: int) -> int:
    # A whole row per program up to 128 columns: one index load serves the full row.
    return min(triton.next_power_of_2(max(dim, 16)), 128)


def _forward_config(dim: int, element_size: int, mean_ids: float, interpreted: bool = False) -> dict:
    """Launch parameters of the forward, from a sweep on an H200 (BENCHMARKS.md, 2026-11-30):
    2-byte rows of more than 64 columns gather best as whole 256-byte rows, 4 bags x 8 ids per
    step; everything else as 64-column slices, 2 bags x 4 ids, with the 3D accumulator. That
    sweep's shapes were long bags: on short ones (at most SHORT_BAG_MEAN_IDS ids a bag on
    average) the 64-column slices lost to torch on an H100 (0.63x to 0.82x, BENCHMARKS.md
    2026-12-05, nineteenth session), with two bags a program and most of the id tile masked.
    Short bags of up to 64 columns, or of 4-byte rows, take the table-batched kernel's short-bag
    tiles instead (its sweep, same loop): 64 bags x 1 id x 32 columns (fp32) or 32 bags x 2 ids x
    32 columns (2-byte rows), two warps: 3.6x the slices at d64 in bf16 on an H100. Wider
    2-byte rows keep the whole-row tile on short bags too: at d128 in bf16 the short-bag tiles
    took 1.29x its time (BENCHMARKS.md 2026-12-05, twenty-first session).

    Interpreted (CPU tensors), each op of each program is a NumPy call whatever its tile, so few
    wide programs run fastest: 8 bags x 16 ids of whole rows (up to 1024 columns) per step, about
    a fifth of the GPU configuration's time over the problem's check shapes."""
    if interpreted:
        return {"BLOCK_B": 8, "BLOCK_L": 16, "BLOCK_D": _whole_row(dim), "ACC_3D": False, "num_warps": 2}
    if element_size == 2 and dim > 64:
        return {"BLOCK_B": 4, "BLOCK_L": 8, "BLOCK_D": 128, "ACC_3D": False, "num_warps": 2}
    if mean_ids <= SHORT_BAG_MEAN_IDS:
        block_b, block_l = (64, 1) if element_size == 4 else (32, 2)
        return {"BLOCK_B": block_b, "BLOCK_L": block_l, "BLOCK_D": 32, "ACC_3D": False, "num_warps": 2}
    block_d = min(triton.next_power_of_2(max(dim, 16)), 64)
    return {"BLOCK_B": 2, "BLOCK_L": 4, "BLOCK_D": block_d, "ACC_3D": True, "num_warps": 2}


def tile_limit(acc_3d: bool) -> int:
    """Elements of a gather tile that stay in registers: half as many with the 3D accumulator
    beside it (also the problem's bound on a tile a search fixes,
    search_space.embedding_bag._knob_constraints)."""
    return 8192 if acc_3d else 16384


def _fit_tile(cfg: dict, *, heuristic_bags: bool) -> dict:
    """`cfg` with the heuristic's bags per program halved until the tile fits tile_limit, where
    a search fixed the other sizes: 32 ids a step on short bags' 64 bags would spill."""
    limit = tile_limit(cfg["ACC_3D"])
    cfg = dict(cfg)
    while heuristic_bags and cfg["BLOCK_B"] > 1 and cfg["BLOCK_B"] * cfg["BLOCK_L"] * cfg["BLOCK_D"] > limit:
        cfg["BLOCK_B"] //= 2
    return cfg


def _backward_config(dim: int, interpreted: bool = False) -> tuple[int, int]:
    """(ids per step, columns per program) of the backward: 16 ids of up to 128 columns on a
    GPU; interpreted, 64 ids of whole rows (up to 1024 columns), few programs and few steps."""
    if interpreted:
        return 64, _whole_row(dim)
    return 16, _block_d(dim)


def check_arguments(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    per_sample_weights: torch.Tensor | None,
) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [num_rows, D], got shape {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("weight must have unit stride along D (call .contiguous())")
    if indices.dim() != 1 or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError("indices must be [nnz] and offsets [B + 1] with B >= 0")
    if indices.dtype not in (torch.int32, torch.int64) or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices and offsets must be int32 or int64, got {indices.dtype}, {offsets.dtype}")
    if mode not in ("sum", "mean"):
        raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
    if per_sample_weights is not None:
        if mode != "sum":
            raise ValueError("per_sample_weights is only supported with mode='sum'")
        if per_sample_weights.shape != indices.shape:
            raise ValueError(
                f"per_sample_weights must match indices' shape {tuple(indices.shape)}, "
                f"got {tuple(per_sample_weights.shape)}"
            )


def embedding_bag_forward(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    *,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """weight [num_rows, D], indices [nnz], offsets [B + 1], psw [nnz] or None -> out [B, D]."""
    check_arguments(weight, indices, offsets, mode, per_sample_weights)
    num_bags, dim = offsets.numel() - 1, weight.shape[1]
    out = torch.empty((num_bags, dim), dtype=weight.dtype, device=weight.device)
    if num_bags == 0 or dim == 0:
        return out
    mean_ids = indices.numel() / num_bags  # sizes the host knows: no sync
    interpreted = weight.device.type == "cpu"
    cfg = _forward_config(dim, weight.element_size(), mean_ids, interpreted=interpreted)
    cfg = {name: value if KNOBS[name] is None else KNOBS[name] for name, value in cfg.items()}
    if not interpreted:
        cfg = _fit_tile(cfg, heuristic_bags=KNOBS["BLOCK_B"] is None)
    has_psw = per_sample_weights is not None
    grid = (triton.cdiv(num_bags, cfg["BLOCK_B"]), triton.cdiv(dim, cfg["BLOCK_D"]))
    _embedding_bag_fwd_kernel[grid](
        weight,
        indices,
        offsets,
        per_sample_weights if has_psw else weight,
        out,
        weight.stride(0),
        out.stride(0),
        num_bags,
        dim,
        HAS_PSW=has_psw,
        MODE_MEAN=mode == "mean",
        EVICT_ROWS=KNOBS["EVICT_ROWS"],
        NUM_STAGES=KNOBS["num_stages"],
        num_stages=1,
        **cfg,
    )
    return out


def embedding_bag_backward(
    grad_out: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    num_rows: int,
    *,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """grad_out [B, D] -> dense grad_weight [num_rows, D] in grad_out's dtype."""
    num_bags, dim = grad_out.shape
    grad_weight = torch.zeros((num_rows, dim), dtype=torch.float32, device=grad_out.device)
    if num_bags > 0 and dim > 0 and indices.numel() > 0:
        grad_out = grad_out.contiguous()
        block_l, block_d = _backward_config(dim, interpreted=grad_out.device.type == "cpu")
        has_psw = per_sample_weights is not None
        _embedding_bag_bwd_kernel[(num_bags, triton.cdiv(dim, block_d))](
            grad_out,
            indices,
            offsets,
            per_sample_weights if has_psw else grad_out,
            grad_weight,
            grad_out.stride(0),
            grad_weight.stride(0),
            dim,
            HAS_PSW=has_psw,
            MODE_MEAN=mode == "mean",
            BLOCK_L=block_l,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return grad_weight.to(grad_out.dtype)
