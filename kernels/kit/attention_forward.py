"""The attention families' forward kernel and its launch: one kernel serves jagged attention, GDPA
and target attention (kernels/kit/attention.py describes the algorithm and holds the helpers,
checks and public launchers it builds on). A candidate for jagged_attention, gdpa or
target_attention is this file with the problem's entry appended, which hands `launch_forward`
to the kit's launcher of its op."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kit.attention import (
    _activation,
    _allowed,
    _bias_args,
    _check_row_offsets,
    _dense,
    _dot,
    _dot_precision,
    _fp32_bias,
    _key_ranges,
    _kv_descriptors,
    _load_rows,
    _row_ptrs,
    _score_scales,
    _sequence,
    _tile_bias,
    _unit_last,
    _work_item,
)

# The forward's last key tile of a sequence (without targets): either a masked loop of its own
# after the pipelined one (reading past the sequence, masking and zeroing what it read, and the
# causal diagonal), or shifted back to end at the last key inside the pipelined loop
# (SHIFT_LAST; a uniform branch masks, in the last tiles only, the keys the tile before did and
# the causal mask). On an H200 (BENCHMARKS.md) the shifted tile saved 1.5 to 1.9 µs of each
# program's fixed cost and added up to 0.06 µs to each tile with TMA loads: 1.03x to 1.04x at target
# histories up to 2000 keys and 1.11x for causal N 1024, 0.96x to 0.98x at a 16k history and
# 0.99x for causal power-law N 8192; with pointer loads (pointwise activations) 0.53x. So by
# default only with TMA, and at most this many keys in a program's span (a causal block sees
# half its sequence's keys on average). None: the default; True or False forces.
SHIFT_LAST_MAX_KEYS = 2048

# --- forward ----------------------------------------------------------------------------------


@triton.jit
def _fresh(pos_q, pos_k, tile_start, CAUSAL: tl.constexpr):
    """[M, N] keys of a shifted key tile that the tile before did not cover (those from
    tile_start on), and with CAUSAL only those at or before the query."""
    ok = pos_k >= tile_start
    if CAUSAL:
        ok = ok & (pos_k <= pos_q)
    return ok


@triton.jit
def _fwd_inner(
    acc_MD,
    m_M,
    l_M,
    q_MD,
    k_seq_ptr,
    v_seq_ptr,
    k_desc,
    v_desc,
    kv_row0,
    head_col,
    bias_head_ptr,
    stride_k_row,
    stride_v_row,
    m0,
    lo,
    hi,
    mask_from,
    n_q,
    n_k,
    n_hist,
    qk_scale,
    bias_scale,
    ACTIVATION: tl.constexpr,
    SILU: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SELF_ATTN: tl.constexpr,
    MASKED: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    LOG2_EXACT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    SHIFT_LAST: tl.constexpr,
):
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    for tile_start in tl.range(lo, hi, BLOCK_N):
        start_n = tile_start
        if SHIFT_LAST:
            # (n_k >= BLOCK_N, no targets) The last tile ends at the last key instead of reading
            # past it; its keys before tile_start, done by the tile before, are masked out below
            # with the causal mask, in the tiles from mask_from on. So neither the sequence's
            # ragged end nor the causal diagonal needs a masked loop after the pipelined one.
            start_n = tl.minimum(tile_start, n_k - BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if USE_TMA:
            # Tensor-memory-accelerator copies of [BLOCK_N, HEAD_DIM] boxes of the [rows, H * D]
            # views: no address arithmetic in registers. Rows past the sequence are the next
            # sequence's (zeros past the last row); their scores are masked below, and their
            # values zeroed, since p = 0 times a non-finite value would not be 0.
            k_ND = k_desc.load([kv_row0 + start_n, head_col])
            v_ND = v_desc.load([kv_row0 + start_n, head_col])
            if MASKED:
                v_ND = tl.where((offs_n < n_k)[:, None], v_ND, 0.0)
        elif MASKED:
            in_N = offs_n < n_k
            k_ND = tl.load(
                k_seq_ptr + offs_n[:, None] * stride_k_row + offs_d[None, :], mask=in_N[:, None], other=0.0
            )
            v_ND = tl.load(
                v_seq_ptr + offs_n[:, None] * stride_v_row + offs_d[None, :], mask=in_N[:, None], other=0.0
            )
        else:
            k_ND = tl.load(k_seq_ptr + offs_n[:, None] * stride_k_row + offs_d[None, :])
            v_ND = tl.load(v_seq_ptr + offs_n[:, None] * stride_v_row + offs_d[None, :])
        s_MN = _dot(q_MD, tl.trans(k_ND), None, DOT_PRECISION)
        if not FOLD_SCALE:
            s_MN = s_MN * qk_scale
        if HAS_BIAS:
            bias_MN = _tile_bias(
                bias_head_ptr,
                offs_m[:, None],
                offs_n[None, :],
                m0,
                start_n,
                NUM_BUCKETS,
                LOG2_EXACT,
                BLOCK_M,
                BLOCK_N,
            )
            s_MN += bias_MN * bias_scale
        if MASKED:
            allowed_MN = _allowed(
                offs_m[:, None], offs_n[None, :], n_q, n_k, n_hist, CAUSAL, HAS_TARGETS, SELF_ATTN
            )
        if ACTIVATION == "softmax":
            if MASKED:
                s_MN = tl.where(allowed_MN, s_MN, float("-inf"))
            if SHIFT_LAST:  # noqa: SIM102 (a compile-time test, then a branch in the kernel)
                if tile_start >= mask_from:  # the last tiles (a uniform branch)
                    fresh_MN = _fresh(offs_m[:, None], offs_n[None, :], tile_start, CAUSAL and SELF_ATTN)
                    s_MN = tl.where(fresh_MN, s_MN, float("-inf"))
            # With FOLD_SCALE (qk_scale > 0, no bias) s is still unscaled: the row max scales
            # after the reduction, and s where it is exponentiated, in one multiply-add.
            m_tile_M = tl.max(s_MN, axis=1)
            if FOLD_SCALE:
                m_tile_M = m_tile_M * qk_scale
            m_new_M = tl.maximum(m_M, m_tile_M)
            m_use_M = m_new_M
            if MASKED:
                # A row with nothing allowed yet keeps m = -inf; exponentiate against 0 instead
                # so that it adds exact zeros rather than NaN.
                m_use_M = tl.where(m_new_M == float("-inf"), 0.0, m_new_M)
            alpha_M = tl.exp2(m_M - m_use_M)
            acc_MD = acc_MD * alpha_M[:, None]
            l_M = l_M * alpha_M
            m_M = m_new_M
            if FOLD_SCALE:
                p_MN = tl.exp2(s_MN * qk_scale - m_use_M[:, None])
            else:
                p_MN = tl.exp2(s_MN - m_use_M[:, None])
            l_M += tl.sum(p_MN, axis=1)
        else:
            p_MN = _activation(s_MN, ACTIVATION, SILU)
            if MASKED:
                p_MN = tl.where(allowed_MN, p_MN, 0.0)
            if SHIFT_LAST:  # noqa: SIM102
                if tile_start >= mask_from:
                    fresh_MN = _fresh(offs_m[:, None], offs_n[None, :], tile_start, CAUSAL and SELF_ATTN)
                    p_MN = tl.where(fresh_MN, p_MN, 0.0)
        acc_MD = _dot(p_MN.to(v_ND.dtype), v_ND, acc_MD, DOT_PRECISION)
    return acc_MD, m_M, l_M


@triton.jit
def _attn_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_desc,
    v_desc,
    out_ptr,
    lse_ptr,
    q_offsets_ptr,
    kv_offsets_ptr,
    num_targets_ptr,
    rel_bias_ptr,
    row_map_ptr,
    stride_q_row,
    stride_q_head,
    stride_k_row,
    stride_k_head,
    stride_v_row,
    stride_v_head,
    stride_out_row,
    stride_out_head,
    stride_lse_head,
    stride_bias_head,
    num_heads,
    num_q_blocks,
    qk_scale,
    bias_scale,
    act_scale,
    ACTIVATION: tl.constexpr,
    SILU: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SELF_ATTN: tl.constexpr,
    BROADCAST_Q: tl.constexpr,
    ROW_MAP: tl.constexpr,
    ROWS_PER_INDEX: tl.constexpr,
    STORE_LSE: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    LOG2_EXACT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    SHIFT_LAST: tl.constexpr,
):
    seq, block, head = _work_item(num_heads, num_q_blocks, True)
    out_start, q_start, kv_start, n_q, n_k, n_hist = _sequence(
        q_offsets_ptr, kv_offsets_ptr, num_targets_ptr, seq, SELF_ATTN, HAS_TARGETS, BROADCAST_Q
    )
    m0 = block * BLOCK_M
    if m0 >= n_q:
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_M = offs_m < n_q
    q_MD = _load_rows(
        q_ptr + head * stride_q_head, q_start, offs_m, stride_q_row, offs_d, in_M, row_map_ptr,
        ROW_MAP, ROWS_PER_INDEX,
    )  # fmt: skip
    k_seq_ptr = k_ptr + kv_start * stride_k_row + head * stride_k_head
    v_seq_ptr = v_ptr + kv_start * stride_v_row + head * stride_v_head
    kv_row0 = kv_start.to(tl.int32)  # the TMA boxes' coordinates in the [rows, H * D] views
    head_col = (head * HEAD_DIM).to(tl.int32)
    bias_head_ptr = rel_bias_ptr + head * stride_bias_head

    acc_MD = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_M = tl.zeros([BLOCK_M], dtype=tl.float32)
    full_end, masked_end, diag_lo, diag_hi = _key_ranges(
        m0, n_k, n_hist, CAUSAL, HAS_TARGETS, SELF_ATTN, BLOCK_M, BLOCK_N
    )
    shifted = False
    if SHIFT_LAST:  # (no targets; the launcher sees to it)
        shifted = n_k >= BLOCK_N
    if shifted:
        # One pipelined loop over every key tile, the last one shifted back to end at the last
        # key, the tiles from full_end on (that one, and the causal diagonal) masked.
        acc_MD, m_M, l_M = _fwd_inner(
            acc_MD, m_M, l_M, q_MD, k_seq_ptr, v_seq_ptr, k_desc, v_desc, kv_row0, head_col,
            bias_head_ptr, stride_k_row, stride_v_row,
            m0, 0, masked_end, full_end, n_q, n_k, n_hist, qk_scale, bias_scale,
            ACTIVATION, SILU, CAUSAL, HAS_TARGETS, HAS_BIAS, SELF_ATTN, False,
            NUM_BUCKETS, LOG2_EXACT, HEAD_DIM, DOT_PRECISION, BLOCK_M, BLOCK_N, USE_TMA,
            FOLD_SCALE, True,
        )  # fmt: skip
    else:
        # The three ranges are the same loop, specialised: the unmasked one carries no mask.
        acc_MD, m_M, l_M = _fwd_inner(
            acc_MD, m_M, l_M, q_MD, k_seq_ptr, v_seq_ptr, k_desc, v_desc, kv_row0, head_col,
            bias_head_ptr, stride_k_row, stride_v_row,
            m0, 0, full_end, full_end, n_q, n_k, n_hist, qk_scale, bias_scale,
            ACTIVATION, SILU, CAUSAL, HAS_TARGETS, HAS_BIAS, SELF_ATTN, False,
            NUM_BUCKETS, LOG2_EXACT, HEAD_DIM, DOT_PRECISION, BLOCK_M, BLOCK_N, USE_TMA,
            FOLD_SCALE, False,
        )  # fmt: skip
        acc_MD, m_M, l_M = _fwd_inner(
            acc_MD, m_M, l_M, q_MD, k_seq_ptr, v_seq_ptr, k_desc, v_desc, kv_row0, head_col,
            bias_head_ptr, stride_k_row, stride_v_row,
            m0, full_end, masked_end, masked_end, n_q, n_k, n_hist, qk_scale, bias_scale,
            ACTIVATION, SILU, CAUSAL, HAS_TARGETS, HAS_BIAS, SELF_ATTN, True,
            NUM_BUCKETS, LOG2_EXACT, HEAD_DIM, DOT_PRECISION, BLOCK_M, BLOCK_N, USE_TMA,
            FOLD_SCALE, False,
        )  # fmt: skip
        if HAS_TARGETS:
            acc_MD, m_M, l_M = _fwd_inner(
                acc_MD, m_M, l_M, q_MD, k_seq_ptr, v_seq_ptr, k_desc, v_desc, kv_row0, head_col,
                bias_head_ptr, stride_k_row, stride_v_row,
                m0, diag_lo, diag_hi, diag_hi, n_q, n_k, n_hist, qk_scale, bias_scale,
                ACTIVATION, SILU, CAUSAL, HAS_TARGETS, HAS_BIAS, SELF_ATTN, True,
                NUM_BUCKETS, LOG2_EXACT, HEAD_DIM, DOT_PRECISION, BLOCK_M, BLOCK_N, USE_TMA,
                FOLD_SCALE, False,
            )  # fmt: skip

    if ACTIVATION == "softmax":
        # l = 0 only for a query with no keys at all (an empty history): its output is 0.
        acc_MD = acc_MD / tl.where(l_M > 0.0, l_M, 1.0)[:, None]
        if STORE_LSE:
            lse_M = m_M + tl.log2(tl.where(l_M > 0.0, l_M, 1.0))
            tl.store(lse_ptr + head * stride_lse_head + out_start + offs_m, lse_M, mask=in_M)
    else:
        acc_MD = acc_MD * act_scale
    out_ptrs = _row_ptrs(
        out_ptr + head * stride_out_head, out_start, offs_m, stride_out_row, offs_d, in_M, row_map_ptr,
        ROW_MAP, ROWS_PER_INDEX,
    )  # fmt: skip
    tl.store(out_ptrs, acc_MD.to(out_ptr.dtype.element_ty), mask=in_M[:, None])


def launch_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    *,
    num_out_rows: int,
    max_q_len: int,
    max_kv_len: int,
    activation: str,
    scale: float,
    act_scale: float,
    self_attn: bool,
    causal: bool,
    num_targets: torch.Tensor | None,
    rel_bias: torch.Tensor | None,
    broadcast_q: bool,
    return_lse: bool,
    config: dict,
    row_map: torch.Tensor | None = None,
    rows_per_index: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """With row_map, q's rows and out's are in the tensors' own order and the offsets count rows
    of a grouped order, mapped by row_map in groups of rows_per_index (see _row_ptrs); lse stays
    in the grouped order."""
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_seqs = q_offsets.numel() - 1
    out = torch.empty((num_out_rows, num_heads, head_dim), dtype=q.dtype, device=q.device)
    softmax = activation == "softmax"
    lse = None
    if softmax and return_lse:
        lse = torch.empty((num_heads, num_out_rows), dtype=torch.float32, device=q.device)
    if num_out_rows == 0 or num_seqs == 0 or max_q_len == 0 or max_kv_len == 0:
        # Nothing to attend to: zeros, as the reference gives (lse = log 0).
        return out.zero_(), lse.fill_(float("-inf")) if lse is not None else None
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    q_offsets, kv_offsets, num_targets = _dense(q_offsets), _dense(kv_offsets), _dense(num_targets)
    rel_bias = _fp32_bias(rel_bias)
    _check_row_offsets(max_q_len, max_kv_len, [q, out], [k, v])
    num_buckets, log2_exact = _bias_args(rel_bias)
    block_m = config["BLOCK_M"]
    num_q_blocks = triton.cdiv(max_q_len, block_m)
    num_items = num_seqs * num_q_blocks
    use_tma, k_desc, v_desc = _kv_descriptors(k, v, config)
    qk_scale, bias_scale = _score_scales(scale, activation, config)
    # Softmax scales s inside the exponent's multiply-add where it may (see _fwd_inner).
    fold_scale = softmax and rel_bias is None and qk_scale > 0
    shift_last = config["SHIFT_LAST"]
    if shift_last is None:
        span = max_kv_len // 2 if self_attn and causal else max_kv_len
        shift_last = use_tma and span <= SHIFT_LAST_MAX_KEYS
    # A shifted last key tile overlaps the one before it, its keys masked by position (and the
    # causal mask): not with targets, whose own diagonal is a range of its own.
    shift_last = shift_last and num_targets is None
    _attn_fwd_kernel[(num_items * num_heads,)](
        q, k, v, k_desc, v_desc, out, lse if lse is not None else out,
        q_offsets, kv_offsets, num_targets if num_targets is not None else q_offsets,
        rel_bias if rel_bias is not None else q, row_map if row_map is not None else q_offsets,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
        rel_bias.stride(0) if rel_bias is not None else 0,
        num_heads, num_q_blocks,
        qk_scale, bias_scale, act_scale,
        ACTIVATION=activation, CAUSAL=causal, HAS_TARGETS=num_targets is not None,
        HAS_BIAS=rel_bias is not None, SELF_ATTN=self_attn, BROADCAST_Q=broadcast_q,
        ROW_MAP=row_map is not None, ROWS_PER_INDEX=rows_per_index, STORE_LSE=lse is not None,
        NUM_BUCKETS=num_buckets, LOG2_EXACT=log2_exact, HEAD_DIM=head_dim,
        DOT_PRECISION=_dot_precision(q), FOLD_SCALE=fold_scale,
        **{**config, "USE_TMA": use_tma, "SHIFT_LAST": shift_last},
    )  # fmt: skip
    return out, lse
