"""The default kernel of grouped_gemm_weight_grad (search_space/grouped_gemm_weight_grad.py):
each group's weight gradient, its rows of x transposed times its rows of grad_out, in one
launch of (group, K block, M block) programs that each walk their group's rows in fp32 (the
kit's tile multiply-accumulate). A group without rows gets zeros. A candidate like any other, importing
nothing of the library but the kit (its KNOBS dict is the op's knob template)."""

import torch
import triton
import triton.language as tl

from kernels.kit.tiles import mma, mma_precision

KNOBS = {"BLOCK_R": 32, "BLOCK_K": 64, "BLOCK_M": 64, "num_warps": 4, "num_stages": 3}


@triton.jit
def _weight_grad_kernel(
    x_ptr, dy_ptr, offsets_ptr, dw_ptr,
    K, M,
    stride_xn, stride_xk, stride_dn, stride_dm, stride_wg, stride_wk,
    PRECISION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ms = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    start = tl.load(offsets_ptr + group).to(tl.int64)
    end = tl.load(offsets_ptr + group + 1).to(tl.int64)
    acc = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)
    for first in range(start, end, BLOCK_R):
        rows = first + tl.arange(0, BLOCK_R)
        ok = rows < end
        a = tl.load(x_ptr + rows[:, None] * stride_xn + ks[None, :] * stride_xk,
                    mask=ok[:, None] & (ks[None, :] < K), other=0.0)  # fmt: skip
        d = tl.load(dy_ptr + rows[:, None] * stride_dn + ms[None, :] * stride_dm,
                    mask=ok[:, None] & (ms[None, :] < M), other=0.0)  # fmt: skip
        acc = mma(tl.trans(a), d, acc, PRECISION)
    out = dw_ptr + group * stride_wg + ks[:, None] * stride_wk + ms[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=(ks[:, None] < K) & (ms[None, :] < M))


def grouped_gemm_weight_grad(x, grad_out, group_offsets):
    """x [N, K] and grad_out [N, M] (rows sorted by group), group_offsets [G + 1] -> [G, K, M]:
    per group, its rows of x transposed times its rows of grad_out."""
    depth, width = x.shape[1], grad_out.shape[1]
    groups = group_offsets.shape[0] - 1
    out = torch.empty((groups, depth, width), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    grid = (groups, triton.cdiv(depth, KNOBS["BLOCK_K"]), triton.cdiv(width, KNOBS["BLOCK_M"]))
    _weight_grad_kernel[grid](
        x, grad_out, group_offsets, out,
        depth, width,
        x.stride(0), x.stride(1), grad_out.stride(0), grad_out.stride(1), out.stride(0), out.stride(1),
        PRECISION=mma_precision(x),
        BLOCK_R=KNOBS["BLOCK_R"], BLOCK_K=KNOBS["BLOCK_K"], BLOCK_M=KNOBS["BLOCK_M"],
        num_warps=KNOBS["num_warps"], num_stages=KNOBS["num_stages"],
    )  # fmt: skip
    return out
