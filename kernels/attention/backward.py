"""The attention families' backward kernels and their launch: the softmax row terms, the dK/dV
kernel and the dQ kernel serve jagged attention, GDPA and target attention (kernels/kit/attention.py
describes the algorithm and holds the helpers, checks and public launchers they build on). A
candidate for a gradient problem is this file with the problem's entry appended, which hands
`launch_backward` to the kit's launcher of its op."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kit.attention import (
    _activation_and_grad,
    _activation_grad,
    _allowed,
    _bias_args,
    _bias_split,
    _bucket_sums,
    _check_row_offsets,
    _dense,
    _dot,
    _dot_precision,
    _fp32_bias,
    _key_ranges,
    _load_rows,
    _query_ranges,
    _row_ptrs,
    _score_scales,
    _sequence,
    _tile_bias,
    _unit_last,
    _work_item,
)

# --- backward ---------------------------------------------------------------------------------


@triton.jit
def _attn_bwd_delta_kernel(
    out_ptr,
    do_ptr,
    delta_ptr,
    row_map_ptr,
    stride_out_row,
    stride_out_head,
    stride_do_row,
    stride_do_head,
    stride_delta_head,
    num_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROW_MAP: tl.constexpr,
    ROWS_PER_INDEX: tl.constexpr,
):
    # delta_i = dO_i . out_i = sum_j p_ij dp_ij: the softmax backward's row term, once per row
    # instead of once per key tile. Rows are in the grouped order of lse (see _row_ptrs).
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_M = row0 + offs_m < num_rows
    o_MD = _load_rows(
        out_ptr + head * stride_out_head, row0, offs_m, stride_out_row, offs_d, in_M, row_map_ptr,
        ROW_MAP, ROWS_PER_INDEX,
    )  # fmt: skip
    do_MD = _load_rows(
        do_ptr + head * stride_do_head, row0, offs_m, stride_do_row, offs_d, in_M, row_map_ptr,
        ROW_MAP, ROWS_PER_INDEX,
    )  # fmt: skip
    delta_M = tl.sum(o_MD.to(tl.float32) * do_MD.to(tl.float32), axis=1)
    tl.store(delta_ptr + head * stride_delta_head + row0 + offs_m, delta_M, mask=in_M)


@triton.jit
def _bwd_dkdv_inner(
    dk_ND,
    dv_ND,
    dbias_B,
    k_ND,
    v_ND,
    q_head_ptr,
    do_head_ptr,
    lse_seq_ptr,
    delta_seq_ptr,
    bias_head_ptr,
    row_map_ptr,
    q_start,
    out_start,
    stride_q_row,
    stride_do_row,
    n0,
    lo,
    hi,
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
    ROW_MAP: tl.constexpr,
    ROWS_PER_INDEX: tl.constexpr,
):
    # Tiles are [keys, queries] (the transpose of the forward's) so that dk and dv accumulate
    # as (BLOCK_N x BLOCK_M) @ (BLOCK_M x HEAD_DIM) products without transposing p or ds.
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_N = offs_n < n_k
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        in_M = offs_m < n_q
        # Rows past the sequence load as zeros (dO = 0, delta = 0, lse = +inf), which makes
        # both their p and their ds exactly 0: no pair mask needed for them.
        q_MD = _load_rows(
            q_head_ptr, q_start, offs_m, stride_q_row, offs_d, in_M, row_map_ptr, ROW_MAP, ROWS_PER_INDEX
        )
        do_MD = _load_rows(
            do_head_ptr, out_start, offs_m, stride_do_row, offs_d, in_M, row_map_ptr, ROW_MAP, ROWS_PER_INDEX
        )
        s_NM = _dot(k_ND, tl.trans(q_MD), None, DOT_PRECISION) * qk_scale
        if HAS_BIAS:
            bias_NM = _tile_bias(
                bias_head_ptr,
                offs_m[None, :],
                offs_n[:, None],
                start_m,
                n0,
                NUM_BUCKETS,
                LOG2_EXACT,
                BLOCK_M,
                BLOCK_N,
            )
            s_NM += bias_NM * bias_scale
        dp_NM = _dot(v_ND, tl.trans(do_MD), None, DOT_PRECISION)
        if ACTIVATION == "softmax":
            lse_M = tl.load(lse_seq_ptr + offs_m, mask=in_M, other=float("inf"))
            delta_M = tl.load(delta_seq_ptr + offs_m, mask=in_M, other=0.0)
            p_NM = tl.exp2(s_NM - lse_M[None, :])
            ds_NM = p_NM * (dp_NM - delta_M[None, :])
        else:
            p_NM, grad_NM = _activation_and_grad(s_NM, ACTIVATION, SILU)
            ds_NM = dp_NM * grad_NM
        if MASKED:
            allowed_NM = _allowed(
                offs_m[None, :], offs_n[:, None], n_q, n_k, n_hist, CAUSAL, HAS_TARGETS, SELF_ATTN
            )
            # where, not a product: p of a masked pair may overflow to inf.
            p_NM = tl.where(allowed_NM, p_NM, 0.0)
            ds_NM = tl.where(allowed_NM, ds_NM, 0.0)
        elif HAS_BIAS:
            # Padded keys of the sequence's last block: their dk/dv rows are never stored, but
            # their ds would land in the bias sums.
            ds_NM = tl.where(in_N[:, None], ds_NM, 0.0)
        dv_ND = _dot(p_NM.to(do_MD.dtype), do_MD, dv_ND, DOT_PRECISION)
        dk_ND = _dot(ds_NM.to(q_MD.dtype), q_MD, dk_ND, DOT_PRECISION)
        if HAS_BIAS:
            two, sign, split, b_near, b_far = _bias_split(
                start_m, n0, NUM_BUCKETS, LOG2_EXACT, BLOCK_M, BLOCK_N
            )
            if two:
                # Two buckets at most: the far one's sum and the rest, no skew.
                far_sum = tl.sum(
                    tl.sum(tl.where((offs_m[None, :] - offs_n[:, None]) * sign >= split, ds_NM, 0.0), 1), 0
                )
                near_sum = tl.sum(tl.sum(ds_NM, 1), 0) - far_sum
                buckets_B = tl.arange(0, NUM_BUCKETS)
                dbias_B += tl.where(buckets_B == b_far, far_sum, 0.0) + tl.where(
                    buckets_B == b_near, near_sum, 0.0
                )
            else:
                dbias_B += _bucket_sums(ds_NM, start_m - n0, NUM_BUCKETS, LOG2_EXACT, BLOCK_M, BLOCK_N)
    return dk_ND, dv_ND, dbias_B


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    dbias_ptr,
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
    stride_do_row,
    stride_do_head,
    stride_dk_row,
    stride_dk_head,
    stride_dv_row,
    stride_dv_head,
    stride_lse_head,
    stride_bias_head,
    stride_dbias_head,
    num_heads,
    num_k_blocks,
    qk_scale,
    bias_scale,
    scale,
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
    NUM_BUCKETS: tl.constexpr,
    LOG2_EXACT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq, block, head = _work_item(num_heads, num_k_blocks, False)
    item = tl.program_id(0) // num_heads
    n0 = block * BLOCK_N
    out_start, q_start, kv_start, n_q, n_k, n_hist = _sequence(
        q_offsets_ptr, kv_offsets_ptr, num_targets_ptr, seq, SELF_ATTN, HAS_TARGETS, BROADCAST_Q
    )
    if n0 >= n_k:
        return

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_N = offs_n < n_k
    k_seq_ptr = k_ptr + kv_start * stride_k_row + head * stride_k_head
    v_seq_ptr = v_ptr + kv_start * stride_v_row + head * stride_v_head
    k_ND = tl.load(
        k_seq_ptr + offs_n[:, None] * stride_k_row + offs_d[None, :], mask=in_N[:, None], other=0.0
    )
    v_ND = tl.load(
        v_seq_ptr + offs_n[:, None] * stride_v_row + offs_d[None, :], mask=in_N[:, None], other=0.0
    )
    q_head_ptr = q_ptr + head * stride_q_head
    do_head_ptr = do_ptr + head * stride_do_head
    lse_seq_ptr = lse_ptr + head * stride_lse_head + out_start
    delta_seq_ptr = delta_ptr + head * stride_lse_head + out_start
    bias_head_ptr = rel_bias_ptr + head * stride_bias_head

    dk_ND = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv_ND = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dbias_B = tl.zeros([NUM_BUCKETS], dtype=tl.float32)
    lo, mid, hi = _query_ranges(n0, n_q, n_k, n_hist, CAUSAL, HAS_TARGETS, SELF_ATTN, BLOCK_M, BLOCK_N)
    dk_ND, dv_ND, dbias_B = _bwd_dkdv_inner(
        dk_ND, dv_ND, dbias_B, k_ND, v_ND, q_head_ptr, do_head_ptr, lse_seq_ptr, delta_seq_ptr,
        bias_head_ptr, row_map_ptr, q_start, out_start, stride_q_row, stride_do_row, n0, lo, mid, n_q, n_k,
        n_hist,
        qk_scale, bias_scale, ACTIVATION, SILU, CAUSAL, HAS_TARGETS, HAS_BIAS, SELF_ATTN, True,
        NUM_BUCKETS, LOG2_EXACT, HEAD_DIM, DOT_PRECISION, BLOCK_M, BLOCK_N, ROW_MAP, ROWS_PER_INDEX,
    )  # fmt: skip
    dk_ND, dv_ND, dbias_B = _bwd_dkdv_inner(
        dk_ND, dv_ND, dbias_B, k_ND, v_ND, q_head_ptr, do_head_ptr, lse_seq_ptr, delta_seq_ptr,
        bias_head_ptr, row_map_ptr, q_start, out_start, stride_q_row, stride_do_row, n0, mid, hi, n_q, n_k,
        n_hist,
        qk_scale, bias_scale, ACTIVATION, SILU, CAUSAL, HAS_TARGETS, HAS_BIAS, SELF_ATTN, False,
        NUM_BUCKETS, LOG2_EXACT, HEAD_DIM, DOT_PRECISION, BLOCK_M, BLOCK_N, ROW_MAP, ROWS_PER_INDEX,
    )  # fmt: skip

    dk_seq_ptr = dk_ptr + kv_start * stride_dk_row + head * stride_dk_head
    dv_seq_ptr = dv_ptr + kv_start * stride_dv_row + head * stride_dv_head
    tl.store(
        dk_seq_ptr + offs_n[:, None] * stride_dk_row + offs_d[None, :],
        (dk_ND * (scale * act_scale)).to(dk_ptr.dtype.element_ty),
        mask=in_N[:, None],
    )
    tl.store(
        dv_seq_ptr + offs_n[:, None] * stride_dv_row + offs_d[None, :],
        (dv_ND * act_scale).to(dv_ptr.dtype.element_ty),
        mask=in_N[:, None],
    )
    if HAS_BIAS:
        # One row of partial sums per program, added up by the launcher: deterministic, and no
        # contention on the few hundred bias entries.
        buckets_B = tl.arange(0, NUM_BUCKETS)
        tl.store(dbias_ptr + head * stride_dbias_head + item * NUM_BUCKETS + buckets_B, dbias_B * act_scale)


@triton.jit
def _bwd_dq_inner(
    dq_MD,
    q_MD,
    do_MD,
    lse_M,
    delta_M,
    k_seq_ptr,
    v_seq_ptr,
    bias_head_ptr,
    stride_k_row,
    stride_v_row,
    m0,
    lo,
    hi,
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
):
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
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
        s_MN = _dot(q_MD, tl.trans(k_ND), None, DOT_PRECISION) * qk_scale
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
        dp_MN = _dot(do_MD, tl.trans(v_ND), None, DOT_PRECISION)
        if ACTIVATION == "softmax":
            ds_MN = tl.exp2(s_MN - lse_M[:, None]) * (dp_MN - delta_M[:, None])
        else:
            ds_MN = dp_MN * _activation_grad(s_MN, ACTIVATION, SILU)
        if MASKED:
            allowed_MN = _allowed(
                offs_m[:, None], offs_n[None, :], n_q, n_k, n_hist, CAUSAL, HAS_TARGETS, SELF_ATTN
            )
            ds_MN = tl.where(allowed_MN, ds_MN, 0.0)
        dq_MD = _dot(ds_MN.to(k_ND.dtype), k_ND, dq_MD, DOT_PRECISION)
    return dq_MD


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
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
    stride_do_row,
    stride_do_head,
    stride_dq_row,
    stride_dq_head,
    stride_lse_head,
    stride_bias_head,
    num_heads,
    num_q_blocks,
    qk_scale,
    bias_scale,
    scale,
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
    NUM_BUCKETS: tl.constexpr,
    LOG2_EXACT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # dq goes to the out rows: with BROADCAST_Q that is one partial dq per sequence, summed by
    # the launcher.
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
    do_MD = _load_rows(
        do_ptr + head * stride_do_head, out_start, offs_m, stride_do_row, offs_d, in_M, row_map_ptr,
        ROW_MAP, ROWS_PER_INDEX,
    )  # fmt: skip
    lse_M = tl.zeros([BLOCK_M], dtype=tl.float32)
    delta_M = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ACTIVATION == "softmax":
        lse_M = tl.load(lse_ptr + head * stride_lse_head + out_start + offs_m, mask=in_M, other=float("inf"))
        delta_M = tl.load(delta_ptr + head * stride_lse_head + out_start + offs_m, mask=in_M, other=0.0)
    k_seq_ptr = k_ptr + kv_start * stride_k_row + head * stride_k_head
    v_seq_ptr = v_ptr + kv_start * stride_v_row + head * stride_v_head
    bias_head_ptr = rel_bias_ptr + head * stride_bias_head

    dq_MD = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end, masked_end, diag_lo, diag_hi = _key_ranges(
        m0, n_k, n_hist, CAUSAL, HAS_TARGETS, SELF_ATTN, BLOCK_M, BLOCK_N
    )
    dq_MD = _bwd_dq_inner(
        dq_MD, q_MD, do_MD, lse_M, delta_M, k_seq_ptr, v_seq_ptr, bias_head_ptr, stride_k_row,
        stride_v_row, m0, 0, full_end, n_q, n_k, n_hist, qk_scale, bias_scale,
        ACTIVATION, SILU, CAUSAL, HAS_TARGETS, HAS_BIAS, SELF_ATTN, False,
        NUM_BUCKETS, LOG2_EXACT, HEAD_DIM, DOT_PRECISION, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    dq_MD = _bwd_dq_inner(
        dq_MD, q_MD, do_MD, lse_M, delta_M, k_seq_ptr, v_seq_ptr, bias_head_ptr, stride_k_row,
        stride_v_row, m0, full_end, masked_end, n_q, n_k, n_hist, qk_scale, bias_scale,
        ACTIVATION, SILU, CAUSAL, HAS_TARGETS, HAS_BIAS, SELF_ATTN, True,
        NUM_BUCKETS, LOG2_EXACT, HEAD_DIM, DOT_PRECISION, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    if HAS_TARGETS:
        dq_MD = _bwd_dq_inner(
            dq_MD, q_MD, do_MD, lse_M, delta_M, k_seq_ptr, v_seq_ptr, bias_head_ptr, stride_k_row,
            stride_v_row, m0, diag_lo, diag_hi, n_q, n_k, n_hist, qk_scale, bias_scale,
            ACTIVATION, SILU, CAUSAL, HAS_TARGETS, HAS_BIAS, SELF_ATTN, True,
            NUM_BUCKETS, LOG2_EXACT, HEAD_DIM, DOT_PRECISION, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    dq_ptrs = _row_ptrs(
        dq_ptr + head * stride_dq_head, out_start, offs_m, stride_dq_row, offs_d, in_M, row_map_ptr,
        ROW_MAP, ROWS_PER_INDEX,
    )  # fmt: skip
    tl.store(dq_ptrs, (dq_MD * (scale * act_scale)).to(dq_ptr.dtype.element_ty), mask=in_M[:, None])


def launch_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    *,
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
    dkdv_config: dict,
    dq_config: dict,
    row_map: torch.Tensor | None = None,
    rows_per_index: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """grad_out [out rows, H, D] -> dq (like q), dk, dv, d rel_bias (fp32 [H, num_buckets]).
    With row_map, grad_out, q, out and dq are in their own row order, as in _launch_forward."""
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_seqs = q_offsets.numel() - 1
    num_out_rows = grad_out.shape[0]
    softmax = activation == "softmax"
    device = q.device
    # Every row of dk, dv and dq_rows belongs to some program (offsets cover the rows).
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    # Broadcast seeds get one partial dq per sequence (in fp32), summed below.
    dq_rows = torch.empty(
        (num_out_rows, num_heads, head_dim), dtype=torch.float32 if broadcast_q else q.dtype, device=device
    )
    bias_dtype = None if rel_bias is None else rel_bias.dtype
    rel_bias = _fp32_bias(rel_bias)
    num_buckets, log2_exact = _bias_args(rel_bias)
    dbias_partial = None
    if rel_bias is not None:
        dbias_partial = torch.zeros((num_heads, 1, num_buckets), dtype=torch.float32, device=device)

    if num_out_rows == 0 or num_seqs == 0 or max_q_len == 0 or max_kv_len == 0:
        # Nothing attends to anything.
        for grad in (dk, dv, dq_rows):
            grad.zero_()
    else:
        num_k_blocks = triton.cdiv(max_kv_len, dkdv_config["BLOCK_N"])
        dkdv_items = num_seqs * num_k_blocks
        if rel_bias is not None:
            # One row of partial sums per dK/dV program (zeros for programs that return early).
            dbias_partial = torch.zeros(
                (num_heads, dkdv_items, num_buckets), dtype=torch.float32, device=device
            )
        grad_out, q, k, v = _unit_last(grad_out), _unit_last(q), _unit_last(k), _unit_last(v)
        q_offsets, kv_offsets, num_targets = _dense(q_offsets), _dense(kv_offsets), _dense(num_targets)
        _check_row_offsets(max_q_len, max_kv_len, [q, grad_out, dq_rows, out], [k, v, dk, dv])
        map_arg = row_map if row_map is not None else q_offsets
        delta = lse
        if softmax:
            assert lse is not None and lse.shape == (num_heads, num_out_rows), "softmax backward needs lse"
            out = _unit_last(out)
            delta = torch.empty_like(lse)
            _attn_bwd_delta_kernel[(triton.cdiv(num_out_rows, 64), num_heads)](
                out, grad_out, delta, map_arg, out.stride(0), out.stride(1), grad_out.stride(0),
                grad_out.stride(1), delta.stride(0), num_out_rows, HEAD_DIM=head_dim, BLOCK_M=64,
                ROW_MAP=row_map is not None, ROWS_PER_INDEX=rows_per_index,
            )  # fmt: skip
        else:
            lse = delta = grad_out  # unused pointers
        common = dict(
            ACTIVATION=activation, CAUSAL=causal, HAS_TARGETS=num_targets is not None,
            HAS_BIAS=rel_bias is not None, SELF_ATTN=self_attn, BROADCAST_Q=broadcast_q,
            ROW_MAP=row_map is not None, ROWS_PER_INDEX=rows_per_index,
            NUM_BUCKETS=num_buckets, LOG2_EXACT=log2_exact, HEAD_DIM=head_dim,
            DOT_PRECISION=_dot_precision(q),
        )  # fmt: skip
        scalars = (*_score_scales(scale, activation, dkdv_config), scale, act_scale)
        targets_arg = num_targets if num_targets is not None else q_offsets
        bias_arg = rel_bias if rel_bias is not None else q
        lse_stride = lse.stride(0) if softmax else 0
        bias_stride = rel_bias.stride(0) if rel_bias is not None else 0
        _attn_bwd_dkdv_kernel[(dkdv_items * num_heads,)](
            q, k, v, grad_out, lse, delta, dk, dv,
            dbias_partial if dbias_partial is not None else dk,
            q_offsets, kv_offsets, targets_arg, bias_arg, map_arg,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            lse_stride, bias_stride, dbias_partial.stride(0) if dbias_partial is not None else 0,
            num_heads, num_k_blocks, *scalars, **common, **dkdv_config,
        )  # fmt: skip
        num_q_blocks = triton.cdiv(max_q_len, dq_config["BLOCK_M"])
        dq_items = num_seqs * num_q_blocks
        _attn_bwd_dq_kernel[(dq_items * num_heads,)](
            q, k, v, grad_out, lse, delta, dq_rows, q_offsets, kv_offsets, targets_arg, bias_arg, map_arg,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dq_rows.stride(0), dq_rows.stride(1),
            lse_stride, bias_stride, num_heads, num_q_blocks, *scalars, **common, **dq_config,
        )  # fmt: skip

    dq = dq_rows
    if broadcast_q:
        dq = dq_rows.view(num_seqs, q.shape[0], num_heads, head_dim).sum(0).to(q.dtype)
    d_rel_bias = None
    if dbias_partial is not None:
        d_rel_bias = dbias_partial.sum(1).to(bias_dtype)
    return dq, dk, dv, d_rel_bias
