"""The default kernel of wukong_fm (search_space/wukong_fm.py declares the op): one program per
candidate holds its n embeddings (the user's, read from its request, then its own) and the
projection, and forms X (X^T Y) a slice of the embedding dim at a time: each slice's share of
X^T Y is [BLOCK_D, k], and X times it adds that slice's share of the output, so X is read once
and X^T Y never leaves the program. Products accumulate in fp32 through the kit's tile
multiply-accumulate (kernels.kit.tiles); X^T Y is kept in fp32 for the second product (TF32
products on a GPU where X is bf16, full fp32 where it is fp32). A candidate like any other,
importing nothing of the library but the kit: its KNOBS dict is the op's knob template.
"""

import torch
import triton
import triton.language as tl

from kernels.kit.tiles import mma, mma_precision

KNOBS = {"BLOCK_D": 64, "num_warps": 4}


@triton.jit
def _wukong_fm_kernel(
    x_ptr, user_ptr, c2r_ptr, proj_ptr, out_ptr,
    N_USER, N_CAND, D, K,
    stride_xb, stride_xn, stride_ur, stride_un, stride_pn, stride_ob, stride_on,
    HAS_USER: tl.constexpr, PRECISION: tl.constexpr, SECOND: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    total = N_USER + N_CAND
    y = tl.load(
        proj_ptr + n[:, None] * stride_pn + ks[None, :],
        mask=(n[:, None] < total) & (ks[None, :] < K),
        other=0.0,
    )
    is_user = n < N_USER
    is_cand = (n >= N_USER) & (n < total)
    cand_rows = x_ptr + b * stride_xb + (n - N_USER)[:, None] * stride_xn
    if HAS_USER:
        request = tl.load(c2r_ptr + b).to(tl.int64)
        user_rows = user_ptr + request * stride_ur + n[:, None] * stride_un
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        d_ok = ds[None, :] < D
        x = tl.load(cand_rows + ds[None, :], mask=is_cand[:, None] & d_ok, other=0.0)
        if HAS_USER:
            x += tl.load(user_rows + ds[None, :], mask=is_user[:, None] & d_ok, other=0.0)
        share = mma(tl.trans(x), y, tl.zeros([BLOCK_D, BLOCK_K], dtype=tl.float32), PRECISION)
        # X^T proj stays fp32: the second product takes X in fp32 too (TF32 on a GPU).
        acc = mma(x.to(tl.float32), share, acc, SECOND)
    out = out_ptr + b * stride_ob + n[:, None] * stride_on + ks[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(n[:, None] < total) & (ks[None, :] < K))


def wukong_fm(x, proj, x_user=None, cand_to_request=None):
    """x [B, n_c, d] (the candidates' embeddings), proj [n, k], x_user [R, n_u, d] or None and
    cand_to_request [B] -> [B, n, k], n = n_u + n_c: X (X^T proj) per candidate, X its
    request's user embeddings then its own."""
    batch, n_cand, dim = x.shape
    n_user = 0 if x_user is None else x_user.shape[1]
    k = proj.shape[1]
    x = x.contiguous() if x.stride(2) != 1 else x
    out = torch.empty((batch, n_user + n_cand, k), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    has_user = x_user is not None
    user = x_user if has_user and x_user.stride(2) == 1 else (x_user.contiguous() if has_user else x)
    proj = proj.contiguous()
    _wukong_fm_kernel[(batch,)](
        x, user, cand_to_request if has_user else x, proj, out,
        n_user, n_cand, dim, k,
        x.stride(0), x.stride(1), user.stride(0) if has_user else 0, user.stride(1) if has_user else 0,
        proj.stride(0), out.stride(0), out.stride(1),
        HAS_USER=has_user, PRECISION=mma_precision(x),
        SECOND="tf32" if x.device.type == "cuda" and x.dtype != torch.float32 else "ieee",
        BLOCK_N=max(16, triton.next_power_of_2(n_user + n_cand)),
        BLOCK_D=KNOBS["BLOCK_D"], BLOCK_K=max(16, triton.next_power_of_2(k)),
        num_warps=KNOBS["num_warps"],
    )  # fmt: skip
    return out
