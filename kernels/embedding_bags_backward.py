"""The table-batched embedding lookup's gradient for its tables, as one dense flat gradient: the
library's default kernel (search_space/embedding_bags_backward.py). The path of a dense gradient
and an optimizer's step (model.embeddings unfused, for comparison); a model's tables are trained
by the fused update (kernels/embedding_bags_update.py), which never forms it.

grad[weight_offsets[f] + indices[i] * dim_f + c] += psw[i] * grad_out[b, dim_offsets[f] + c]
(/ len(bag) for mean), W_f row r = weights[weight_offsets[f] + r * dim_f :][:dim_f]

It scatters with fp32 atomics into a dense fp32 gradient of every table: ids repeat within and
across bags, and features share tables. Its launch keeps one program per bag over the widest
feature's column blocks (faster than the forward's numbering on an H100).

This module is also the problem's knob template: a search writes values into KNOBS; None keeps
the launch heuristic (_backward_config) for that knob.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KNOBS = {
    "BLOCK_L": None,
    "BLOCK_D": None,
    "num_warps": None,
}

# Rows move in 16-byte vectors wherever alignment allows (_embedding_bags_bwd_kernel); False: an
# element at a time (for studies). Not a knob: it is only slower.
VECTORS = True


@triton.jit
def _embedding_bags_bwd_kernel(
    grad_out_ptr,
    weight_offsets_ptr,
    dim_offsets_ptr,
    indices_ptr,
    offsets_ptr,
    psw_ptr,
    grad_ptr,
    stride_grad_out_row,
    num_bags,
    HAS_PSW: tl.constexpr,
    MODE_MEAN: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLICE_D: tl.constexpr,
):
    keyed = tl.program_id(0).to(tl.int64)  # bag (feature, b) = feature * num_bags + b
    feature = keyed // num_bags
    first_col = tl.load(dim_offsets_ptr + feature)
    dim = tl.load(dim_offsets_ptr + feature + 1) - first_col
    if tl.program_id(1) * BLOCK_D >= dim:
        return
    table = tl.load(weight_offsets_ptr + feature)
    # As the forward's blocks (_pool_block): where the gradient row and the table's rows start on
    # 16-byte boundaries of grad_out's dtype (VEC elements, a multiple of the fp32 gradient's 4),
    # the same code runs told so, in vectors; otherwise SLICE_D columns at a time.
    col0 = tl.program_id(1) * BLOCK_D
    aligned = (dim % VEC == 0) & (first_col % VEC == 0) & (table % VEC == 0)
    aligned = aligned & (stride_grad_out_row % VEC == 0)
    if aligned:  # always, where VEC is 1
        _scatter_bag(
            grad_out_ptr, indices_ptr, offsets_ptr, psw_ptr, grad_ptr, stride_grad_out_row // VEC * VEC,
            num_bags, keyed, first_col // VEC * VEC, dim // VEC * VEC, table // VEC * VEC, col0,
            HAS_PSW, MODE_MEAN, BLOCK_L, BLOCK_D,
        )  # fmt: skip
    else:
        for s in range(0, tl.cdiv(tl.minimum(dim - col0, BLOCK_D), SLICE_D)):
            _scatter_bag(
                grad_out_ptr, indices_ptr, offsets_ptr, psw_ptr, grad_ptr, stride_grad_out_row, num_bags,
                keyed, first_col, dim, table, col0 + s * SLICE_D, HAS_PSW, MODE_MEAN, BLOCK_L, SLICE_D,
            )  # fmt: skip


@triton.jit
def _scatter_bag(
    grad_out_ptr, indices_ptr, offsets_ptr, psw_ptr, grad_ptr, stride_grad_out_row, num_bags,
    keyed, first_col, dim, table, col0,
    HAS_PSW: tl.constexpr, MODE_MEAN: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Bag `keyed`'s gradient row, BLOCK_D columns from col0, added into the rows of its ids."""
    cols = col0 + tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    table_ptr = grad_ptr + table
    start = tl.load(offsets_ptr + keyed).to(tl.int64)
    end = tl.load(offsets_ptr + keyed + 1).to(tl.int64)
    grad_row = grad_out_ptr + (keyed % num_bags) * stride_grad_out_row + first_col
    grad_D = tl.load(grad_row + cols, mask=col_mask, other=0.0).to(tl.float32)
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
            table_ptr + rows[:, None] * dim + cols[None, :],
            upd_LD,
            mask=pos_mask[:, None] & col_mask[None, :],
            sem="relaxed",
        )


def _backward_config(max_dim: int, interpreted: bool = False) -> dict:
    """Launch parameters of the backward: the single-table kernel's 16 ids of up to 128 columns
    on a GPU (untuned here); interpreted, 64 ids of whole rows."""
    row = triton.next_power_of_2(max(max_dim, 16))
    if interpreted:
        return {"BLOCK_L": 64, "BLOCK_D": min(row, 1024), "num_warps": 4}
    return {"BLOCK_L": 16, "BLOCK_D": min(row, 128), "num_warps": 4}


def embedding_bags_backward(
    grad_out: torch.Tensor,
    weight_offsets: torch.Tensor,
    dim_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    num_elements: int,
    *,
    total_dim: int,
    max_dim: int,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """grad_out [B, total_dim] -> the dense flat gradient [num_elements] of every table, in
    grad_out's dtype."""
    grad = torch.zeros(num_elements, dtype=torch.float32, device=grad_out.device)
    num_keyed = offsets.numel() - 1
    if num_keyed > 0 and indices.numel() > 0:
        grad_out = grad_out.contiguous()
        cfg = _backward_config(max_dim, interpreted=grad_out.device.type == "cpu")
        cfg = {name: value if KNOBS[name] is None else KNOBS[name] for name, value in cfg.items()}
        has_psw = per_sample_weights is not None
        _embedding_bags_bwd_kernel[(num_keyed, triton.cdiv(max_dim, cfg["BLOCK_D"]))](
            grad_out,
            weight_offsets,
            dim_offsets,
            indices,
            offsets,
            per_sample_weights if has_psw else grad_out,
            grad,
            grad_out.stride(0),
            num_keyed // weight_offsets.numel(),
            HAS_PSW=has_psw,
            MODE_MEAN=mode == "mean",
            VEC=16 // grad_out.element_size() if VECTORS else 1,
            SLICE_D=max(cfg["BLOCK_D"] // 4, 1),  # a quarter: 30 registers a thread, 28 aligned (sm_90)
            **cfg,
        )
    return grad.to(grad_out.dtype)
