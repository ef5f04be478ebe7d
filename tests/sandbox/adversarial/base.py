"""The correct kernel the runtime exploits build on: one bag per program, fp32 accumulation.

The adversarial test prepends this to each case marked `# base: yes`."""

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
):
    bag = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    start = tl.load(offsets_ptr + bag)
    end = tl.load(offsets_ptr + bag + 1)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(start, end):
        row = tl.load(indices_ptr + i)
        val = tl.load(weight_ptr + row * dim + cols, mask=cols < dim, other=0.0).to(tl.float32)
        if HAS_PSW:
            val = val * tl.load(psw_ptr + i).to(tl.float32)
        acc += val
    if MEAN:
        acc = acc / tl.maximum(end - start, 1).to(tl.float32)
    tl.store(out_ptr + bag * dim + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < dim)


def _launch(weight, indices, offsets, out, mode, per_sample_weights):
    if out.shape[0] > 0:
        psw = per_sample_weights if per_sample_weights is not None else weight
        _bag_kernel[(out.shape[0],)](
            weight,
            indices,
            offsets,
            psw,
            out,
            weight.shape[1],
            HAS_PSW=per_sample_weights is not None,
            MEAN=mode == "mean",
            BLOCK_D=triton.next_power_of_2(max(weight.shape[1], 16)),
        )
    return out
