"""The attention families' shared core (jagged self-attention, GDPA, target attention): the device
helpers their kernels call, launch configuration, input checks, host-side layout and the public
launchers, which take the forward's or backward's launch function (`launch=`). The kernels
themselves are kernels/kit/attention_forward.py and kernels/attention/backward.py, each a
candidate's starting point.

One forward kernel and one backward (a dK/dV kernel and a dQ kernel, plus a small kernel for the
softmax row terms) serve all three ops; constexpr flags select the mask, the bias and the
activation. Per sequence b and head h, with i and j positions within the sequence:

    s_ij = scale * q_i . k_j (+ rel_bias[h, bucket(|i - j|)])
    softmax:  p_ij = exp(s_ij - lse_i) on allowed pairs,  lse_i = log sum_{allowed j} exp(s_ij)
    other:    p_ij = act(s_ij) * act_scale on allowed pairs   (act_scale = 1 / max_seq_len for
              jagged silu, else 1; act in silu | gelu (erf) | relu | none)
    out_i = sum_j p_ij v_j

    dv_j = sum_i p_ij dO_i,   dp_ij = dO_i . v_j
    ds_ij = p_ij (dp_ij - delta_i), delta_i = dO_i . out_i         (softmax)
    ds_ij = dp_ij act'(s_ij) act_scale                              (other)
    dq_i = scale sum_j ds_ij k_j,  dk_j = scale sum_i ds_ij q_i,
    d rel_bias[h, e] = sum_{(i, j) allowed, bucket(|i - j|) = e} ds_ij

Which pairs are allowed (search_space/attention.py is the definition):
- jagged_attention (SELF_ATTN): allowed(i, j) = j == i or (j < n_hist and (not causal or j <= i or
  i >= n_hist)), n_hist = n - num_targets[b] (HAS_TARGETS), else n_hist = n.
- gdpa and target_attention: every query of sequence b against every key of sequence b. For
  gdpa with BROADCAST_Q every sequence reads the same query rows (learned seeds); target
  attention groups the seeds of all candidates of a request into one query range, so it is the
  same cross-attention (softmax or silu, no mask) and no key is ever copied. The grouping is a
  row map (ROW_MAP, a stable argsort of the candidates by request): the kernels read q and dO
  and write out and dq at each candidate's own rows, and nothing is gathered or scattered.

Algorithm (FlashAttention-2 structure, on jagged offsets):
- Forward: a program owns BLOCK_M query rows of one (sequence, head) and streams BLOCK_N-key
  tiles through registers: s = q k^T, then online softmax in base 2 (log2(e) folded into the
  score scale; running max m and sum l, rescaled by exp2(m_old - m_new)) or the pointwise
  activation, and acc += p v, all accumulated in fp32. Softmax stores lse (base 2) per row.
- Key tiles come in up to three ranges: tiles every row of the block may see, with no mask at
  all (the bulk of the work); boundary tiles (the causal diagonal, a sequence's last partial
  tile), masked; and with targets the block's own diagonal among the target keys, masked.
  Tiles with no allowed pair are never visited: causally nothing past the diagonal, and target
  keys only on the diagonal.
- Backward: delta_i = dO_i . out_i first (softmax); the dK/dV kernel keeps a BLOCK_N key tile
  resident and streams the query tiles that can see it, recomputing p from lse; the dQ kernel
  keeps a query tile and streams key tiles over the same ranges as the forward. No atomics:
  each dK/dV program writes its own d rel_bias partial sums and one torch reduction adds them,
  so the backward is deterministic.
- d rel_bias per tile: bucket(|i - j|) depends only on the diagonal i - j, so each ds tile is
  first skewed (tl.gather: row c rotated by c) so that diagonals become columns, summed into at
  most BLOCK_M + BLOCK_N - 1 diagonal sums, and only those are binned into the buckets.
- Grid: a program per (sequence, block of the longest sequence, head), heads varying fastest and
  a sequence's query blocks in reverse so that the heaviest (last, for causal) block starts
  first; programs past a sequence's end return at once. The dK/dV kernel takes key blocks in
  natural order (under a causal mask the first see the most queries). A work list of real
  blocks only, longest sequences first, lost to this grid on an H200 (BENCHMARKS.md,
  2026-11-30) and is gone.
- Relative bias: a tile more than a few hundred positions off the diagonal meets at most two
  buckets, so its bias is one compare per score between two loaded values and its bias gradient
  two tile sums; only the tiles near the diagonal bucket and gather per score.
- silu in bf16 and fp16 is h (1 + tanh h) with h = s / 2 folded into the score scale: one
  tanh.approx per score instead of an exponential and a division (`_silu_form`).
- On Hopper the softmax forward loads its key and value tiles by TMA boxes of the [rows, H * D]
  views of k and v (`_tma_default`); rows past a sequence come from the next one and are masked.

Relative buckets are integer-exact: floor(log2 d) is the float32 exponent of d and the upper
half-octave bit is the next mantissa bit (exact for d < 2^24), never a float log2.

Layouts: q, k, v, out are [tokens, heads, dim] with unit stride along dim; lse and delta are
fp32 [heads, tokens]. Head dims are powers of two from 16 to 256. fp32 inputs use exact
(`ieee`) dot products; bf16 and fp16 go through the tensor cores with p cast to the input dtype
for the p @ v product. Shape suffixes: M query rows, N key rows, D head dim, B buckets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import MappingProxyType

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

# What candidates may import (sandbox.screen): every helper and launcher of this module.
__all__ = [
    "ACTIVATIONS",
    "INTERPRETED_BF16",
    "LOG2E",
    "LaunchBackward",
    "LaunchForward",
    "RANK_BLOCK",
    "RANK_SORT_MAX",
    "SUPPORTED_DTYPES",
    "_activation",
    "_activation_and_grad",
    "_activation_grad",
    "_allowed",
    "_backward_config",
    "_bias_args",
    "_bias_split",
    "_bounds",
    "_bucket_start",
    "_bucket_sums",
    "_capability_major",
    "_check_activation",
    "_check_bounds",
    "_check_gdpa_bounds",
    "_check_int_bounds",
    "_check_offsets",
    "_check_qkv",
    "_check_row_offsets",
    "_configs",
    "_cross_lengths",
    "_default_scale",
    "_dense",
    "_dot",
    "_dot_precision",
    "_forward_config",
    "_fp32_bias",
    "_gdpa_layout",
    "_group_by_request",
    "_host_values",
    "_key_ranges",
    "_kv_descriptors",
    "_load_rows",
    "_or_empty",
    "_query_ranges",
    "_rank_chunk",
    "_regroup_rows",
    "_regroup_rows_kernel",
    "_rel_bias",
    "_relative_bucket",
    "_request_groups",
    "_request_groups_kernel",
    "_row_ptrs",
    "_score_scales",
    "_sequence",
    "_silu_form",
    "_silu_tanh_grad",
    "_stable_ranks",
    "_tanh",
    "_tile_bias",
    "_tma_default",
    "_tma_problem",
    "_unit_last",
    "_with_overrides",
    "_work_item",
    "check_gdpa",
    "check_jagged_attention",
    "check_target_attention",
    "gdpa_backward",
    "gdpa_forward",
    "jagged_attention_backward",
    "jagged_attention_forward",
    "target_attention_backward",
    "target_attention_forward",
]

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Read-only: a candidate may import it, and the library's own kernels read it in the same process.
ACTIVATIONS = MappingProxyType(
    {
        "jagged_attention": ("softmax", "silu"),
        "gdpa": ("gelu", "silu", "relu", "none"),
        "target_attention": ("softmax", "silu"),
    }
)


# What the public launchers call to run the kernels: forward.launch_forward and
# backward.launch_backward, or a candidate's own.
LaunchForward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
LaunchBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]

# --- device helpers ---------------------------------------------------------------------------

# Triton's interpreter multiplies bfloat16 dot operands as their raw uint16 bits
# (triton-lang/triton#11584). Interpreted (tensors on the CPU), the launchers pass
# DOT_PRECISION = "via_fp32": bfloat16 operands go through exact fp32 products instead, the
# ones a GPU forms.
INTERPRETED_BF16 = "via_fp32"


def _dot_precision(x: torch.Tensor) -> str:
    if x.dtype == torch.float32:
        return "ieee"
    return INTERPRETED_BF16 if x.device.type != "cuda" else "tf32"


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    if DOT_PRECISION == "via_fp32":
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _relative_bucket(dist, NUM_BUCKETS: tl.constexpr, LOG2_EXACT: tl.constexpr):
    # search_space.attention.relative_bucket: d below E = NUM_BUCKETS / 2, else two buckets per
    # octave. d < 2^24 is exact in float32, so its exponent is floor(log2 d) and the mantissa's
    # top bit says d >= 1.5 * 2^floor(log2 d).
    bits = dist.to(tl.float32).to(tl.int32, bitcast=True)
    octave = (bits >> 23) - 127
    upper = (bits >> 22) & 1
    far = NUM_BUCKETS // 2 + 2 * (octave - LOG2_EXACT) + upper
    return tl.where(dist < NUM_BUCKETS // 2, dist, tl.minimum(far, NUM_BUCKETS - 1))


@triton.jit
def _rel_bias(bias_head_ptr, pos_q, pos_k, NUM_BUCKETS: tl.constexpr, LOG2_EXACT: tl.constexpr):
    # A gather from one head's NUM_BUCKETS-entry row: it stays in L1 for the whole program.
    bucket = _relative_bucket(tl.abs(pos_q - pos_k), NUM_BUCKETS, LOG2_EXACT)
    return tl.load(bias_head_ptr + bucket)


@triton.jit
def _tanh(x, SILU: tl.constexpr):
    if SILU == "tanh.approx":
        # One MUFU instruction (sm_75+), max relative error 2^-11: the bf16/fp16 path on a GPU.
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _activation(s, ACTIVATION: tl.constexpr, SILU: tl.constexpr):
    if ACTIVATION == "silu":
        if SILU == "sigmoid":
            return s * tl.sigmoid(s)
        else:
            # s is h = s / 2 here (the launcher halved the score scales): silu(2h) = h (1 + tanh h).
            return s + s * _tanh(s, SILU)
    elif ACTIVATION == "gelu":
        return 0.5 * s * (1.0 + tl.erf(s * 0.7071067811865476))
    elif ACTIVATION == "relu":
        return tl.maximum(s, 0.0)
    else:
        return s


@triton.jit
def _activation_grad(s, ACTIVATION: tl.constexpr, SILU: tl.constexpr):
    # d act / d s with respect to the unhalved score, whatever form s takes (see _activation).
    if ACTIVATION == "silu":
        if SILU == "sigmoid":
            sig = tl.sigmoid(s)
            return sig * (1.0 + s * (1.0 - sig))
        else:
            return _silu_tanh_grad(s, 1.0 + _tanh(s, SILU))
    elif ACTIVATION == "gelu":
        # d/ds [s Phi(s)] = Phi(s) + s phi(s)
        return 0.5 * (1.0 + tl.erf(s * 0.7071067811865476)) + s * 0.3989422804014327 * tl.exp(-0.5 * s * s)
    elif ACTIVATION == "relu":
        return tl.where(s > 0.0, 1.0, 0.0)
    else:
        return tl.full(s.shape, 1.0, tl.float32)


@triton.jit
def _silu_tanh_grad(h, u):
    # silu'(2h) from u = 1 + tanh h: sigmoid(2h) = u / 2 and 1 - sigmoid(2h) = (2 - u) / 2.
    return 0.5 * u * (1.0 + h * (2.0 - u))


@triton.jit
def _activation_and_grad(s, ACTIVATION: tl.constexpr, SILU: tl.constexpr):
    """(act(s), act'(s)); silu's tanh form takes one tanh for both."""
    if ACTIVATION == "silu" and SILU != "sigmoid":
        u = 1.0 + _tanh(s, SILU)
        return s * u, _silu_tanh_grad(s, u)
    else:
        return _activation(s, ACTIVATION, SILU), _activation_grad(s, ACTIVATION, SILU)


@triton.jit
def _allowed(
    pos_q,
    pos_k,
    n_q,
    n_k,
    n_hist,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    SELF_ATTN: tl.constexpr,
):
    # Broadcast-agnostic: pos_q [M, 1] with pos_k [1, N] or pos_q [1, M] with pos_k [N, 1].
    ok = (pos_q < n_q) & (pos_k < n_k)
    if SELF_ATTN:
        if CAUSAL:
            history = (pos_k < n_hist) & ((pos_k <= pos_q) | (pos_q >= n_hist))
            ok = ok & (history | (pos_q == pos_k))
        elif HAS_TARGETS:
            ok = ok & ((pos_k < n_hist) | (pos_q == pos_k))
    return ok


@triton.jit
def _sequence(
    q_offsets_ptr,
    kv_offsets_ptr,
    num_targets_ptr,
    seq,
    SELF_ATTN: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    BROADCAST_Q: tl.constexpr,
):
    """Rows of sequence `seq`: out/dO/lse rows start at out_start, q rows at q_start (row 0 of
    the shared seeds with BROADCAST_Q), k/v rows at kv_start; lengths n_q, n_k; n_hist keys
    before the targets."""
    out_start = tl.load(q_offsets_ptr + seq).to(tl.int64)
    n_q = (tl.load(q_offsets_ptr + seq + 1).to(tl.int64) - out_start).to(tl.int32)
    q_start = tl.full([], 0, tl.int64) if BROADCAST_Q else out_start
    if SELF_ATTN:
        kv_start = out_start
        n_k = n_q
    else:
        kv_start = tl.load(kv_offsets_ptr + seq).to(tl.int64)
        n_k = (tl.load(kv_offsets_ptr + seq + 1).to(tl.int64) - kv_start).to(tl.int32)
    n_hist = n_k
    if HAS_TARGETS:
        num_targets = tl.load(num_targets_ptr + seq).to(tl.int32)
        n_hist = n_k - tl.minimum(tl.maximum(num_targets, 0), n_k)
    return out_start, q_start, kv_start, n_q, n_k, n_hist


@triton.jit
def _row_ptrs(
    head_ptr,
    start,
    offs_m,
    stride_row,
    offs_d,
    in_M,
    row_map_ptr,
    ROW_MAP: tl.constexpr,
    ROWS_PER_INDEX: tl.constexpr,
):
    """[M, D] pointers to rows start + offs_m of a tensor (head_ptr: its row 0 at one head).
    With ROW_MAP those are rows of a grouped order whose row r lies at row
    row_map[r // G] * G + r % G of the tensor (G = ROWS_PER_INDEX, a candidate's seeds): rows
    are read and written where they lie instead of being gathered and scattered around the
    kernel."""
    if ROW_MAP:
        rows = start + offs_m
        index = tl.load(row_map_ptr + rows // ROWS_PER_INDEX, mask=in_M, other=0).to(tl.int64)
        rows = index * ROWS_PER_INDEX + rows % ROWS_PER_INDEX
        return head_ptr + rows[:, None] * stride_row + offs_d[None, :]
    return head_ptr + start * stride_row + offs_m[:, None] * stride_row + offs_d[None, :]


@triton.jit
def _load_rows(
    head_ptr,
    start,
    offs_m,
    stride_row,
    offs_d,
    in_M,
    row_map_ptr,
    ROW_MAP: tl.constexpr,
    ROWS_PER_INDEX: tl.constexpr,
):
    """The [M, D] tile of _row_ptrs, rows past the sequence (not in_M) as zeros."""
    ptrs = _row_ptrs(head_ptr, start, offs_m, stride_row, offs_d, in_M, row_map_ptr, ROW_MAP, ROWS_PER_INDEX)
    return tl.load(ptrs, mask=in_M[:, None], other=0.0)


@triton.jit
def _key_ranges(
    m0,
    n_k,
    n_hist,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    SELF_ATTN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Key tiles of the query block [m0, m0 + BLOCK_M): [0, full_end) every row sees whole (no
    mask); [full_end, masked_end) boundary tiles; [diag_lo, diag_hi) the block's own diagonal
    among target keys (empty without targets). The ranges never overlap."""
    all_see = n_hist  # keys j with allowed(i, j) for every row i of the block
    some_see = n_hist  # history keys some row of the block may see
    if SELF_ATTN and CAUSAL:
        all_see = tl.minimum(m0, n_hist)
        some_see = tl.minimum(n_hist, m0 + BLOCK_M)
    full_end = all_see // BLOCK_N * BLOCK_N
    masked_end = full_end + tl.cdiv(some_see - full_end, BLOCK_N) * BLOCK_N
    diag_lo = masked_end
    diag_hi = masked_end
    if HAS_TARGETS:
        diag_lo = tl.maximum(masked_end, m0)
        diag_hi = tl.minimum(m0 + BLOCK_M, n_k)
    return full_end, masked_end, diag_lo, diag_hi


@triton.jit
def _query_ranges(
    n0,
    n_q,
    n_k,
    n_hist,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    SELF_ATTN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Query tiles that see some key of the block [n0, n0 + BLOCK_N): [lo, mid) masked, then
    [mid, hi) with no pair mask (every real pair allowed; padded rows have zero gradients)."""
    lo = tl.full([], 0, tl.int32)
    mid = tl.full([], 0, tl.int32)
    hi = n_q
    if SELF_ATTN:
        if CAUSAL:
            lo = n0
            # From row n0 + BLOCK_N - 1 on, every row sees the whole key block.
            mid = n0 + tl.cdiv(tl.minimum(BLOCK_N, n_q - n0), BLOCK_M) * BLOCK_M
        if HAS_TARGETS:
            # A target key is seen by its own row only: a block holding one has no unmasked rows,
            # and a block of target keys alone needs just its diagonal rows.
            block_end = tl.minimum(n0 + BLOCK_N, n_k)
            only_targets = n0 >= n_hist
            lo = tl.where(only_targets, n0, lo)
            hi = tl.where(only_targets, block_end, hi)
            mid = tl.where(block_end > n_hist, hi, mid)
    return lo, mid, hi


@triton.jit
def _bucket_sums(
    ds_NM,
    diag0,
    NUM_BUCKETS: tl.constexpr,
    LOG2_EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """sum of ds_NM (key c, query r; i - j = diag0 + r - c) per relative-position bucket."""
    c_N = tl.arange(0, BLOCK_N)
    t_M = tl.arange(0, BLOCK_M)
    # skew[c, t] = ds[c, (c + t) mod BLOCK_M] lies on diagonal r - c = t - wrap * BLOCK_M: after the
    # rotation a diagonal is (a wrap-split) column, so BLOCK_N x BLOCK_M values reduce to at most
    # BLOCK_M + BLOCK_N - 1 diagonal sums before anything is binned.
    rolled_NM = c_N[:, None] + t_M[None, :]
    skew_NM = tl.gather(ds_NM, rolled_NM % BLOCK_M, axis=1)
    wrap_NM = rolled_NM // BLOCK_M
    buckets_B = tl.arange(0, NUM_BUCKETS)
    sums_B = tl.zeros([NUM_BUCKETS], dtype=tl.float32)
    for wrap in tl.static_range(0, (BLOCK_N + BLOCK_M - 2) // BLOCK_M + 1):
        diag_M = tl.sum(tl.where(wrap_NM == wrap, skew_NM, 0.0), axis=0)
        bucket_M = _relative_bucket(tl.abs(diag0 + t_M - wrap * BLOCK_M), NUM_BUCKETS, LOG2_EXACT)
        sums_B += tl.sum(tl.where(bucket_M[:, None] == buckets_B[None, :], diag_M[:, None], 0.0), axis=0)
    return sums_B


@triton.jit
def _bucket_start(bucket, NUM_BUCKETS: tl.constexpr, LOG2_EXACT: tl.constexpr):
    # The smallest distance of `bucket` (the inverse of _relative_bucket on its first distance):
    # itself below E, else 2^octave, or 1.5 * 2^octave for the upper half of the octave.
    far = bucket - NUM_BUCKETS // 2
    octave = far // 2 + LOG2_EXACT
    start = ((2 + far % 2) << octave) >> 1
    return tl.where(bucket < NUM_BUCKETS // 2, bucket, start)


@triton.jit
def _bias_split(
    q0, k0, NUM_BUCKETS: tl.constexpr, LOG2_EXACT: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Whether the tile of queries [q0, q0 + BLOCK_Q) and keys [k0, k0 + BLOCK_K) meets at most
    two buckets, and how: a tile on one side of the diagonal (i - j of one sign) whose nearest and
    farthest distances fall in the same or adjacent buckets, which is every tile more than a few
    hundred positions off the diagonal (buckets grow with the distance). Then the bias of (i, j) is
    that of b_far where sign * (i - j) >= split, else that of b_near: one compare per score
    instead of a bucket and a gathered load."""
    d_lo = q0 - (k0 + BLOCK_K - 1)
    d_hi = q0 + BLOCK_Q - 1 - k0
    below = d_lo >= 0  # every i >= j
    sign = tl.where(below, 1, -1)
    near = tl.where(below, d_lo, -d_hi)
    far = tl.where(below, d_hi, -d_lo)
    b_near = _relative_bucket(near, NUM_BUCKETS, LOG2_EXACT)
    b_far = _relative_bucket(far, NUM_BUCKETS, LOG2_EXACT)
    two = (below | (d_hi <= 0)) & (b_far - b_near <= 1)
    return two, sign, _bucket_start(b_far, NUM_BUCKETS, LOG2_EXACT), b_near, b_far


@triton.jit
def _tile_bias(
    bias_head_ptr,
    pos_q,
    pos_k,
    q0,
    k0,
    NUM_BUCKETS: tl.constexpr,
    LOG2_EXACT: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """rel_bias[bucket(|i - j|)] over a tile (pos_q, pos_k broadcast to it, either orientation)."""
    two, sign, split, b_near, b_far = _bias_split(q0, k0, NUM_BUCKETS, LOG2_EXACT, BLOCK_Q, BLOCK_K)
    if two:
        bias_near = tl.load(bias_head_ptr + b_near)
        bias_far = tl.load(bias_head_ptr + b_far)
        bias = tl.where((pos_q - pos_k) * sign >= split, bias_far, bias_near)
    else:
        bias = _rel_bias(bias_head_ptr, pos_q, pos_k, NUM_BUCKETS, LOG2_EXACT)
    return bias


@triton.jit
def _work_item(num_heads, num_blocks, REVERSE: tl.constexpr):
    """(sequence, block, head) of this program in the grid over every (sequence, block of the
    longest sequence) pair and head. Heads vary fastest, so every head of a block starts together;
    blocks of a sequence are together (REVERSE: last first)."""
    pid = tl.program_id(0)
    head = (pid % num_heads).to(tl.int64)
    item = pid // num_heads
    seq = item // num_blocks
    block = item % num_blocks
    if REVERSE:
        block = num_blocks - 1 - block
    return seq, block, head


@triton.jit
def _stable_ranks(keys_ptr, offs, n, DESCENDING: tl.constexpr, CHUNK: tl.constexpr):
    # The rank of key i in a stable sort is how many keys go before it: smaller ones (larger
    # when DESCENDING), and equal ones at lower indices. Ranks are a permutation, so programs
    # can write each key's index to its place with no conflict.
    key = tl.load(keys_ptr + offs, mask=offs < n, other=0)
    rank = tl.zeros(offs.shape, dtype=tl.int32)
    for start in range(0, n, CHUNK):
        others = start + tl.arange(0, CHUNK)
        other = tl.load(keys_ptr + others, mask=others < n, other=0)
        before = other[None, :] > key[:, None] if DESCENDING else other[None, :] < key[:, None]
        before |= (other[None, :] == key[:, None]) & (others[None, :] < offs[:, None])
        rank += tl.sum((before & (others < n)[None, :]).to(tl.int32), axis=1)
    return rank


@triton.jit
def _request_groups_kernel(
    requests_ptr,
    order_ptr,
    q_offsets_ptr,
    num_cand,
    num_requests,
    seeds,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # The first cdiv(num_cand, BLOCK) programs place candidates: order[rank] = c for the stable
    # rank of c by request. The others write q_offsets[r] = seeds * #{c : request[c] < r} for
    # r in [0, num_requests]: the grouped rows before request r's.
    pid = tl.program_id(0)
    cand_programs = tl.cdiv(num_cand, BLOCK)
    if pid < cand_programs:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        rank = _stable_ranks(requests_ptr, offs, num_cand, False, CHUNK)
        tl.store(order_ptr + rank, offs.to(tl.int64), mask=offs < num_cand)
    else:
        req = (pid - cand_programs) * BLOCK + tl.arange(0, BLOCK)
        before = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, num_cand, CHUNK):
            others = start + tl.arange(0, CHUNK)
            other = tl.load(requests_ptr + others, mask=others < num_cand, other=0)
            less = (other[None, :] < req[:, None]) & (others < num_cand)[None, :]
            before += tl.sum(less.to(tl.int32), axis=1)
        tl.store(q_offsets_ptr + req, before.to(tl.int64) * seeds, mask=req <= num_requests)


@triton.jit
def _regroup_rows_kernel(
    src_ptr,
    dst_ptr,
    row_map_ptr,
    num_rows,
    stride_src_head,
    stride_src_row,
    stride_dst_head,
    ROWS_PER_INDEX: tl.constexpr,
    TO_GROUPED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One block of rows of one head (program axis 1) of a [H, rows] statistic, moved between the
    # grouped row order and the candidates' own: grouped row r is row
    # row_map[r // G] * G + r % G (G = ROWS_PER_INDEX), as _row_ptrs maps q and out.
    head = tl.program_id(1)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < num_rows
    index = tl.load(row_map_ptr + r // ROWS_PER_INDEX, mask=ok, other=0).to(tl.int64)
    own = index * ROWS_PER_INDEX + r % ROWS_PER_INDEX
    if TO_GROUPED:
        x = tl.load(src_ptr + head * stride_src_head + own * stride_src_row, mask=ok)
        tl.store(dst_ptr + head * stride_dst_head + r, x, mask=ok)
    else:
        x = tl.load(src_ptr + head * stride_src_head + r * stride_src_row, mask=ok)
        tl.store(dst_ptr + head * stride_dst_head + own, x, mask=ok)


# --- launch configuration ---------------------------------------------------------------------


def _forward_config(
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    has_bias: bool = False,
    softmax: bool = True,
    tma: bool = False,
) -> dict:
    """Launch parameters of the forward kernel.

    GPU values: FlashAttention-2 style tiles, picked from sm_90 builds (triton 3.9, cuobjdump
    resource usage) so that the heaviest variant of each row (softmax, causal, targets, bias)
    spills no registers or a few dozen bytes; at D = 128 without a bias, the fastest of ten
    tilings timed on an H200 (evals/studies/sweep_attention.py, BENCHMARKS.md): 128 x 64 with 8 warps for
    softmax, 128 x 32 with 4 warps for pointwise activations (10% faster for silu and gelu,
    whose tile holds no running max and sum). With a relative bias, tiles near the diagonal take
    a bucket and a gathered load per score, hence smaller tiles at D = 128 (64 x 32 stayed the
    fastest of four once far tiles took the two-bucket path). Softmax with TMA loads (`tma`):
    128 x 128 with 8 warps, 1.05x the 128 x 64 tile of pointer loads on an H200, where TMA with
    128 x 64 tied (with pointer loads 128 x 128 was 3% slower: the boxes free the registers
    that addresses took). In the interpreter: 16 x 16 tiles, so that short test sequences span
    several blocks and every boundary case runs.
    """
    if device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    if dtype == torch.float32:  # exact fp32 products run on the FMA units, operands in registers
        tile = 32 if head_dim <= 64 else 16
        return {"BLOCK_M": tile, "BLOCK_N": tile, "num_warps": 4, "num_stages": 1}
    if head_dim <= 64:
        # At D = 16 with a bias, ptxas (triton 3.6) crashes compiling two stages of this tile;
        # one compiles and agrees with the reference (evals/studies/probe_bias_tiles.py).
        stages = (1 if head_dim < 32 else 2) if has_bias else 3
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": stages}
    if head_dim <= 128:
        if has_bias:
            return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
        if not softmax:
            return {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
        return {"BLOCK_M": 128, "BLOCK_N": 128 if tma else 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}


def _backward_config(
    head_dim: int, dtype: torch.dtype, device: torch.device, has_bias: bool = False
) -> dict[str, dict]:
    """Launch parameters of the dK/dV kernel (BLOCK_N resident keys, BLOCK_M streamed queries)
    and of the dQ kernel (BLOCK_M resident queries, BLOCK_N streamed keys), chosen like the
    forward's. The resident side is the larger: its fp32 accumulators stay in registers while
    the streamed tiles pass by."""
    if device.type != "cuda":
        tile = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
        return {"dkdv": tile, "dq": tile}
    if dtype == torch.float32:
        size = 32 if head_dim <= 64 else 16
        tile = {"BLOCK_M": size, "BLOCK_N": size, "num_warps": 4, "num_stages": 1}
        return {"dkdv": tile, "dq": tile}
    if head_dim <= 64:
        return {
            "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64 if has_bias else 128, "num_warps": 8, "num_stages": 2},
            "dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
        }
    if head_dim <= 128:
        # Timed on an H200 at D = 128 (evals/studies/sweep_attention.py): these beat the 8-warp,
        # 2-stage tiles of the first cut by 1.4x (dK/dV) and 1.1x to 1.4x (dQ) on softmax, silu,
        # gelu and target attention alike. With a bias (evals/studies/compare_attention.py), since most
        # tiles take the two-bucket path: the same dK/dV tiles, 2.5x faster than the 32 x 32
        # ones, and a 64 x 64 dQ tile.
        return {
            "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
            "dq": (
                {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
                if has_bias
                else {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
            ),
        }
    return {
        "dkdv": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
        "dq": {"BLOCK_M": 32, "BLOCK_N": 32 if head_dim <= 128 else 16, "num_warps": 4, "num_stages": 2},
    }


def _with_overrides(config: dict, block_m: int | None, block_n: int | None, num_warps, num_stages) -> dict:
    config = dict(config)
    for key, value in (("BLOCK_M", block_m), ("BLOCK_N", block_n)):
        if value is not None:
            if value < 16 or value & (value - 1):
                raise ValueError(f"{key.lower()} must be a power of two >= 16 (tl.dot tiles), got {value}")
            config[key] = value
    if num_warps is not None:
        config["num_warps"] = num_warps
    if num_stages is not None:
        config["num_stages"] = num_stages
    return config


# --- input validation -------------------------------------------------------------------------


def _check_offsets(name: str, offsets: torch.Tensor) -> None:
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must be [B + 1] with B >= 0, got shape {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {offsets.dtype}")


def _check_activation(op: str, activation: str) -> None:
    if activation not in ACTIVATIONS[op]:
        raise ValueError(f"{op} supports activations {', '.join(ACTIVATIONS[op])}; got {activation!r}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_name: str = "q") -> None:
    """q [..., H, D] and k, v [tokens, H, D]: same dtype, device, heads and head dim."""
    if k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"k and v must be [tokens, H, D], got shapes {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-2:] != k.shape[-2:]:
        raise ValueError(
            f"{q_name} and k must have the same heads and head dim, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{q_name}, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"attention supports float32, bfloat16 and float16 inputs, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{q_name}, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head dim must be a power of two from 16 to 256, got {head_dim}")


def check_jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    max_seq_len: int,
    activation: str,
    num_targets: torch.Tensor | None,
    rel_bias: torch.Tensor | None,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [total_tokens, H, D], got shape {tuple(q.shape)}")
    _check_qkv(q, k, v)
    if k.shape[0] != q.shape[0]:
        raise ValueError(
            f"self-attention needs as many k/v tokens as q tokens, got {k.shape[0]}, {q.shape[0]}"
        )
    _check_offsets("offsets", offsets)
    _check_activation("jagged_attention", activation)
    if max_seq_len < 0:
        raise ValueError(f"max_seq_len must be >= 0, got {max_seq_len}")
    num_seqs = offsets.numel() - 1
    if num_targets is not None and (num_targets.shape != (num_seqs,) or num_targets.is_floating_point()):
        raise ValueError(
            f"num_targets must be an integer [B] = [{num_seqs}] tensor, got {tuple(num_targets.shape)} "
            f"{num_targets.dtype}"
        )
    if rel_bias is not None:
        if rel_bias.dim() != 2 or rel_bias.shape[0] != q.shape[1]:
            raise ValueError(
                f"rel_bias must be [H, num_buckets] = [{q.shape[1]}, ...], got {tuple(rel_bias.shape)}"
            )
        num_buckets = rel_bias.shape[1]
        exact = num_buckets // 2
        if num_buckets < 2 or exact & (exact - 1) or num_buckets % 2:
            raise ValueError(f"rel_bias needs num_buckets twice a power of two, got {num_buckets}")
        if not rel_bias.is_floating_point() or rel_bias.device != q.device:
            raise ValueError(f"rel_bias must be a floating-point tensor on {q.device}")


def check_gdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor,
    *,
    activation: str,
    broadcast_q: bool,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q or n_q, H, D], got shape {tuple(q.shape)}")
    _check_qkv(q, k, v)
    _check_offsets("kv_offsets", kv_offsets)
    _check_activation("gdpa", activation)
    _check_gdpa_bounds(broadcast_q, max_q_len, max_kv_len)
    if not broadcast_q:
        if q_offsets is None:
            raise ValueError("gdpa needs q_offsets unless broadcast_q")
        _check_offsets("q_offsets", q_offsets)
        if q_offsets.numel() != kv_offsets.numel():
            raise ValueError(f"q_offsets has {q_offsets.numel()} entries, kv_offsets {kv_offsets.numel()}")


def _check_gdpa_bounds(broadcast_q: bool, max_q_len: int | None, max_kv_len: int | None) -> None:
    _check_int_bounds(max_q_len=max_q_len, max_kv_len=max_kv_len)
    if broadcast_q and max_q_len is not None:
        raise ValueError("gdpa takes no max_q_len with broadcast_q: every sample has the n_q seeds")
    if not broadcast_q and (max_q_len is None) != (max_kv_len is None):
        raise ValueError("max_q_len and max_kv_len go together (both bound the launch, or neither)")


def check_target_attention(
    q_cand: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    *,
    activation: str,
    max_candidates: int | None = None,
    max_history: int | None = None,
) -> None:
    if q_cand.dim() != 4:
        raise ValueError(f"q_cand must be [C, S, H, D], got shape {tuple(q_cand.shape)}")
    _check_qkv(q_cand, k, v, q_name="q_cand")
    _check_offsets("kv_offsets", kv_offsets)
    _check_activation("target_attention", activation)
    if cand_to_request.shape != (q_cand.shape[0],) or cand_to_request.is_floating_point():
        raise ValueError(
            f"cand_to_request must be an integer [C] = [{q_cand.shape[0]}] tensor, got "
            f"{tuple(cand_to_request.shape)} {cand_to_request.dtype}"
        )
    _check_bounds(max_candidates, max_history)


def _check_bounds(max_candidates: int | None, max_history: int | None) -> None:
    if (max_candidates is None) != (max_history is None):
        raise ValueError("max_candidates and max_history go together (both bound the launch, or neither)")
    _check_int_bounds(max_candidates=max_candidates, max_history=max_history)


def _check_int_bounds(**bounds: int | None) -> None:
    for name, value in bounds.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def _bounds(max_candidates: int | None, max_history: int | None) -> tuple[int, int] | None:
    # After _check_bounds: both given or neither.
    return None if max_candidates is None else (max_candidates, max_history)


# --- host-side layout -------------------------------------------------------------------------


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    # The kernels index the head dim with unit stride (grad_out can arrive expanded).
    return x if x.stride(-1) == 1 else x.contiguous()


def _dense(x: torch.Tensor | None) -> torch.Tensor | None:
    # Offsets, targets and the bias table are indexed as flat arrays.
    return None if x is None else x.contiguous()


def _host_values(*values: torch.Tensor) -> list[int]:
    """One device-to-host copy for all the scalars a launch needs (each .item() would sync)."""
    return torch.stack([v.reshape(()).to(torch.int64) for v in values]).tolist()


def _cross_lengths(
    q_rows: int, kv_rows: int, q_offsets: torch.Tensor | None, kv_offsets: torch.Tensor, n_q: int | None
) -> tuple[int, int]:
    """Longest query and key sequence, which size the grid: the one host sync of gdpa and
    target_attention. Checks on the way that the offsets cover the rows and never decrease."""
    kv_lengths = kv_offsets[1:] - kv_offsets[:-1]
    values = [kv_lengths.max(), kv_lengths.min(), kv_offsets[0], kv_offsets[-1]]
    if q_offsets is not None:
        q_lengths = q_offsets[1:] - q_offsets[:-1]
        values += [q_lengths.max(), q_lengths.min(), q_offsets[0], q_offsets[-1]]
    host = _host_values(*values)
    if host[1] < 0 or host[2] != 0 or host[3] != kv_rows:
        raise ValueError(f"kv_offsets must rise from 0 to {kv_rows} (the k/v rows)")
    if q_offsets is None:
        return int(n_q or 0), host[0]
    if host[5] < 0 or host[6] != 0 or host[7] != q_rows:
        raise ValueError(f"q_offsets must rise from 0 to {q_rows} (the q rows)")
    return host[4], host[0]


def _regroup_rows(
    stat: torch.Tensor, row_map: torch.Tensor, rows_per_index: int, *, to_grouped: bool
) -> torch.Tensor:
    """A [H, rows] statistic (lse) in the grouped row order of `row_map` from the candidates'
    own (to_grouped), or back: the kernels keep it grouped, the op's contract in candidate order."""
    out = torch.empty((stat.shape[0], stat.shape[1]), dtype=stat.dtype, device=stat.device)
    if stat.numel():
        _regroup_rows_kernel[(triton.cdiv(stat.shape[1], 256), stat.shape[0])](
            stat, out, row_map, stat.shape[1], stat.stride(0), stat.stride(1), out.stride(0),
            ROWS_PER_INDEX=rows_per_index, TO_GROUPED=to_grouped, BLOCK=256,
        )  # fmt: skip
    return out


def _request_groups(
    cand_to_request: torch.Tensor,
    kv_offsets: torch.Tensor,
    seeds: int,
    kv_rows: int,
    bounds: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """(q_offsets, order, max_q_len, max_kv_len): candidates of one request grouped, so that all
    their seeds form one query range against the request's keys: `q_offsets` count the rows of
    that grouped order and `order` (the kernels' row map, or None when cand_to_request never
    decreases) lists the candidates in it; the longest query range and key sequence size the
    grid. The kernels read and write each candidate's rows where they lie; nothing is gathered.

    The grouping (stable ranks and row offsets) is one launch up to RANK_SORT_MAX candidates.
    Without bounds: one host sync for the checks and the grid, with few small device ops before
    it; the row map only when the candidates are out of order. At request shapes they and the
    sync take longer than the kernel itself (a few hundred µs on an H200).
    With bounds (the most candidates of any request, the longest history) there is no host sync
    and nothing is checked: the grid comes from the bounds and the kernels always take the row
    map, so the op can be captured in a CUDA graph.

    A function, not a class: the candidate screen allows no class definitions."""
    num_requests = kv_offsets.numel() - 1
    if num_requests == 0:
        raise ValueError("cand_to_request must lie in [0, 0): kv_offsets holds no request")
    q_offsets, order = _group_by_request(cand_to_request, num_requests, seeds)
    if bounds is not None:
        max_candidates, max_kv_len = bounds
        return q_offsets, order, max_candidates * seeds, max_kv_len
    requests = cand_to_request.to(torch.int64)
    kv_offsets = kv_offsets.to(torch.int64)
    low_high = torch.aminmax(requests)
    kv_min_max = torch.aminmax(kv_offsets[1:] - kv_offsets[:-1])
    is_sorted = (requests[1:] >= requests[:-1]).all().to(torch.int64)
    host = torch.stack([
        low_high.min, low_high.max, (q_offsets[1:] - q_offsets[:-1]).max(), kv_min_max.min,
        kv_min_max.max, kv_offsets[0], kv_offsets[-1], is_sorted,
    ]).tolist()  # fmt: skip
    low, high, max_rows, min_kv_len, max_kv_len, kv_first, kv_last, already_sorted = host
    if low < 0 or high >= num_requests:
        raise ValueError(f"cand_to_request must lie in [0, {num_requests}) (the requests of kv_offsets)")
    if min_kv_len < 0 or kv_first != 0 or kv_last != kv_rows:
        raise ValueError(f"kv_offsets must rise from 0 to {kv_rows} (the k/v rows)")
    return q_offsets, None if already_sorted else order, max_rows, max_kv_len


# --- generic launches -------------------------------------------------------------------------


def _check_row_offsets(max_q_len: int, max_kv_len: int, q_side: list, kv_side: list) -> None:
    # Sequence starts are 64-bit; offsets within a sequence are 32-bit (half the address
    # registers in every tile), which holds while the longest sequence times its row stride
    # stays below 2^31.
    for max_len, tensors in ((max_q_len, q_side), (max_kv_len, kv_side)):
        widest = max(t.stride(0) for t in tensors)
        if max_len * widest >= 2**31:
            raise ValueError(f"a sequence of {max_len} rows of stride {widest} exceeds 32-bit offsets")


def _fp32_bias(rel_bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias table as the kernels read it: fp32, dense ([H, num_buckets], a few hundred bytes,
    so whatever dtype the model keeps it in costs one tiny copy)."""
    return None if rel_bias is None else rel_bias.float().contiguous()


def _bias_args(rel_bias: torch.Tensor | None) -> tuple[int, int]:
    """(NUM_BUCKETS, LOG2_EXACT); fixed dummies without a bias, so they add no compilations."""
    if rel_bias is None:
        return 2, 0
    return rel_bias.shape[1], int(math.log2(rel_bias.shape[1] // 2))


# Up to this many keys, the launch set-up sorts by all-pairs comparison in one launch: 1050
# candidates took torch.argsort's single-block radix sort 29 µs on an H200, longer than the
# small ops around it together.
RANK_SORT_MAX = 4096
RANK_BLOCK = 16


def _rank_chunk(n: int) -> int:
    # Keys compared per step: all of them at once up to 1024 (a power of two, for tl.arange).
    return min(triton.next_power_of_2(max(n, 16)), 1024)


def _group_by_request(
    cand_to_request: torch.Tensor, num_requests: int, seeds: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_offsets [R + 1] of the grouped rows, order [C]: the candidates by request, stably),
    with no host sync. Requests outside [0, R) are not checked here: they fall outside every
    request's rows (the caller checks them unless it trusts its bounds)."""
    num_cand = cand_to_request.numel()
    device = cand_to_request.device
    q_offsets = torch.empty(num_requests + 1, dtype=torch.int64, device=device)
    if num_cand > RANK_SORT_MAX:
        requests = cand_to_request.to(torch.int64)
        # index_add: bincount syncs by itself on CUDA. Out-of-range requests are clamped here.
        counts = torch.zeros(num_requests, dtype=torch.int64, device=device).index_add_(
            0, requests.clamp(0, num_requests - 1), torch.ones_like(requests)
        )
        q_offsets[:1].zero_()  # not `= 0`: a host-to-device copy, refused inside CUDA graph capture
        torch.cumsum(counts * seeds, 0, out=q_offsets[1:])
        return q_offsets, torch.argsort(requests, stable=True)
    order = torch.empty(num_cand, dtype=torch.int64, device=device)
    grid = triton.cdiv(num_cand, RANK_BLOCK) + triton.cdiv(num_requests + 1, RANK_BLOCK)
    _request_groups_kernel[(grid,)](
        cand_to_request.contiguous(), order, q_offsets, num_cand, num_requests, seeds,
        BLOCK=RANK_BLOCK, CHUNK=_rank_chunk(num_cand),
    )  # fmt: skip
    return q_offsets, order


def _score_scales(scale: float, activation: str, config: dict) -> tuple[float, float]:
    """(qk_scale, bias_scale): what the kernels multiply q . k and the bias by to get their s.
    Softmax works in base 2 (log2 e folded in); silu's tanh form takes h = s / 2."""
    if activation == "softmax":
        return scale * LOG2E, LOG2E
    half = 0.5 if config["SILU"] != "sigmoid" else 1.0
    return scale * half, half


def _tma_problem(k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why k and v cannot be read by TMA boxes of their [rows, H * D] views, or None."""
    if k.device.type != "cuda" or _capability_major() < 9:
        return "TMA loads need a CUDA GPU of compute capability 9.0 or newer"
    for name, x in (("k", k), ("v", v)):
        if x.stride(1) != x.shape[2] or x.stride(2) != 1:
            return f"TMA loads need the heads of {name} side by side in a row (strides {x.stride()})"
        if x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
            return f"TMA loads need {name} and its row stride aligned to 16 bytes"
    return None


def _kv_descriptors(k: torch.Tensor, v: torch.Tensor, config: dict) -> tuple[bool, object, object]:
    """(TMA on, k's and v's descriptors): descriptors of [rows, H * D] views (heads side by side
    in a row) with [BLOCK_N, D] boxes where config["USE_TMA"] is True (an error if the layout
    does not allow them) or None (TMA if the layout allows); else k and v themselves, unused."""
    if config["USE_TMA"] is False or k.shape[0] == 0:  # no rows, nothing to describe
        return False, k, v
    problem = _tma_problem(k, v)
    if problem is not None:
        if config["USE_TMA"]:
            raise ValueError(problem)
        return False, k, v

    def describe(x: torch.Tensor) -> TensorDescriptor:
        rows, heads, dim = x.shape
        return TensorDescriptor(x, [rows, heads * dim], [x.stride(0), 1], [config["BLOCK_N"], dim])

    return True, describe(k), describe(v)


def _default_scale(head_dim: int, scale: float | None) -> float:
    return head_dim**-0.5 if scale is None else float(scale)


def _silu_form(q: torch.Tensor, activation: str, fast_silu: bool | None) -> str:
    """How the kernels evaluate silu (the SILU constexpr): "sigmoid", s * sigmoid(s) as written,
    exact division included; or, by default for bf16 and fp16, h (1 + tanh h) with h = s / 2, one
    MUFU instruction per score on a GPU ("tanh.approx"; "tanh" from exp in the interpreter, which
    has no PTX). Other activations take the fixed "sigmoid", so they add no compilations."""
    if activation != "silu":
        return "sigmoid"
    if not (q.dtype != torch.float32 if fast_silu is None else fast_silu):
        return "sigmoid"
    return "tanh.approx" if q.device.type == "cuda" else "tanh"


_CAPABILITY_MAJOR: dict[int, int] = {}


def _capability_major() -> int:
    """The compute capability's major version of the current CUDA device, as Triton targets it.
    Cached per device: the target query takes microseconds of host time, twice per forward."""
    index = triton.runtime.driver.active.get_current_device()
    if index not in _CAPABILITY_MAJOR:
        _CAPABILITY_MAJOR[index] = triton.runtime.driver.active.get_current_target().arch // 10
    return _CAPABILITY_MAJOR[index]


def _tma_default(q: torch.Tensor, has_bias: bool, activation: str) -> bool:
    """Whether the forward loads keys and values by TMA unless told: softmax without a bias at
    D = 128, bf16 or fp16, on Hopper or newer (BENCHMARKS.md: 1.05x to 1.06x at power-law lengths;
    pointwise activations gained nothing, and warp specialisation of the loop neither)."""
    return (
        activation == "softmax"
        and not has_bias
        and q.shape[-1] == 128
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.device.type == "cuda"
        and _capability_major() >= 9
    )


def _configs(
    q: torch.Tensor,
    has_bias: bool,
    activation: str,
    block_m: int | None,
    block_n: int | None,
    num_warps: int | None,
    num_stages: int | None,
    dq_overrides: tuple | None = None,
    *,
    fast_silu: bool | None = None,
    tma: bool | None = None,
    shift_last: bool | None = None,
) -> dict | tuple[dict, dict]:
    """The default launch configuration with the caller's overrides: the forward's, or with
    dq_overrides the backward's (dK/dV, dQ); each carries the kernels' SILU form, the forward
    also whether its key loop loads by TMA (None: the default, settled at launch) and whether
    its last key tile is shifted (SHIFT_LAST)."""
    head_dim, dtype, device = q.shape[-1], q.dtype, q.device
    silu = {"SILU": _silu_form(q, activation, fast_silu)}
    if dq_overrides is None:
        if tma is None:  # by default TMA where it won, if the layout allows (None, settled at launch)
            tma = None if _tma_default(q, has_bias, activation) else False
        defaults = _forward_config(
            head_dim, dtype, device, has_bias, activation == "softmax", tma is not False
        )
        loads = {"USE_TMA": tma, "SHIFT_LAST": shift_last}
        return {**_with_overrides(defaults, block_m, block_n, num_warps, num_stages), **silu, **loads}
    defaults = _backward_config(head_dim, dtype, device, has_bias)
    return (
        {**_with_overrides(defaults["dkdv"], block_m, block_n, num_warps, num_stages), **silu},
        {**_with_overrides(defaults["dq"], *dq_overrides), **silu},
    )


# --- public launchers -------------------------------------------------------------------------


def jagged_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    max_seq_len: int,
    activation: str = "softmax",
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    rel_bias: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fast_silu: bool | None = None,
    tma: bool | None = None,
    shift_last: bool | None = None,
    launch: LaunchForward,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """HSTU self-attention over jagged sequences; no host sync.

    q, k, v [total_tokens, H, D]; offsets [B + 1] (sequence b is rows offsets[b]:offsets[b + 1],
    offsets[0] = 0 and offsets[-1] = total_tokens); max_seq_len >= every length (it sizes the
    grid and is the silu normaliser); num_targets [B]; rel_bias [H, num_buckets].
    -> out [total_tokens, H, D], and with return_lse the softmax lse (base 2) fp32 [H, total_tokens]
    (empty, [0], for silu): search_space/attention.py defines it.
    """
    check_jagged_attention(
        q,
        k,
        v,
        offsets,
        max_seq_len=max_seq_len,
        activation=activation,
        num_targets=num_targets,
        rel_bias=rel_bias,
    )
    out, lse = launch(
        q, k, v, offsets, offsets,
        num_out_rows=q.shape[0], max_q_len=max_seq_len, max_kv_len=max_seq_len, activation=activation,
        scale=_default_scale(q.shape[-1], scale),
        act_scale=1.0 / max_seq_len if activation == "silu" and max_seq_len > 0 else 1.0,
        self_attn=True, causal=causal, num_targets=num_targets, rel_bias=rel_bias, broadcast_q=False,
        return_lse=return_lse,
        config=_configs(
            q, rel_bias is not None, activation, block_m, block_n, num_warps, num_stages, fast_silu=fast_silu,
            tma=tma, shift_last=shift_last,
        ),
    )  # fmt: skip
    return (out, _or_empty(lse, q)) if return_lse else out


def _or_empty(lse: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The statistics a forward returns: lse, or empty where the activation keeps none."""
    return lse if lse is not None else like.new_empty(0, dtype=torch.float32)


def jagged_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    max_seq_len: int,
    activation: str = "softmax",
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    rel_bias: torch.Tensor | None = None,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dq_block_m: int | None = None,
    dq_block_n: int | None = None,
    dq_num_warps: int | None = None,
    dq_num_stages: int | None = None,
    fast_silu: bool | None = None,
    launch: LaunchBackward,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """grad_out [total_tokens, H, D], the forward's out and lse (softmax) -> dq, dk, dv
    [total_tokens, H, D] and d rel_bias [H, num_buckets] (None without a bias). block_m / block_n /
    num_warps / num_stages configure the dK/dV kernel, dq_* the dQ kernel."""
    dkdv_config, dq_config = _configs(
        q, rel_bias is not None, activation, block_m, block_n, num_warps, num_stages,
        (dq_block_m, dq_block_n, dq_num_warps, dq_num_stages), fast_silu=fast_silu,
    )  # fmt: skip
    return launch(
        grad_out, q, k, v, out, lse, offsets, offsets,
        max_q_len=max_seq_len, max_kv_len=max_seq_len, activation=activation,
        scale=_default_scale(q.shape[-1], scale),
        act_scale=1.0 / max_seq_len if activation == "silu" and max_seq_len > 0 else 1.0,
        self_attn=True, causal=causal, num_targets=num_targets, rel_bias=rel_bias, broadcast_q=False,
        dkdv_config=dkdv_config, dq_config=dq_config,
    )  # fmt: skip


def _gdpa_layout(
    q: torch.Tensor,
    k: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor,
    broadcast_q: bool,
    max_q_len: int | None,
    max_kv_len: int | None,
) -> tuple[torch.Tensor, int, int]:
    """(q_offsets as the kernels take them, longest query and key sequence): one host sync, or
    none with the caller's bounds (checked by _check_gdpa_bounds: max_kv_len, and max_q_len
    unless broadcast_q), which are then trusted."""
    num_seqs = kv_offsets.numel() - 1
    if num_seqs == 0:
        return torch.zeros(1, dtype=torch.int64, device=q.device), 0, 0
    if broadcast_q:
        # Out rows of sample b are b * n_q + [0, n_q): the same offsets the jagged case reads.
        out_offsets = torch.arange(num_seqs + 1, dtype=torch.int64, device=q.device) * q.shape[0]
        if max_kv_len is None:
            _, max_kv_len = _cross_lengths(q.shape[0], k.shape[0], None, kv_offsets, q.shape[0])
        return out_offsets, q.shape[0], max_kv_len
    assert q_offsets is not None
    if max_kv_len is None:
        max_q_len, max_kv_len = _cross_lengths(q.shape[0], k.shape[0], q_offsets, kv_offsets, None)
    assert max_q_len is not None
    return q_offsets, max_q_len, max_kv_len


def gdpa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor,
    *,
    activation: str = "gelu",
    scale: float | None = None,
    broadcast_q: bool = False,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fast_silu: bool | None = None,
    tma: bool | None = None,
    shift_last: bool | None = None,
    launch: LaunchForward,
) -> torch.Tensor:
    """Generalized dot-product attention (non-causal, unnormalised activation).

    q [total_q, H, D] with q_offsets [B + 1], or with broadcast_q one set of seeds [n_q, H, D]
    for every sample; k, v [total_kv, H, D] with kv_offsets [B + 1]
    -> out [total_q, H, D] ([B * n_q, H, D] with broadcast_q). One host sync (checks, and the
    longest sequences size the grid), or none given max_kv_len (>= every key sequence) and,
    unless broadcast_q, max_q_len (>= every query sequence), which are then trusted.
    """
    check_gdpa(
        q, k, v, q_offsets, kv_offsets, activation=activation, broadcast_q=broadcast_q,
        max_q_len=max_q_len, max_kv_len=max_kv_len,
    )  # fmt: skip
    out_offsets, max_q_len, max_kv_len = _gdpa_layout(
        q, k, q_offsets, kv_offsets, broadcast_q, max_q_len, max_kv_len
    )
    num_out_rows = (kv_offsets.numel() - 1) * q.shape[0] if broadcast_q else q.shape[0]
    out, _ = launch(
        q, k, v, out_offsets, kv_offsets,
        num_out_rows=num_out_rows, max_q_len=max_q_len, max_kv_len=max_kv_len, activation=activation,
        scale=_default_scale(q.shape[-1], scale), act_scale=1.0, self_attn=False, causal=False,
        num_targets=None, rel_bias=None, broadcast_q=broadcast_q, return_lse=False,
        config=_configs(
            q, False, activation, block_m, block_n, num_warps, num_stages, fast_silu=fast_silu, tma=tma,
            shift_last=shift_last,
        ),
    )  # fmt: skip
    return out


def gdpa_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor,
    *,
    activation: str = "gelu",
    scale: float | None = None,
    broadcast_q: bool = False,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dq_block_m: int | None = None,
    dq_block_n: int | None = None,
    dq_num_warps: int | None = None,
    dq_num_stages: int | None = None,
    fast_silu: bool | None = None,
    launch: LaunchBackward,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad_out like gdpa's out -> dq (like q; summed over samples with broadcast_q), dk, dv.
    Bounds as gdpa_forward's (the inputs are the forward's, checked there)."""
    _check_gdpa_bounds(broadcast_q, max_q_len, max_kv_len)
    out_offsets, max_q_len, max_kv_len = _gdpa_layout(
        q, k, q_offsets, kv_offsets, broadcast_q, max_q_len, max_kv_len
    )
    dkdv_config, dq_config = _configs(
        q, False, activation, block_m, block_n, num_warps, num_stages,
        (dq_block_m, dq_block_n, dq_num_warps, dq_num_stages), fast_silu=fast_silu,
    )  # fmt: skip
    dq, dk, dv, _ = launch(
        grad_out, q, k, v, grad_out, None, out_offsets, kv_offsets,
        max_q_len=max_q_len, max_kv_len=max_kv_len, activation=activation,
        scale=_default_scale(q.shape[-1], scale), act_scale=1.0, self_attn=False, causal=False,
        num_targets=None, rel_bias=None, broadcast_q=broadcast_q,
        dkdv_config=dkdv_config, dq_config=dq_config,
    )  # fmt: skip
    return dq, dk, dv


def target_attention_forward(
    q_cand: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    *,
    activation: str = "softmax",
    scale: float | None = None,
    return_lse: bool = False,
    max_candidates: int | None = None,
    max_history: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fast_silu: bool | None = None,
    tma: bool | None = None,
    shift_last: bool | None = None,
    launch: LaunchForward,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """Request-broadcast target attention.

    q_cand [C, S, H, D] (S seeds per candidate); k, v [total_kv, H, D] with kv_offsets [R + 1];
    cand_to_request [C] in [0, R) -> out [C, S, H, D], and with return_lse the softmax lse fp32
    [H, C * S] in candidate order (row c * S + s; -inf for an empty history; empty for silu).
    Histories are never copied per candidate. One host sync (checks, grouping and grid size),
    or none with max_candidates (>= the candidates of every request) and max_history (>= every
    history length), which are then trusted.
    """
    check_target_attention(
        q_cand, k, v, kv_offsets, cand_to_request, activation=activation,
        max_candidates=max_candidates, max_history=max_history,
    )  # fmt: skip
    num_cand, seeds, num_heads, head_dim = q_cand.shape
    if num_cand == 0 or seeds == 0:
        out = torch.empty_like(q_cand)
        lse = None
        if return_lse and activation == "softmax":
            lse = torch.empty((num_heads, 0), dtype=torch.float32, device=q_cand.device)
        return (out, _or_empty(lse, q_cand)) if return_lse else out
    q_offsets, order, max_q_len, max_kv_len = _request_groups(
        cand_to_request, kv_offsets, seeds, k.shape[0], _bounds(max_candidates, max_history)
    )
    out_rows, lse = launch(
        q_cand.reshape(num_cand * seeds, num_heads, head_dim), k, v, q_offsets, kv_offsets,
        num_out_rows=num_cand * seeds, max_q_len=max_q_len, max_kv_len=max_kv_len,
        activation=activation,
        scale=_default_scale(head_dim, scale), act_scale=1.0, self_attn=False, causal=False,
        num_targets=None, rel_bias=None, broadcast_q=False, return_lse=return_lse,
        config=_configs(
            q_cand, False, activation, block_m, block_n, num_warps, num_stages, fast_silu=fast_silu,
            tma=tma, shift_last=shift_last,
        ),
        row_map=order, rows_per_index=seeds,
    )  # fmt: skip
    out = out_rows.view(num_cand, seeds, num_heads, head_dim)
    if lse is not None and order is not None:  # the kernel wrote it in grouped row order
        lse = _regroup_rows(lse, order, seeds, to_grouped=False)
    return (out, _or_empty(lse, q_cand)) if return_lse else out


def target_attention_backward(
    grad_out: torch.Tensor,
    q_cand: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    activation: str = "softmax",
    scale: float | None = None,
    max_candidates: int | None = None,
    max_history: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dq_block_m: int | None = None,
    dq_block_n: int | None = None,
    dq_num_warps: int | None = None,
    dq_num_stages: int | None = None,
    fast_silu: bool | None = None,
    launch: LaunchBackward,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad_out [C, S, H, D], the forward's out and lse (candidate order) -> dq_cand [C, S, H, D],
    dk, dv. Groups the candidates as the forward did: one host sync, or none with the forward's
    max_candidates and max_history."""
    num_cand, seeds, num_heads, head_dim = q_cand.shape
    if num_cand == 0 or seeds == 0:
        return torch.zeros_like(q_cand), torch.zeros_like(k), torch.zeros_like(v)
    _check_bounds(max_candidates, max_history)
    q_offsets, order, max_q_len, max_kv_len = _request_groups(
        cand_to_request, kv_offsets, seeds, k.shape[0], _bounds(max_candidates, max_history)
    )
    rows = num_cand * seeds
    if lse is not None and lse.numel() and order is not None:  # the kernels read grouped rows
        lse = _regroup_rows(lse, order, seeds, to_grouped=True)

    def as_rows(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(rows, num_heads, head_dim)

    dkdv_config, dq_config = _configs(
        q_cand, False, activation, block_m, block_n, num_warps, num_stages,
        (dq_block_m, dq_block_n, dq_num_warps, dq_num_stages), fast_silu=fast_silu,
    )  # fmt: skip
    dq_rows, dk, dv, _ = launch(
        as_rows(grad_out), as_rows(q_cand), k, v, as_rows(out), lse, q_offsets, kv_offsets,
        max_q_len=max_q_len, max_kv_len=max_kv_len, activation=activation,
        scale=_default_scale(head_dim, scale), act_scale=1.0, self_attn=False, causal=False,
        num_targets=None, rel_bias=None, broadcast_q=False,
        dkdv_config=dkdv_config, dq_config=dq_config,
        row_map=order, rows_per_index=seeds,
    )  # fmt: skip
    return dq_rows.view(num_cand, seeds, num_heads, head_dim), dk, dv
