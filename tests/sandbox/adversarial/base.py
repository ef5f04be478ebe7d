"""The correct kernel the runtime exploits build on: one bag per program, BLOCK_L ids gathered
per step, fp32 accumulation.

The adversarial test prepends this to each case marked `# base: yes`. Interpreted, every
Triton op is a NumPy call whatever its tile, so the kernel gathers many ids per step: the
corpus's dozens of evaluations cost a small CI machine minutes, not a quarter of an hour."""

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
    dim,
    HAS_PSW: tl.constexpr,
    MEAN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    bag = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    start = tl.load(offsets_ptr + bag).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1).to(tl.int64)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first in range(start, end, BLOCK_L):
        pos = first + tl.arange(0, BLOCK_L)
        live = pos < end
        rows = tl.load(indices_ptr + pos, mask=live, other=0).to(tl.int64)
        mask = live[:, None] & (cols[None, :] < dim)
        val = tl.load(weight_ptr + rows[:, None] * dim + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_PSW:
            val = val * tl.load(psw_ptr + pos, mask=live, other=0.0).to(tl.float32)[:, None]
        acc += tl.sum(val, axis=0)
    if MEAN:
        acc = acc / tl.maximum(end - start, 1).to(tl.float32)
    tl.store(out_ptr + bag * dim + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < dim)


def _launch(weight, indices, offsets, out, mode, per_sample_weights):
    if out.shape[0] > 0:
        psw = per_sample_weights if per_sample_weights is not None else weight
        block_d = triton.next_power_of_2(max(weight.shape[1], 16))
        _bag_kernel[(out.shape[0],)](
            weight,
            indices,
            offsets,
            psw,
            out,
            weight.shape[1],
            HAS_PSW=per_sample_weights is not None,
            MEAN=mode == "mean",
            BLOCK_D=block_d,
            BLOCK_L=max(1, min(64, 8192 // block_d)),
        )
    return out
