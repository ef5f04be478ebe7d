"""Pooled embedding-bag lookup: the library's hand-written default kernels.

Forward:  out[b, :] = reduce_{i in [offsets[b], offsets[b+1])} psw[i] * weight[indices[i], :]
Backward: grad_weight[indices[i], :] += psw[i] * grad_out[b, :] (/ len(b) for mean)
          grad_psw[i] = <grad_out[b, :], weight[indices[i], :]>

The forward gathers a [BLOCK_L, BLOCK_D] tile of rows per step (many independent 16-byte
loads in flight hide HBM latency on random rows) and reduces in fp32. The backward scatters
with fp32 atomics into a dense fp32 gradient: ids repeat within and across bags.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _embedding_bag_fwd_kernel(
    weight_ptr, indices_ptr, offsets_ptr, psw_ptr, out_ptr,
    stride_weight_row, stride_out_row,
    num_bags, dim,
    HAS_PSW: tl.constexpr, MODE_MEAN: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bag = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    start = tl.load(offsets_ptr + bag).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1).to(tl.int64)
    # A 2D accumulator defers the cross-row reduction to one tl.sum after the loop.
    acc_LD = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for pos0 in range(start, end, BLOCK_L):
        pos = pos0 + tl.arange(0, BLOCK_L)
        pos_mask = pos < end
        rows = tl.load(indices_ptr + pos, mask=pos_mask, other=0).to(tl.int64)
        vals_LD = tl.load(weight_ptr + rows[:, None] * stride_weight_row + cols[None, :],
                          mask=pos_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        if HAS_PSW:
            vals_LD *= tl.load(psw_ptr + pos, mask=pos_mask, other=0.0).to(tl.float32)[:, None]
        acc_LD += vals_LD
    acc_D = tl.sum(acc_LD, axis=0)
    if MODE_MEAN:
        acc_D = acc_D / tl.maximum(end - start, 1).to(tl.float32)
    tl.store(out_ptr + bag * stride_out_row + cols, acc_D.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _embedding_bag_bwd_kernel(
    grad_out_ptr, indices_ptr, offsets_ptr, psw_ptr, grad_weight_ptr,
    stride_grad_out_row, stride_grad_weight_row,
    dim,
    HAS_PSW: tl.constexpr, MODE_MEAN: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
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
        tl.atomic_add(grad_weight_ptr + rows[:, None] * stride_grad_weight_row + cols[None, :],
                      upd_LD, mask=pos_mask[:, None] & col_mask[None, :], sem="relaxed")


def _block_d(dim: int) -> int:
    # A whole row per program up to 128 columns: one index load serves the full row.
    return min(triton.next_power_of_2(max(dim, 16)), 128)


def _check(weight: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
           mode: str, per_sample_weights: torch.Tensor | None) -> None:
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
            raise ValueError(f"per_sample_weights must match indices' shape {tuple(indices.shape)}, "
                             f"got {tuple(per_sample_weights.shape)}")


def embedding_bag_forward(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    *,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """weight [num_rows, D], indices [nnz], offsets [B + 1], psw [nnz] or None -> out [B, D]."""
    _check(weight, indices, offsets, mode, per_sample_weights)
    num_bags, dim = offsets.numel() - 1, weight.shape[1]
    out = torch.empty((num_bags, dim), dtype=weight.dtype, device=weight.device)
    if num_bags == 0 or dim == 0:
        return out
    block_d = _block_d(dim)
    has_psw = per_sample_weights is not None
    _embedding_bag_fwd_kernel[(num_bags, triton.cdiv(dim, block_d))](
        weight, indices, offsets, per_sample_weights if has_psw else weight, out,
        weight.stride(0), out.stride(0),
        num_bags, dim,
        HAS_PSW=has_psw, MODE_MEAN=mode == "mean",
        BLOCK_L=16, BLOCK_D=block_d,
        num_warps=4,
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
        block_d = _block_d(dim)
        has_psw = per_sample_weights is not None
        _embedding_bag_bwd_kernel[(num_bags, triton.cdiv(dim, block_d))](
            grad_out, indices, offsets, per_sample_weights if has_psw else grad_out, grad_weight,
            grad_out.stride(0), grad_weight.stride(0),
            dim,
            HAS_PSW=has_psw, MODE_MEAN=mode == "mean",
            BLOCK_L=16, BLOCK_D=block_d,
            num_warps=4,
        )
    return grad_weight.to(grad_out.dtype)
