"""The correct kernel the runtime exploits build on: BLOCK_B bags per program, BLOCK_L ids of
each gathered per step, fp32 accumulation.

The adversarial test prepends this to each case marked `# base: yes`. Interpreted, every
Triton op is a NumPy call whatever its tile, so the kernel takes a check shape's bags in one
program or a few, many ids a step (tiles of at most 8192 elements, which also compile for a
GPU): the corpus's dozens of evaluations cost a small CI machine minutes, not a quarter of an
hour."""

import torch
import triton
import triton.language as tl


@triton.jit
def _bag_kernel(
    weight_ptr,
    indices_ptr,
    offsets_ptr,
    psw_ptr,
    out_ptr,
    num_bags,
    dim,
    HAS_PSW: tl.constexpr,
    MEAN: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    bags = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    live_b = bags < num_bags
    cols = tl.arange(0, BLOCK_D)
    start = tl.load(offsets_ptr + bags, mask=live_b, other=0).to(tl.int64)
    length = tl.load(offsets_ptr + bags + 1, mask=live_b, other=0).to(tl.int64) - start
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    for step in range(0, tl.max(length, axis=0), BLOCK_L):
        j = step + tl.arange(0, BLOCK_L)
        live = j[None, :] < length[:, None]
        pos = start[:, None] + j[None, :]
        rows = tl.load(indices_ptr + pos, mask=live, other=0).to(tl.int64)
        mask = live[:, :, None] & (cols[None, None, :] < dim)
        val = tl.load(weight_ptr + rows[:, :, None] * dim + cols[None, None, :], mask=mask, other=0.0)
        val = val.to(tl.float32)
        if HAS_PSW:
            val = val * tl.load(psw_ptr + pos, mask=live, other=0.0).to(tl.float32)[:, :, None]
        acc += tl.sum(val, axis=1)
    if MEAN:
        acc = acc / tl.maximum(length, 1).to(tl.float32)[:, None]
    mask = live_b[:, None] & (cols[None, :] < dim)
    tl.store(out_ptr + bags[:, None] * dim + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(weight, indices, offsets, out, mode, per_sample_weights):
    num_bags = out.shape[0]
    if num_bags > 0:
        psw = per_sample_weights if per_sample_weights is not None else weight
        block_d = triton.next_power_of_2(max(weight.shape[1], 16))
        block_b = min(triton.next_power_of_2(num_bags), max(1, 8192 // block_d))
        _bag_kernel[(triton.cdiv(num_bags, block_b),)](
            weight,
            indices,
            offsets,
            psw,
            out,
            num_bags,
            weight.shape[1],
            HAS_PSW=per_sample_weights is not None,
            MEAN=mode == "mean",
            BLOCK_B=block_b,
            BLOCK_D=block_d,
            BLOCK_L=max(1, min(64, 8192 // (block_b * block_d))),
        )
    return out
