"""Control for the rt2_ jagged_attention cases: a compact, honest jagged attention forward (one
program per sequence, head and query block; online softmax or silu; causal, targets, relative
bias; the log2-sum-exp on request). Must pass, or the rt2_ jagged cases prove nothing: each of
them is this kernel with one defect."""
# problem: jagged_attention
# entry: jagged_attention
# expect: ok
# base: no

import torch
import triton
import triton.language as tl


@triton.jit
def _bucket(dist, NUM_BUCKETS: tl.constexpr, LOG2_EXACT: tl.constexpr):
    bits = dist.to(tl.float32).to(tl.int32, bitcast=True)
    octave = (bits >> 23) - 127
    upper = (bits >> 22) & 1
    far = NUM_BUCKETS // 2 + 2 * (octave - LOG2_EXACT) + upper
    return tl.where(dist < NUM_BUCKETS // 2, dist, tl.minimum(far, NUM_BUCKETS - 1))


@triton.jit
def _jagged_fwd(
    q_ptr, k_ptr, v_ptr, off_ptr, tgt_ptr, bias_ptr, out_ptr, lse_ptr,
    H, D, DV, T, inv_max_len, qk_scale, lse_scale,
    SOFTMAX: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_BIAS: tl.constexpr, NUM_BUCKETS: tl.constexpr, LOG2_EXACT: tl.constexpr,
    STORE_LSE: tl.constexpr, VIA_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    start = tl.load(off_ptr + b).to(tl.int64)
    n = (tl.load(off_ptr + b + 1).to(tl.int64) - start).to(tl.int32)
    if m0 >= n:
        return
    n_hist = n
    if HAS_TARGETS:
        n_hist = n - tl.minimum(tl.load(tgt_ptr + b).to(tl.int32), n)
    rows = m0 + tl.arange(0, BLOCK_M)
    dq = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    row_ok = rows < n
    q = tl.load(
        q_ptr + ((start + rows) * H + h)[:, None] * D + dq[None, :],
        mask=row_ok[:, None] & (dq[None, :] < D), other=0.0,
    )
    if VIA_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_lse = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_lse = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
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
        dots = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = dots * qk_scale
        s_lse = dots * lse_scale  # the statistic's scores: the same as s in an honest kernel
        if HAS_BIAS:
            dist = tl.abs(rows[:, None] - cols[None, :])
            bias = tl.load(bias_ptr + h * NUM_BUCKETS + _bucket(dist, NUM_BUCKETS, LOG2_EXACT)).to(tl.float32)
            s = s + bias
            s_lse = s_lse + bias
        hist = cols[None, :] < n_hist
        if CAUSAL:
            hist = hist & ((cols[None, :] <= rows[:, None]) | (rows[:, None] >= n_hist))
        allowed = (hist | (cols[None, :] == rows[:, None])) & col_ok[None, :] & row_ok[:, None]
        if SOFTMAX:
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            if STORE_LSE:
                s_lse = tl.where(allowed, s_lse, float("-inf"))
                m_new2 = tl.maximum(m_lse, tl.max(s_lse, 1))
                l_lse = l_lse * tl.exp(m_lse - m_new2) + tl.sum(tl.exp(s_lse - m_new2[:, None]), 1)
                m_lse = m_new2
            acc = acc * alpha[:, None]
        else:
            p = s * tl.sigmoid(s) * inv_max_len
            p = tl.where(allowed, p, 0.0)
        if VIA_FP32:
            acc = tl.dot(p.to(vv.dtype).to(tl.float32), vv.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(vv.dtype), vv, acc)
    if SOFTMAX:
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if STORE_LSE:
            lse = (m_lse + tl.log(l_lse)) * 1.4426950408889634
            tl.store(lse_ptr + h * T + start + rows, lse, mask=row_ok)
    tl.store(
        out_ptr + ((start + rows) * H + h)[:, None] * DV + dv[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (dv[None, :] < DV),
    )


def _forward(q, k, v, offsets, max_seq_len, activation, causal, num_targets, rel_bias, scale, lse_scale, want_lse):
    total, heads, dim = q.shape
    dim_v = v.shape[2]
    num_seqs = offsets.numel() - 1
    softmax = activation == "softmax"
    out = torch.empty((total, heads, dim_v), dtype=q.dtype, device=q.device)
    if want_lse and softmax:
        lse = torch.empty((heads, total), dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty((0,), dtype=torch.float32, device=q.device)
    if total == 0 or num_seqs == 0:
        return out, lse
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    num_buckets = rel_bias.shape[1] if rel_bias is not None else 2
    # Compiled, tiles that fit a GPU's shared memory at D = 128; interpreted (every op of every
    # program a NumPy call), wide ones.
    block_m, block_n = (16, 32) if q.is_cuda else (64, 128)
    grid = (num_seqs, heads, triton.cdiv(max_seq_len, block_m))
    _jagged_fwd[grid](
        q, k, v, offsets,
        num_targets if num_targets is not None else offsets,
        rel_bias.contiguous() if rel_bias is not None else q,
        out, lse if lse.numel() else out,
        heads, dim, dim_v, total, 1.0 / max_seq_len, scale, lse_scale,
        SOFTMAX=softmax, CAUSAL=causal, HAS_TARGETS=num_targets is not None,
        HAS_BIAS=rel_bias is not None, NUM_BUCKETS=num_buckets,
        LOG2_EXACT=(num_buckets // 2).bit_length() - 1,
        STORE_LSE=lse.numel() > 0, VIA_FP32=q.device.type != "cuda" or q.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(max(dim, 16)),
        BLOCK_DV=triton.next_power_of_2(max(dim_v, 16)),
    )
    return out, lse


def jagged_attention(
    q, k, v, offsets, *, max_seq_len, activation="softmax", causal=True, num_targets=None,
    rel_bias=None, scale=None, return_lse=False,
):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = _forward(
        q, k, v, offsets, max_seq_len, activation, causal, num_targets, rel_bias, scale, scale, return_lse
    )
    return (out, lse) if return_lse else out
