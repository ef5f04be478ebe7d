"""HSTU-style jagged self-attention (Jagged Flash Attention): the sequence encoder of a
generative recommender, over user histories of power-law length packed without padding.

    s_ij = scale * q_i . k_j + rel_bias[h, bucket(|i - j|)]        (positions within the sequence)
    softmax: out_i = sum_j softmax_j(s_ij over allowed j) v_j
    silu:    out_i = sum_{allowed j} silu(s_ij) / max_seq_len * v_j
    allowed(i, j) = j == i or (j < n_hist and (not causal or j <= i or i >= n_hist))

Sequence b holds rows offsets[b]:offsets[b + 1] of q, k, v [T, H, D]; its last
min(num_targets[b], n) tokens are candidates that see the whole history and themselves, never
each other. The math, its edge cases and the relative buckets are search_space/attention.py's.
"""

from __future__ import annotations

import torch

from search_space import workload
from search_space.attention import compiled_reference, jagged_attention_reference, relative_bucket
from search_space.attention_common import (
    DENSE_BUDGET,
    FORBIDDEN_OPS,
    REL_BIAS_STD,
    SCREEN_EXTRAS,
    SOFTMAX_LSE,
    TOLERANCES,
    IndexCache,
    attention_cost,
    block_mask,
    bucket,
    bucket_of,
    dense_pointwise,
    draw_lengths,
    drawn_scale,
    element_bytes,
    flex,
    from_quantiles,
    index_bytes,
    index_dtype,
    length_weights,
    offsets_of,
    pad,
    padded_table,
    permuted,
    prepare_scale,
    randn,
    scale_drawn,
    sdpa,
    softmax_error_scale,
    softmax_saves_statistics,
    tile_template,
    token_positions,
    unpad,
    with_statistics,
)
from search_space.op import Backward, Op
from search_space.problem import Inputs, Problem, Shape, ShapeBaseline

ENTRY = "jagged_attention"


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    """Params: heads, dim; `lengths` or num_seqs + dist + max_len (+ min_frac, sampled); optional
    max_seq_len, activation, causal, max_targets (+ random_targets: uniform in [0, max_targets]
    per sequence, else max_targets each), rel_bias (+ bias_buckets), scale, index_dtype;
    with_lse (the call asks for the statistics, see SOFTMAX_LSE)."""
    p = shape.params
    gen = torch.Generator(device=device).manual_seed(seed)
    lengths = draw_lengths(p, gen, device)
    if from_quantiles(p):
        (lengths,) = permuted([lengths], gen, device)
    heads, dim, dtype, idx = p["heads"], p["dim"], shape.torch_dtype, index_dtype(p)
    total = sum(lengths)
    q, k, v = (randn((total, heads, dim), gen, device, dtype) for _ in range(3))
    num_targets = None
    if p.get("max_targets") is not None:
        if p.get("random_targets"):
            num_targets = torch.randint(
                0, p["max_targets"] + 1, (len(lengths),), generator=gen, device=device, dtype=idx
            )
        else:
            num_targets = torch.full((len(lengths),), p["max_targets"], dtype=idx, device=device)
    rel_bias = None
    if p.get("rel_bias"):
        size = (heads, p.get("bias_buckets", workload.REL_BIAS_BUCKETS))
        rel_bias = (torch.randn(size, generator=gen, device=device) * REL_BIAS_STD).to(dtype)
    kwargs = {
        "max_seq_len": max(1, p.get("max_seq_len", p.get("max_len", max(lengths, default=0)))),
        "activation": p.get("activation", "softmax"),
        "causal": p.get("causal", True),
        "num_targets": num_targets,
        "rel_bias": rel_bias,
        "scale": drawn_scale(p, seed, dim),
    }
    return Inputs(args=(q, k, v, offsets_of(lengths, idx, device)), kwargs=with_statistics(kwargs, p))


# --- roofline counts ------------------------------------------------------------------------


def allowed_pairs(n: int, num_targets: int, causal: bool) -> int:
    """Allowed (query, key) pairs of one sequence: its history attends causally (n_h (n_h + 1) / 2)
    or fully (n_h^2), each of its t targets to the history and itself (n_h + 1)."""
    t = min(num_targets, n)
    n_hist = n - t
    return (n_hist * (n_hist + 1) // 2 if causal else n_hist * n_hist) + t * (n_hist + 1)


def expected_pairs(shape: Shape) -> float:
    """Allowed pairs of a batch; exact for listed or quantile lengths (timing shapes), the
    expectation over random lengths and random targets otherwise."""
    p = shape.params
    causal, max_targets = p.get("causal", True), p.get("max_targets")
    if max_targets is None:
        targets = [0]
    else:
        targets = list(range(max_targets + 1)) if p.get("random_targets") else [max_targets]
    return sum(
        weight * sum(allowed_pairs(n, t, causal) for t in targets) / len(targets)
        for n, weight in length_weights(p)
    )


def flops(shape: Shape) -> float:
    """Useful forward FLOPs: per allowed pair and head, 2 D for q.k and 2 D for p * v. Masked
    pairs, padding, the softmax or silu and the bias are not counted (the FlashAttention
    convention)."""
    p = shape.params
    return expected_pairs(shape) * p["heads"] * 4 * p["dim"]


def bytes_moved(shape: Shape) -> float:
    """Minimum traffic: q, k, v read once, the output written once, offsets, targets and the
    bias table read once."""
    p = shape.params
    weights = length_weights(p)
    tokens = sum(n * w for n, w in weights)
    num_seqs = sum(w for _, w in weights)
    total = 4 * tokens * p["heads"] * p["dim"] * element_bytes(shape)
    total += (num_seqs + 1) * index_bytes(p)
    if p.get("max_targets") is not None:
        total += num_seqs * index_bytes(p)
    if p.get("rel_bias"):
        total += p["heads"] * p.get("bias_buckets", workload.REL_BIAS_BUCKETS) * element_bytes(shape)
    return total


# --- baselines ------------------------------------------------------------------------------


def history_lengths(offsets: torch.Tensor, num_targets: torch.Tensor | None) -> torch.Tensor:
    """n_hist [B]: each sequence's length less its targets (at most all of it)."""
    lengths = offsets[1:] - offsets[:-1]
    if num_targets is None:
        return lengths
    return lengths - torch.minimum(num_targets.to(lengths.dtype), lengths)


def torch_padded(
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
) -> torch.Tensor:
    """Padded dense attention, the way a model without jagged kernels computes it: pad to
    [B, H, max_seq_len, D], attend, unpad (both inside the call).

    softmax, causal, no targets, no bias: SDPA with is_causal on FlashAttention; exact, since the
    padding follows each sequence's last token and no causal query reaches it. Otherwise SDPA
    with the boolean mask (or the bias with -inf where masked), which FlashAttention does not
    take. silu: eager matrix products with the score tensor materialized, as HSTU's PyTorch
    path does (in fp32, see fp32_scores). Masks and scores are built a bounded chunk of
    sequences at a time; a padded query row attends at least to itself, so no row is fully
    masked (no NaN, even in the backward)."""
    total, heads, dim = q.shape
    num_seqs = offsets.numel() - 1
    scale = dim**-0.5 if scale is None else scale
    if total == 0:
        return q.new_zeros(total, heads, v.shape[-1])
    seq, pos = token_positions(offsets, total)
    n = max_seq_len
    q_p, k_p, v_p = (pad(x, seq, pos, num_seqs, n) for x in (q, k, v))
    if activation == "softmax" and causal and num_targets is None and rel_bias is None:
        return unpad(sdpa(q_p, k_p, v_p, scale=scale, is_causal=True), seq, pos)

    n_hist = history_lengths(offsets, num_targets)
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]

    def allowed(bs: slice, ms: slice) -> torch.Tensor:  # [b, 1, m, N]
        h = n_hist[bs].long()[:, None, None, None]
        rows = i[ms]
        history = j < h
        if causal:
            history = history & ((j <= rows) | (rows >= h))
        return history | (rows == j)

    bias = None
    if rel_bias is not None:
        bias = rel_bias.to(q.dtype)[:, relative_bucket((i - j).abs(), rel_bias.shape[1])]  # [H, N, N]
    if activation != "softmax":
        out = dense_pointwise(
            q_p, k_p, v_p, activation=activation, scale=scale, divide_by=max_seq_len, bias=bias, mask=allowed
        )
        return unpad(out, seq, pos)
    step = max(1, DENSE_BUDGET // ((heads if bias is not None else 1) * n * n))
    pieces = []
    for b0 in range(0, num_seqs, step):
        bs = slice(b0, min(b0 + step, num_seqs))
        mask = allowed(bs, slice(None))
        if bias is not None:
            mask = bias.masked_fill(~mask, float("-inf"))  # [b, H, N, N]
        pieces.append(sdpa(q_p[bs], k_p[bs], v_p[bs], scale=scale, attn_mask=mask))
    return unpad(torch.cat(pieces), seq, pos)


_BLOCK_MASKS = IndexCache()


def _block_mask(offsets: torch.Tensor, num_targets: torch.Tensor | None, causal: bool, total: int):
    """The batch's block mask over the packed [T, T] score matrix, and the token positions."""
    seq, pos = token_positions(offsets, total)
    n_hist = history_lengths(offsets, num_targets)
    seq_t, pos_t = padded_table(seq, -1), padded_table(pos, 0)
    hist_t = padded_table(n_hist[seq].long(), 0)

    def mask_mod(b, h, q_idx, kv_idx):
        history = pos_t[kv_idx] < hist_t[q_idx]
        if causal:
            history = history & ((kv_idx <= q_idx) | (pos_t[q_idx] >= hist_t[q_idx]))
        return (seq_t[q_idx] == seq_t[kv_idx]) & (history | (q_idx == kv_idx))

    return block_mask(mask_mod, total, total, offsets.device), pos_t


def torch_flex(
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
) -> torch.Tensor:
    """flex_attention over the packed batch [1, H, T, D]: the sequences, causality and targets
    in a block mask (blocks of no allowed pair skipped), the relative bias in a score_mod.

    The block mask depends only on offsets and num_targets, which a training step has once per
    batch for all its layers, so it is built outside the timed call (at the first call with
    these tensors, see IndexCache); the bias lookup, which follows a learned parameter, is built
    in every call. Softmax only: flex_attention always normalizes."""
    if activation != "softmax":
        raise ValueError(f"flex_attention computes softmax attention only, not {activation!r}")
    total, heads, dim = q.shape
    if total == 0:
        return q.new_zeros(total, heads, v.shape[-1])
    mask, pos_t = _BLOCK_MASKS.get(
        (offsets, num_targets), (causal, total), lambda: _block_mask(offsets, num_targets, causal, total)
    )
    score_mod = None
    if rel_bias is not None:
        distances = torch.arange(max_seq_len, device=q.device)
        by_distance = rel_bias[:, relative_bucket(distances, rel_bias.shape[1])]  # [H, max_seq_len]

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + by_distance[h, (pos_t[q_idx] - pos_t[kv_idx]).abs()]

    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = flex(q4, k4, v4, score_mod=score_mod, block_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


def _softmax_shape(shape: Shape) -> bool:
    return shape.params.get("activation", "softmax") == "softmax"


# --- shapes ---------------------------------------------------------------------------------


_s = Shape.of


def _check_shapes(dtype: str) -> tuple[Shape, ...]:
    h = {"heads": 2}
    return (
        _s("mixed-d32", dtype, **h, dim=32, lengths=[5, 0, 1, 37, 16, 64, 3, 100], with_lse=True),
        _s("one-long-d16", dtype, **h, dim=16, lengths=[3, 1, 250, 2, 0, 5, 2]),
        _s("no-sequences", dtype, **h, dim=16, lengths=[]),
        _s("all-empty", dtype, **h, dim=16, lengths=[0, 0, 0], with_lse=True),
        _s("single-token", dtype, **h, dim=32, lengths=[1]),
        _s("power-sampled", dtype, **h, dim=32, num_seqs=7, dist="power", max_len=80, sampled=True),
        _s("uniform-int32", dtype, **h, dim=16, num_seqs=5, dist="uniform", max_len=50, index_dtype="int32"),
        # Five sequences longer than max_targets: a kernel that reads the first sequence's target
        # count for all is caught unless the other four draw the same (a (1/7)^4 chance per call).
        _s(
            "targets",
            dtype,
            **h,
            dim=32,
            lengths=[10, 40, 3, 0, 70, 1, 25, 17],
            max_targets=6,
            random_targets=True,
        ),  # fmt: skip
        _s(
            "targets-bias",
            dtype,
            **h,
            dim=32,
            lengths=[33, 2, 65, 17],
            max_targets=4,
            rel_bias=True,
            with_lse=True,
        ),
        # With 8 buckets every distance from 12 on shares the last one.
        _s("bias-clamped", dtype, **h, dim=16, lengths=[48, 20], rel_bias=True, bias_buckets=8),
        _s(
            "non-causal-targets",
            dtype,
            **h,
            dim=32,
            lengths=[12, 30, 1, 7],
            causal=False,
            max_targets=3,
            with_lse=True,
        ),
        _s("explicit-scale", dtype, **h, dim=32, lengths=[20, 45], scale=0.3),
        # max_seq_len above the longest sequence: silu divides by the argument, not the longest.
        _s("silu", dtype, **h, dim=32, lengths=[5, 0, 37, 64, 1, 18], activation="silu", max_seq_len=80),
        _s(
            "silu-targets-bias",
            dtype,
            **h,
            dim=16,
            lengths=[40, 9, 0, 27],
            activation="silu",
            max_targets=5,
            random_targets=True,
            rel_bias=True,
            with_lse=True,
        ),
        _s("silu-non-causal", dtype, **h, dim=32, lengths=[31, 6], activation="silu", causal=False),
        _s("d128", dtype, **h, dim=128, lengths=[37, 5, 64, 0, 130]),
        _s(
            "d128-silu-targets-bias",
            dtype,
            **h,
            dim=128,
            lengths=[50, 1, 77],
            activation="silu",
            max_targets=8,
            rel_bias=True,
        ),
    )


CHECK_SHAPES = scale_drawn(
    (
        *_check_shapes("fp32"),
        *_check_shapes("bf16"),
        *(s for s in _check_shapes("fp16") if s.name in ("mixed-d32", "silu-targets-bias")),
    )
)

_H = {"heads": workload.ATTENTION_HEADS, "dim": workload.ATTENTION_HEAD_DIM}
_SMALL_BATCH, _LARGE_BATCH = workload.HSTU_BATCH
_SHORT, _LONG = workload.HSTU_MAX_LEN
TIMING_SHAPES = (
    _s("b512-n1024-uniform-softmax", "bf16", **_H, num_seqs=_LARGE_BATCH, dist="uniform", max_len=_SHORT),
    _s("b256-n4096-power-softmax", "bf16", **_H, num_seqs=_SMALL_BATCH, dist="power", max_len=_LONG),
    # Training forms (the statistics asked for, as a training step's forward is called): a
    # kernel serves training in a bucket only where these show it is not slower there.
    _s(
        "b256-n1024-uniform-softmax-targets-bias-train",
        "bf16",
        **_H,
        num_seqs=_SMALL_BATCH,
        dist="uniform",
        max_len=_SHORT,
        max_targets=workload.TRAINING_TARGETS,
        rel_bias=True,
        with_lse=True,
    ),
    _s(
        "b256-n4096-power-softmax-train",
        "bf16",
        **_H,
        num_seqs=_SMALL_BATCH,
        dist="power",
        max_len=_LONG,
        with_lse=True,
    ),
    _s(
        "b256-n4096-uniform-silu",
        "bf16",
        **_H,
        num_seqs=_SMALL_BATCH,
        dist="uniform",
        max_len=_LONG,
        activation="silu",
    ),
    # The HSTU training layer: pointwise attention, relative bias, 32 targets per user.
    _s(
        "b512-n4096-power-silu-targets-bias",
        "bf16",
        **_H,
        num_seqs=_LARGE_BATCH,
        dist="power",
        max_len=_LONG,
        activation="silu",
        max_targets=workload.TRAINING_TARGETS,
        rel_bias=True,
    ),
    _s(
        "b256-n8192-power-softmax",
        "bf16",
        **_H,
        num_seqs=_SMALL_BATCH,
        dist="power",
        max_len=workload.HSTU_LONG_MAX_LEN,
    ),
)

# Interpreted Triton runs a few thousand elements per second: this only shows the path works.
INTERPRETED_TIMING_SHAPES = (
    _s("interp-b4-n64-power", "fp32", heads=2, dim=32, num_seqs=4, dist="power", max_len=64),
)

PROBLEM = Problem(
    name="jagged_attention",
    op_family="attention",
    entry=ENTRY,
    signature=(
        "jagged_attention(q: Tensor[T, H, D], k: Tensor[T, H, D], v: Tensor[T, H, Dv], "
        "offsets: int32|int64 Tensor[B + 1], *, max_seq_len: int, "
        "activation: 'softmax' | 'silu' = 'softmax', causal: bool = True, "
        "num_targets: int Tensor[B] | None = None, rel_bias: Tensor[H, num_buckets] | None = None, "
        "scale: float | None = None, return_lse: bool = False) -> Tensor[T, H, Dv], or with return_lse "
        "(out, lse fp32 Tensor[H, T])"
    ),
    description=__doc__,
    check_shapes=CHECK_SHAPES,
    timing_shapes=TIMING_SHAPES,
    interpreted_timing_shapes=INTERPRETED_TIMING_SHAPES,
    tolerances=TOLERANCES,
    error_scale=softmax_error_scale,
    # The loop reference (and its compile, one graph per sequence length) takes minutes here.
    campaign_baselines=("torch.padded",),
    compile_reference=compiled_reference,
    make_inputs=make_inputs,
    reference=jagged_attention_reference,
    baselines={"torch.padded": torch_padded},
    shape_baselines={"torch.flex_attention": ShapeBaseline(fn=torch_flex, applies=_softmax_shape)},
    flops=flops,
    bytes=bytes_moved,
    bucket=bucket,
    template="jagged_attention",
    forbidden_ops=FORBIDDEN_OPS,
    screen_extras=SCREEN_EXTRAS,
    statistics=SOFTMAX_LSE,
)

TEMPLATE = tile_template("jagged_attention")


# --- the op ------------------------------------------------------------------------------------


def _fake(q, k, v, offsets, *, max_seq_len, activation="softmax", causal=True, num_targets=None,
          rel_bias=None, scale=None, return_lse=False):  # fmt: skip
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    if not return_lse:
        return out
    lse_shape = (q.shape[1], q.shape[0]) if activation == "softmax" else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


def _call_bucket(q, k, v, offsets, *, max_seq_len, activation="softmax", causal=True, num_targets=None,
                 rel_bias=None, scale=None) -> str:  # fmt: skip
    return bucket_of(q.shape[-1], max_seq_len)


def call_cost(
    q,
    k,
    v,
    offsets,
    *,
    max_seq_len,
    activation="softmax",
    causal=True,
    num_targets=None,
    rel_bias=None,
    scale=None,
) -> tuple[float, float]:
    """The call's allowed pairs (read from its offsets: a profile's, which may sync)."""
    n = (offsets[1:] - offsets[:-1]).long()
    t = torch.zeros_like(n) if num_targets is None else torch.minimum(num_targets.long(), n)
    n_hist = n - t
    history = n_hist * (n_hist + 1) // 2 if causal else n_hist * n_hist
    pairs = float((history + t * (n_hist + 1)).sum())
    return attention_cost(pairs, 4 * q.shape[0], q.shape[1], q.shape[2], q.element_size())


OP = Op(
    cost=call_cost,
    name="jagged_attention",
    problem=PROBLEM,
    default="kernels.attention:jagged_attention_forward",
    check="kernels.attention_ops:check_jagged_attention",
    prepare=prepare_scale,
    fake=_fake,
    bucket=_call_bucket,
    bounds=("max_seq_len",),
    saves_statistics=softmax_saves_statistics,
    backward=Backward(gradient_op="jagged_attention_grad", differentiable=("q", "k", "v", "rel_bias")),
    reference_options=("attend",),
    doc="""Self-attention over jagged sequences (HSTU encoder; search_space.attention has the math).

    q, k, v [total_tokens, H, D] (bf16, fp16 or fp32; D a power of two, 16 to 256); offsets
    [B + 1] int32/int64 from 0 to total_tokens; max_seq_len >= every sequence length (it sizes
    the launch, so it is not checked: that would sync the host; silu divides by it);
    activation 'softmax' or 'silu'; num_targets [B]: the last num_targets[b] tokens of sequence
    b are candidates that see the history and themselves only; rel_bias [H, num_buckets] fp32
    relative-position bias; scale defaults to D ** -0.5 -> out [total_tokens, H, D].
    Differentiable in q, k, v and rel_bias.
    """,
)
