"""Control for the rt2_ target_attention cases: a compact, honest request-broadcast target
attention (one program per candidate and head, its seeds as the query rows, online softmax or
silu over the request's history; the log2-sum-exp on request, -inf for an empty history). Must
pass, or the rt2_ target cases prove nothing: each of them is this kernel with one defect."""
# problem: target_attention
# entry: target_attention
# expect: ok
# base: no

import torch
import triton
import triton.language as tl


@triton.jit
def _target_fwd(
    q_ptr, k_ptr, v_ptr, kv_off_ptr, c2r_ptr, out_ptr, lse_ptr,
    S, H, D, DV, ROWS, qk_scale,
    SOFTMAX: tl.constexpr, STORE_LSE: tl.constexpr, VIA_FP32: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    r = tl.load(c2r_ptr + c).to(tl.int64)
    start = tl.load(kv_off_ptr + r).to(tl.int64)
    n = (tl.load(kv_off_ptr + r + 1).to(tl.int64) - start).to(tl.int32)
    seeds = tl.arange(0, BLOCK_S)
    dq = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    seed_ok = seeds < S
    q = tl.load(
        q_ptr + ((c * S + seeds) * H + h)[:, None] * D + dq[None, :],
        mask=seed_ok[:, None] & (dq[None, :] < D), other=0.0,
    )
    if VIA_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_S], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_DV], tl.float32)
    for j0 in range(0, n, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        k = tl.load(
            k_ptr + ((start + cols) * H + h)[:, None] * D + dq[None, :],
            mask=col_ok[:, None] & (dq[None, :] < D), other=0.0,
        )
        vv = tl.load(
            v_ptr + ((start + cols) * H + h)[:, None] * DV + dv[None, :],
            mask=col_ok[:, None] & (dv[None, :] < DV), other=0.0,
        )
        if VIA_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        allowed = col_ok[None, :] & seed_ok[:, None]
        if SOFTMAX:
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            acc = acc * alpha[:, None]
        else:
            p = tl.where(allowed, s * tl.sigmoid(s), 0.0)
        if VIA_FP32:
            acc = tl.dot(p.to(vv.dtype).to(tl.float32), vv.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(vv.dtype), vv, acc)
    if SOFTMAX:
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if STORE_LSE:
            lse = tl.where(l_i > 0, (m_i + tl.log(tl.where(l_i > 0, l_i, 1.0))) * 1.4426950408889634,
                           float("-inf"))
            tl.store(lse_ptr + h * ROWS + c * S + seeds, lse, mask=seed_ok)
    tl.store(
        out_ptr + ((c * S + seeds) * H + h)[:, None] * DV + dv[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=seed_ok[:, None] & (dv[None, :] < DV),
    )


def _forward(q_cand, k, v, kv_offsets, cand_to_request, activation, scale, want_lse):
    num_cand, seeds, heads, dim = q_cand.shape
    dim_v = v.shape[2]
    softmax = activation == "softmax"
    out = torch.empty((num_cand, seeds, heads, dim_v), dtype=q_cand.dtype, device=q_cand.device)
    if want_lse and softmax:
        lse = torch.empty((heads, num_cand * seeds), dtype=torch.float32, device=q_cand.device)
    else:
        lse = torch.empty((0,), dtype=torch.float32, device=q_cand.device)
    if num_cand == 0 or seeds == 0:
        return out, lse
    q_cand, k, v = q_cand.contiguous(), k.contiguous(), v.contiguous()
    _target_fwd[(num_cand, heads)](
        q_cand, k, v, kv_offsets, cand_to_request, out, lse if lse.numel() else out,
        seeds, heads, dim, dim_v, num_cand * seeds, scale,
        SOFTMAX=softmax, STORE_LSE=lse.numel() > 0,
        VIA_FP32=q_cand.device.type != "cuda" or q_cand.dtype == torch.float32,
        BLOCK_S=max(16, triton.next_power_of_2(seeds)), BLOCK_N=32 if q_cand.is_cuda else 128,
        BLOCK_D=triton.next_power_of_2(max(dim, 16)), BLOCK_DV=triton.next_power_of_2(max(dim_v, 16)),
    )
    return out, lse


def target_attention(
    q_cand, k, v, kv_offsets, cand_to_request, *, activation="softmax", scale=None,
    max_candidates=None, max_history=None, return_lse=False,
):
    scale = q_cand.shape[-1] ** -0.5 if scale is None else scale
    out, lse = _forward(q_cand, k, v, kv_offsets, cand_to_request, activation, scale, return_lse)
    return (out, lse) if return_lse else out
