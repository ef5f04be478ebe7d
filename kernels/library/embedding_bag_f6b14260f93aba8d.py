"""Pooled embedding-bag forward, rendered from recforge's `embedding_bag` knob template.

out[b, :] = reduce_{i in bag b} psw[i] * weight[indices[i], :], reduce = sum or mean.
Grid: (bags / BLOCK_B, D / BLOCK_D). BLOCK_B bags advance together, BLOCK_L ids each per
step, so one step issues BLOCK_B * BLOCK_L independent row gathers; accumulation is fp32.
"""

import torch
import triton
import triton.language as tl

KNOBS = {
    "BLOCK_B": 4,
    "BLOCK_L": 8,
    "BLOCK_D": 64,
    "ACC_3D": False,
    "EVICT_ROWS": '',
    "num_warps": 2,
    "num_stages": 1,
}


@triton.jit
def _embedding_bag_fwd_kernel(
    weight_ptr, indices_ptr, offsets_ptr, psw_ptr, out_ptr,
    stride_weight_row, stride_out_row,
    num_bags, dim,
    HAS_PSW: tl.constexpr, MODE_MEAN: tl.constexpr, ACC_3D: tl.constexpr,
    EVICT_ROWS: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bags = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    bag_mask = bags < num_bags
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    starts = tl.load(offsets_ptr + bags, mask=bag_mask, other=0).to(tl.int64)
    lengths = tl.load(offsets_ptr + bags + 1, mask=bag_mask, other=0).to(tl.int64) - starts
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_B, BLOCK_L, BLOCK_D], dtype=tl.float32)
    for step in tl.range(0, tl.max(lengths, axis=0), BLOCK_L, num_stages=NUM_STAGES):
        j = step + tl.arange(0, BLOCK_L)
        pos = starts[:, None] + j[None, :]
        pos_mask = j[None, :] < lengths[:, None]
        rows = tl.load(indices_ptr + pos, mask=pos_mask, other=0).to(tl.int64)
        vals = tl.load(
            weight_ptr + rows[:, :, None] * stride_weight_row + cols[None, None, :],
            mask=pos_mask[:, :, None] & col_mask[None, None, :], other=0.0,
            eviction_policy=EVICT_ROWS,
        ).to(tl.float32)
        if HAS_PSW:
            vals = vals * tl.load(psw_ptr + pos, mask=pos_mask, other=0.0).to(tl.float32)[:, :, None]
        if ACC_3D:
            acc3 += vals
        else:
            acc += tl.sum(vals, axis=1)
    if ACC_3D:
        acc = tl.sum(acc3, axis=1)
    if MODE_MEAN:
        acc = acc / tl.maximum(lengths, 1).to(tl.float32)[:, None]
    tl.store(out_ptr + bags[:, None] * stride_out_row + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=bag_mask[:, None] & col_mask[None, :])


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    """weight [num_rows, D] (unit stride along D), indices [nnz], offsets [B + 1] -> [B, D]."""
    num_bags, dim = offsets.numel() - 1, weight.shape[1]
    out = torch.empty((num_bags, dim), dtype=weight.dtype, device=weight.device)
    if num_bags == 0 or dim == 0:
        return out
    has_psw = per_sample_weights is not None
    grid = (triton.cdiv(num_bags, KNOBS["BLOCK_B"]), triton.cdiv(dim, KNOBS["BLOCK_D"]))
    _embedding_bag_fwd_kernel[grid](
        weight, indices, offsets, per_sample_weights if has_psw else indices, out,
        weight.stride(0), out.stride(0),
        num_bags, dim,
        HAS_PSW=has_psw, MODE_MEAN=mode == "mean", ACC_3D=KNOBS["ACC_3D"],
        EVICT_ROWS=KNOBS["EVICT_ROWS"], NUM_STAGES=KNOBS["num_stages"],
        BLOCK_B=KNOBS["BLOCK_B"], BLOCK_L=KNOBS["BLOCK_L"], BLOCK_D=KNOBS["BLOCK_D"],
        num_warps=KNOBS["num_warps"],
    )
    return out
