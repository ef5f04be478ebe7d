"""GDPA, generalized dot-product attention: pointwise-activated attention without normalization,
over jagged sequences of samples (self-attention), jagged queries against jagged keys (cross
attention), or a set of learned query seeds shared by every sample (broadcast_q).

    out_i = sum_{j in the key sequence of i} act(scale * q_i . k_j) v_j,   act in gelu|silu|relu|none

q [Tq, H, D] with q_offsets [B + 1], or q [n_q, H, D] with broadcast_q (output [B * n_q, H, Dv],
sample b's rows b * n_q:(b + 1) * n_q); k, v [Tk, H, D] with kv_offsets [B + 1]. An empty query
or key sequence gives no rows or zero rows. The math is search_space/attention.py's.
"""

from __future__ import annotations

import torch

from search_space import workload
from search_space.attention import compiled_reference, gdpa_reference
from search_space.attention_common import (
    FORBIDDEN_OPS,
    SCREEN_EXTRAS,
    TOLERANCES,
    attention_cost,
    bucket,
    call_bucket,
    dense_pointwise,
    draw_lengths,
    drawn_scale,
    element_bytes,
    from_quantiles,
    index_bytes,
    index_dtype,
    launch_bound,
    length_weights,
    offsets_of,
    pad,
    permuted,
    randn,
    scale_drawn,
    softmax_error_scale,
    tile_template,
    token_positions,
    unpad,
)
from search_space.op import Backward, Op
from search_space.problem import Inputs, Problem, Shape

ENTRY = "gdpa"
MODES = ("self", "cross", "broadcast")


def _mode(shape: Shape) -> str:
    mode = shape.params.get("mode", "self")
    if mode not in MODES:
        raise ValueError(f"unknown gdpa mode {mode!r}; known: {', '.join(MODES)}")
    return mode


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    """Params: heads, dim, mode (self | cross | broadcast), activation, optional scale and
    index_dtype. Key lengths: `lengths` or num_seqs + dist + max_len (+ min_frac, sampled);
    cross queries: `q_lengths` or q_dist + q_max_len (+ q_min_frac); self: the key lengths;
    broadcast: n_q seeds. Quantile lengths of queries and keys share one random order, so the
    i-th shortest query sequence meets the i-th shortest key sequence and the FLOPs are exact."""
    p = shape.params
    mode = _mode(shape)
    gen = torch.Generator(device=device).manual_seed(seed)
    kv_lengths = draw_lengths(p, gen, device)
    q_lengths = draw_lengths(p, gen, device, prefix="q_") if mode == "cross" else list(kv_lengths)
    if from_quantiles(p):
        kv_lengths, q_lengths = permuted([kv_lengths, q_lengths], gen, device)
    heads, dim, dtype, idx = p["heads"], p["dim"], shape.torch_dtype, index_dtype(p)
    broadcast = mode == "broadcast"
    q = randn((p["n_q"] if broadcast else sum(q_lengths), heads, dim), gen, device, dtype)
    k, v = (randn((sum(kv_lengths), heads, dim), gen, device, dtype) for _ in range(2))
    q_offsets = None if broadcast else offsets_of(q_lengths, idx, device)
    kwargs = {"activation": p.get("activation", "gelu"), "scale": drawn_scale(p, seed, dim)}
    kwargs["broadcast_q"] = broadcast
    kwargs["max_q_len"] = (
        None if broadcast else launch_bound(p, q_lengths, seed, prefix="q_" if mode == "cross" else "")
    )
    kwargs["max_kv_len"] = launch_bound(p, kv_lengths, seed)
    return Inputs(args=(q, k, v, q_offsets, offsets_of(kv_lengths, idx, device)), kwargs=kwargs)


# --- roofline counts ------------------------------------------------------------------------


def expected_pairs(shape: Shape) -> float:
    """(query, key) pairs of a batch: exact for listed or quantile lengths, the expectation over
    random lengths otherwise."""
    p = shape.params
    kv = length_weights(p)
    num_seqs = sum(w for _, w in kv)
    mode = _mode(shape)
    if mode == "self":
        return sum(w * n * n for n, w in kv)
    if mode == "broadcast":
        return p["n_q"] * sum(w * n for n, w in kv)
    q = length_weights(p, prefix="q_")
    if p.get("sampled"):  # independent draws
        return sum(w * n for n, w in q) * sum(w * n for n, w in kv) / max(num_seqs, 1)
    return sum(nq * nk for (nq, _), (nk, _) in zip(q, kv, strict=True))


def _tokens(shape: Shape) -> tuple[float, float, float]:
    """(query rows in, output rows, key rows) of a batch."""
    p = shape.params
    kv = length_weights(p)
    keys = sum(w * n for n, w in kv)
    mode = _mode(shape)
    if mode == "broadcast":
        return p["n_q"], p["n_q"] * sum(w for _, w in kv), keys
    queries = keys if mode == "self" else sum(w * n for n, w in length_weights(p, prefix="q_"))
    return queries, queries, keys


def flops(shape: Shape) -> float:
    """Useful forward FLOPs: per (query, key) pair and head, 2 D for q.k and 2 D for act * v
    (the activation is not counted)."""
    p = shape.params
    return expected_pairs(shape) * p["heads"] * 4 * p["dim"]


def bytes_moved(shape: Shape) -> float:
    """Minimum traffic: q (the shared seeds once), k and v read once, the output written once,
    the offsets read."""
    p = shape.params
    q_rows, out_rows, kv_rows = _tokens(shape)
    num_seqs = sum(w for _, w in length_weights(p))
    total = (q_rows + out_rows + 2 * kv_rows) * p["heads"] * p["dim"] * element_bytes(shape)
    num_offsets = 1 if _mode(shape) == "broadcast" else 2
    return total + num_offsets * (num_seqs + 1) * index_bytes(p)


# --- baselines ------------------------------------------------------------------------------


def torch_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor,
    *,
    activation: str = "gelu",
    scale: float | None = None,
    broadcast_q: bool = False,
    max_q_len: int | None = None,  # the caller's bounds: the padded sizes come from the offsets
    max_kv_len: int | None = None,
) -> torch.Tensor:
    """Padded dense GDPA: pad queries and keys to the batch's longest sequences, materialize the
    activated scores (a bounded chunk at a time), multiply by V, unpad; all inside the call. The
    padded sizes need the longest lengths on the host (one synchronization, as a padding op
    needs). Exact without a mask: a zero key scores 0, act(0) = 0 for every activation here, and
    its value is zero too; padded query rows are dropped."""
    num_seqs = kv_offsets.numel() - 1
    heads, dim = q.shape[1], q.shape[2]
    scale = dim**-0.5 if scale is None else scale
    total_q = num_seqs * q.shape[0] if broadcast_q else q.shape[0]
    if total_q == 0 or k.shape[0] == 0:
        return q.new_zeros(total_q, heads, v.shape[-1])
    kseq, kpos = token_positions(kv_offsets, k.shape[0])
    max_keys = int((kv_offsets[1:] - kv_offsets[:-1]).max())
    k_p, v_p = (pad(x, kseq, kpos, num_seqs, max_keys) for x in (k, v))
    if broadcast_q:
        q_p = q.transpose(0, 1).unsqueeze(0)  # [1, H, n_q, D], shared by every sample
        out = dense_pointwise(q_p, k_p, v_p, activation=activation, scale=scale)
        return out.transpose(1, 2).reshape(total_q, heads, -1)
    assert q_offsets is not None
    qseq, qpos = token_positions(q_offsets, total_q)
    q_p = pad(q, qseq, qpos, num_seqs, int((q_offsets[1:] - q_offsets[:-1]).max()))
    return unpad(dense_pointwise(q_p, k_p, v_p, activation=activation, scale=scale), qseq, qpos)


# --- shapes ---------------------------------------------------------------------------------


_s = Shape.of


def _check_shapes(dtype: str) -> tuple[Shape, ...]:
    h = {"heads": 2}
    return (
        _s("self-mixed-gelu", dtype, **h, dim=32, lengths=[5, 0, 1, 37, 16, 64, 3], activation="gelu"),
        _s("self-one-long-silu", dtype, **h, dim=16, lengths=[3, 1, 250, 2, 0], activation="silu"),
        # Empty queries against keys and queries against no keys.
        _s(
            "cross-relu",
            dtype,
            **h,
            dim=32,
            mode="cross",
            q_lengths=[4, 0, 19, 1, 33],
            lengths=[7, 5, 0, 1, 64],
            activation="relu",
        ),
        _s(
            "cross-sampled-none",
            dtype,
            **h,
            dim=32,
            mode="cross",
            num_seqs=6,
            q_dist="power",
            q_max_len=60,
            dist="uniform",
            max_len=40,
            min_frac=0.5,
            sampled=True,
            activation="none",
        ),
        _s("broadcast-gelu", dtype, **h, dim=32, mode="broadcast", n_q=7, lengths=[0, 3, 40, 1, 17]),
        _s(
            "broadcast-one-seed-silu",
            dtype,
            **h,
            dim=16,
            mode="broadcast",
            n_q=1,
            lengths=[9, 0, 2],
            activation="silu",
        ),
        _s(
            "self-int32-none",
            dtype,
            **h,
            dim=16,
            lengths=[17, 33, 65, 1],
            index_dtype="int32",
            activation="none",
        ),
        _s("no-sequences", dtype, **h, dim=16, lengths=[]),
        _s("broadcast-no-sequences", dtype, **h, dim=16, mode="broadcast", n_q=4, lengths=[]),
        _s("all-empty", dtype, **h, dim=16, lengths=[0, 0]),
        _s("explicit-scale", dtype, **h, dim=32, lengths=[20, 45], scale=0.3),
        _s("self-power", dtype, **h, dim=32, num_seqs=6, dist="power", max_len=70, activation="silu"),
        _s("d128-self-gelu", dtype, **h, dim=128, lengths=[37, 5, 64, 0, 130]),
        _s(
            "d128-broadcast-silu",
            dtype,
            **h,
            dim=128,
            mode="broadcast",
            n_q=32,
            lengths=[50, 0, 97],
            activation="silu",
        ),
    )


CHECK_SHAPES = scale_drawn(
    (
        *_check_shapes("fp32"),
        *_check_shapes("bf16"),
        *(s for s in _check_shapes("fp16") if s.name in ("self-mixed-gelu", "broadcast-gelu")),
    )
)

_H = {"heads": workload.ATTENTION_HEADS, "dim": workload.ATTENTION_HEAD_DIM, "num_seqs": workload.GDPA_BATCH}
_SHORT, _LONG = workload.GDPA_MAX_LEN
_FEW_SEEDS, _MANY_SEEDS = workload.GDPA_SEEDS


def _min_frac(sparsity: float) -> float:
    """Uniform lengths in [(2s - 1) N, N] have mean s N."""
    return 2 * sparsity - 1


TIMING_SHAPES = (
    _s(
        "self-b1024-n2048-s0.5-gelu",
        "bf16",
        **_H,
        dist="uniform",
        max_len=_LONG,
        min_frac=_min_frac(workload.GDPA_SPARSITY[0]),
        activation="gelu",
    ),
    _s("self-b1024-n512-s1.0-silu", "bf16", **_H, dist="fixed", max_len=512, activation="silu"),
    _s(
        "cross-b1024-q2048-s0.75-kv256-gelu",
        "bf16",
        **_H,
        mode="cross",
        q_dist="uniform",
        q_max_len=_LONG,
        q_min_frac=_min_frac(0.75),
        dist="fixed",
        max_len=workload.GDPA_CROSS_KV_LEN,
        activation="gelu",
    ),
    _s(
        "broadcast-b1024-seeds32-kv2048-s0.75-gelu",
        "bf16",
        **_H,
        mode="broadcast",
        n_q=_FEW_SEEDS,
        dist="uniform",
        max_len=_LONG,
        min_frac=_min_frac(0.75),
        activation="gelu",
    ),
    _s(
        "broadcast-b1024-seeds256-kv1024-s0.75-silu",
        "bf16",
        **_H,
        mode="broadcast",
        n_q=_MANY_SEEDS,
        dist="uniform",
        max_len=1024,
        min_frac=_min_frac(0.75),
        activation="silu",
    ),
)

# Interpreted Triton runs a few thousand elements per second: this only shows the path works.
INTERPRETED_TIMING_SHAPES = (
    _s(
        "interp-self-b4-n48-gelu",
        "fp32",
        heads=2,
        dim=32,
        num_seqs=4,
        dist="uniform",
        max_len=48,
        min_frac=0.5,
    ),
)

PROBLEM = Problem(
    name="gdpa",
    op_family="attention",
    entry=ENTRY,
    signature=(
        "gdpa(q: Tensor[Tq, H, D] (Tensor[n_q, H, D] with broadcast_q), k: Tensor[Tk, H, D], "
        "v: Tensor[Tk, H, Dv], q_offsets: int32|int64 Tensor[B + 1] | None, "
        "kv_offsets: int32|int64 Tensor[B + 1], *, activation: 'gelu' | 'silu' | 'relu' | 'none' = 'gelu', "
        "scale: float | None = None, broadcast_q: bool = False, max_q_len: int | None = None "
        "(>= every query sequence; None with broadcast_q), max_kv_len: int | None = None (>= every "
        "key sequence; launch from the bounds where given, with no host sync)) -> Tensor[Tq (B * n_q), H, Dv]"
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
    reference=gdpa_reference,
    baselines={"torch.padded": torch_padded},
    flops=flops,
    bytes=bytes_moved,
    bucket=bucket,
    template="gdpa",
    forbidden_ops=FORBIDDEN_OPS,
    screen_extras=SCREEN_EXTRAS,
)

TEMPLATE = tile_template("gdpa")


# --- the op ------------------------------------------------------------------------------------


def _prepare(q, k, v, q_offsets, kv_offsets, *, scale=None, broadcast_q=False, **options) -> dict:
    """The scale (as prepare_scale), and no q_offsets with broadcast_q (the kernels read none)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return {"scale": scale, "q_offsets": None} if broadcast_q else {"scale": scale}


def _fake(q, k, v, q_offsets, kv_offsets, *, broadcast_q=False, **options):
    rows = (kv_offsets.shape[0] - 1) * q.shape[0] if broadcast_q else q.shape[0]
    return q.new_empty((rows, q.shape[1], v.shape[2]))


def _call_bucket(q, k, v, q_offsets, kv_offsets, *, activation="gelu", scale=None, broadcast_q=False,
                 max_q_len=None, max_kv_len=None) -> str:  # fmt: skip
    return call_bucket(q.shape[-1], max_kv_len, kv_offsets)


def call_cost(
    q,
    k,
    v,
    q_offsets,
    kv_offsets,
    *,
    activation="gelu",
    scale=None,
    broadcast_q=False,
    max_q_len=None,
    max_kv_len=None,
) -> tuple[float, float]:
    """Each sample's queries against its keys (lengths read from the offsets)."""
    kv = (kv_offsets[1:] - kv_offsets[:-1]).long()
    queries = torch.full_like(kv, q.shape[0]) if broadcast_q else (q_offsets[1:] - q_offsets[:-1]).long()
    pairs = float((queries * kv).sum())
    flops, _ = attention_cost(pairs, 0, q.shape[1], q.shape[2], q.element_size())
    q_rows = int(queries.sum())
    moved = (2 * q_rows * q.shape[1] * q.shape[2] + k.numel() + v.numel()) * q.element_size()
    return flops, float(moved)


OP = Op(
    cost=call_cost,
    name="gdpa",
    problem=PROBLEM,
    default="kernels.attention:gdpa_forward",
    check="kernels.attention_ops:check_gdpa",
    prepare=_prepare,
    fake=_fake,
    bucket=_call_bucket,
    bounds=("max_q_len", "max_kv_len"),
    backward=Backward(gradient_op="gdpa_grad", differentiable=("q", "k", "v")),
    reference_options=("attend",),
    doc="""Generalized dot-product attention: out_i = sum_j act(scale q_i . k_j) v_j over the keys of
    query i's sequence (non-causal, no normalisation).

    q [total_q, H, D] with q_offsets [B + 1], or with broadcast_q learned seeds [n_q, H, D]
    shared by all samples (q_offsets ignored); k, v [total_kv, H, D] with kv_offsets [B + 1];
    activation 'gelu' (erf), 'silu', 'relu' or 'none' -> out [total_q, H, D] ([B * n_q, H, D]
    with broadcast_q). Differentiable in q, k and v.

    The Triton path syncs the host once per forward and once per backward (checking the offsets;
    the longest sequences size the launch). Given max_kv_len (>= every key sequence) and, unless
    broadcast_q, max_q_len (>= every query sequence), the default kernels sync never and check
    nothing on the device (the bounds are trusted), so the call can be captured in a CUDA graph.
    """,
)
