"""The default kernel of grouped_gemm (search_space/grouped_gemm.py declares the op): rows sorted
by group, each group's rows times its own matrix, in one launch.

Programs are laid out as (row tile, column block). A group of n rows takes cdiv(n, BLOCK_R) row
tiles, so the launch holds at most cdiv(N, BLOCK_R) + G of them, whatever the split; each
program finds its group by walking the group offsets (G is tens), so the host reads nothing
back from the device and the call is capturable. Products accumulate in fp32 through the kit's
tile product (kernels.kit.tiles: tensor cores for bf16, full fp32 for fp32). A candidate like
any other, importing nothing of the library but the kit: it is also the op's knob template (its
KNOBS dict).
"""

import torch
import triton
import triton.language as tl

from kernels.kit.tiles import mma, mma_precision

KNOBS = {"BLOCK_R": 64, "BLOCK_M": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, offsets_ptr, w_ptr, b_ptr, out_ptr,
    K, M, G,
    stride_xn, stride_xk, stride_wg, stride_wk, stride_wm, stride_bg, stride_on,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    # This program's group and its first tile: the group whose tiles cover `tile`.
    group = -1
    group_first = tl.zeros([], dtype=tl.int64)  # int64 from the start: loop-carried values keep their type
    tiles_before = tl.zeros([], dtype=tl.int64)
    start = tl.load(offsets_ptr).to(tl.int64)
    for g in range(0, G):
        end = tl.load(offsets_ptr + g + 1).to(tl.int64)
        tiles = tl.cdiv(end - start, BLOCK_R)
        hit = (tile >= tiles_before) & (tile < tiles_before + tiles)
        group = tl.where(hit, g, group)
        group_first = tl.where(hit, tiles_before, group_first)
        tiles_before += tiles
        start = end
    if group >= 0:
        row_start = tl.load(offsets_ptr + group).to(tl.int64)
        row_end = tl.load(offsets_ptr + group + 1).to(tl.int64)
        rows = row_start + (tile - group_first) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < row_end
        w_group = w_ptr + group.to(tl.int64) * stride_wg
        acc = tl.zeros([BLOCK_R, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                x_ptr + rows[:, None] * stride_xn + ks[None, :] * stride_xk,
                mask=row_ok[:, None] & (ks[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                w_group + ks[:, None] * stride_wk + cols[None, :] * stride_wm,
                mask=(ks[:, None] < K) & (cols[None, :] < M),
                other=0.0,
            )
            acc = mma(a, b, acc, PRECISION)
        if HAS_BIAS:
            bias = tl.load(b_ptr + group.to(tl.int64) * stride_bg + cols, mask=cols < M, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        out = out_ptr + rows[:, None] * stride_on + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < M))


def grouped_gemm(x, group_offsets, weight, bias=None):
    """x [N, K] (rows sorted by group), group_offsets [G + 1] (group g's rows are
    group_offsets[g]:group_offsets[g + 1]), weight [G, K, M], bias [G, M] or None -> [N, M]:
    each row times its group's matrix, plus its group's bias."""
    rows, depth = x.shape
    groups, _, width = weight.shape
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows == 0 or width == 0:
        return out
    grid = (triton.cdiv(rows, KNOBS["BLOCK_R"]) + groups, triton.cdiv(width, KNOBS["BLOCK_M"]))
    has_bias = bias is not None
    _grouped_gemm_kernel[grid](
        x, group_offsets, weight, bias if has_bias else weight, out,
        depth, width, groups,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
        bias.stride(0) if has_bias else 0, out.stride(0),
        HAS_BIAS=has_bias, PRECISION=mma_precision(x),
        BLOCK_R=KNOBS["BLOCK_R"], BLOCK_M=KNOBS["BLOCK_M"], BLOCK_K=KNOBS["BLOCK_K"],
        num_warps=KNOBS["num_warps"], num_stages=KNOBS["num_stages"],
    )  # fmt: skip
    return out
