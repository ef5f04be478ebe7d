"""Request-broadcast target attention: every candidate of a ranking request attends, through its
S query seeds, to the request's user history, which is stored once per request and never copied
per candidate (request-oriented inference).

    out[c, s] = attend(q_cand[c, s], K/V of request cand_to_request[c])
    softmax: softmax over the history;  silu: sum_j silu(scale * q . k_j) v_j (no normalization)

q_cand [C, S, H, D]; k, v [T, H, D] with kv_offsets [R + 1]; cand_to_request [C] in any order
(a request may have no candidates; an empty history gives zeros). The math is
search_space/attention.py's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from search_space import workload
from search_space.attention import (
    check_target_bounds,
    compiled_reference,
    dense_attention,
    target_attention_reference,
)
from search_space.attention_common import (
    DENSE_BUDGET,
    FORBIDDEN_OPS,
    REFERENCE_BUDGET,
    SCREEN_EXTRAS,
    SOFTMAX_LSE,
    TOLERANCES,
    IndexCache,
    attention_cost,
    block_mask,
    bucket,
    call_bucket,
    dense_pointwise,
    draw_lengths,
    drawn_scale,
    element_bytes,
    flex,
    from_quantiles,
    index_bytes,
    index_dtype,
    launch_bound,
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
    with_statistics,
)
from search_space.op import Backward, Op
from search_space.problem import Inputs, Problem, Shape, ShapeBaseline

ENTRY = "target_attention"


def reference(
    q_cand: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    *,
    activation: str = "softmax",
    scale: float | None = None,
    max_candidates: int | None = None,
    max_history: int | None = None,
    return_lse: bool = False,
    attend: Callable[..., torch.Tensor] = dense_attention,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """attention.py's reference, called on groups of candidates small enough that its fp32 score
    tensor stays under REFERENCE_BUDGET elements (2048 candidates x 32 seeds over a 16k history
    would be 17 GB at once). Candidates are independent, so the result is the same. `attend`: as
    search_space.attention's."""
    # The bounds hold for the whole batch, which a group of candidates does not show: checked here.
    check_target_bounds(kv_offsets, cand_to_request, max_candidates, max_history)
    num_cand, seeds, heads, _ = q_cand.shape
    longest = int((kv_offsets[1:] - kv_offsets[:-1]).max()) if kv_offsets.numel() > 1 else 0
    step = max(1, REFERENCE_BUDGET // max(seeds * heads * longest, 1))
    options = dict(activation=activation, scale=scale, return_lse=return_lse, attend=attend)
    if step >= num_cand:
        return target_attention_reference(q_cand, k, v, kv_offsets, cand_to_request, **options)
    parts = [
        target_attention_reference(
            q_cand[c : c + step], k, v, kv_offsets, cand_to_request[c : c + step], **options
        )
        for c in range(0, num_cand, step)
    ]
    if not return_lse:
        return torch.cat(parts)
    # Rows are candidate-major, so each group's statistics are a contiguous range of columns.
    lse = [part[1] for part in parts]
    return torch.cat([part[0] for part in parts]), torch.cat(lse, dim=1) if lse[0].numel() else lse[0]


def _candidates_per_request(params, num_requests: int) -> list[int]:
    if "cands" in params:
        return list(params["cands"])
    return [params["cands_per_request"]] * num_requests


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    """Params: heads, dim, seeds; histories `lengths` or num_requests + dist + max_len
    (+ min_frac, sampled); candidates `cands` (per request) or cands_per_request; shuffle
    (candidates not grouped by request), activation, scale, index_dtype (of kv_offsets and
    cand_to_request); with_lse (the call asks for the statistics, see SOFTMAX_LSE)."""
    p = shape.params
    gen = torch.Generator(device=device).manual_seed(seed)
    lengths = draw_lengths(p, gen, device, count_key="num_requests")
    if from_quantiles(p):
        (lengths,) = permuted([lengths], gen, device)
    cands = _candidates_per_request(p, len(lengths))
    if len(cands) != len(lengths):
        raise ValueError(f"{shape.name}: {len(cands)} candidate counts for {len(lengths)} requests")
    requests = [r for r, count in enumerate(cands) for _ in range(count)]
    if p.get("shuffle") and requests:
        (requests,) = permuted([requests], gen, device)
    heads, dim, dtype, idx = p["heads"], p["dim"], shape.torch_dtype, index_dtype(p)
    q_cand = randn((len(requests), p["seeds"], heads, dim), gen, device, dtype)
    k, v = (randn((sum(lengths), heads, dim), gen, device, dtype) for _ in range(2))
    args = (
        q_cand,
        k,
        v,
        offsets_of(lengths, idx, device),
        torch.tensor(requests, dtype=idx, device=device),
    )
    kwargs = {"activation": p.get("activation", "softmax"), "scale": drawn_scale(p, seed, dim)}
    kwargs["max_candidates"] = launch_bound({}, cands, seed)
    kwargs["max_history"] = launch_bound(p, lengths, seed)
    return Inputs(args=args, kwargs=with_statistics(kwargs, p))


# --- roofline counts ------------------------------------------------------------------------


def _num_requests(params) -> int:
    return len(params["lengths"]) if "lengths" in params else params["num_requests"]


def expected_pairs(shape: Shape) -> float:
    """(query, key) pairs: every seed of every candidate with every key of its request's
    history. Exact for listed lengths and for equal candidate counts per request (the timing
    shapes); with unequal counts over random or permuted lengths, the expectation."""
    p = shape.params
    weights = length_weights(p, count_key="num_requests")
    cands = _candidates_per_request(p, _num_requests(p))
    if "lengths" in p:
        return p["seeds"] * sum(c * n for c, (n, _) in zip(cands, weights, strict=True))
    mean_length = sum(w * n for n, w in weights) / max(sum(w for _, w in weights), 1)
    return p["seeds"] * sum(cands) * mean_length


def flops(shape: Shape) -> float:
    """Useful forward FLOPs: per pair and head, 2 D for q.k and 2 D for p * v."""
    p = shape.params
    return expected_pairs(shape) * p["heads"] * 4 * p["dim"]


def bytes_moved(shape: Shape) -> float:
    """Minimum traffic: each history's k and v read once per request (not per candidate), the
    queries read and the output written once, offsets and the candidate map read."""
    p = shape.params
    num_requests = _num_requests(p)
    num_cand = sum(_candidates_per_request(p, num_requests))
    history = sum(w * n for n, w in length_weights(p, count_key="num_requests"))
    rows = 2 * num_cand * p["seeds"] + 2 * history
    return rows * p["heads"] * p["dim"] * element_bytes(shape) + (num_requests + 1 + num_cand) * index_bytes(
        p
    )


# --- baselines ------------------------------------------------------------------------------


def torch_padded(
    q_cand: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    *,
    activation: str = "softmax",
    scale: float | None = None,
    max_candidates: int | None = None,  # the caller's bounds, unused here
    max_history: int | None = None,
) -> torch.Tensor:
    """Per-request padded attention, the strongest plain PyTorch way: the seeds of a request's
    candidates become one query block [R, H, max_cands * S, D] against its padded history
    [R, H, max_len, D], so each history is read once per request, as in the kernel, but every
    request is padded to the largest. Softmax: SDPA, on FlashAttention when every history has
    max_len keys (one request: the serving case), else with a key mask; silu: eager products
    (zero keys add silu(0) = 0). An empty history keeps its first (zero) key unmasked: output 0.
    Grouping, padding and ungrouping are inside the call."""
    num_cand, seeds, heads, dim = q_cand.shape
    scale = dim**-0.5 if scale is None else scale
    num_req = kv_offsets.numel() - 1
    if num_cand == 0 or k.shape[0] == 0:
        return q_cand.new_zeros(num_cand, seeds, heads, v.shape[-1])
    lengths = kv_offsets[1:] - kv_offsets[:-1]
    req = cand_to_request.long()
    counts = torch.bincount(req, minlength=num_req)
    order = torch.argsort(req, stable=True)
    rank = torch.empty_like(req)
    rank[order] = torch.arange(num_cand, device=req.device) - (torch.cumsum(counts, 0) - counts)[req[order]]
    max_cands, max_len = int(counts.max()), int(lengths.max())
    q_p = q_cand.new_zeros(num_req, max_cands, seeds, heads, dim)
    q_p[req, rank] = q_cand
    q_p = q_p.view(num_req, max_cands * seeds, heads, dim).transpose(1, 2)
    kseq, kpos = token_positions(kv_offsets, k.shape[0])
    k_p, v_p = (pad(x, kseq, kpos, num_req, max_len) for x in (k, v))
    if activation == "softmax":
        mask = None
        if not bool((lengths == max_len).all()):
            keys = torch.arange(max_len, device=k.device)
            mask = (keys < lengths[:, None]) | (keys == 0)  # [R, max_len]
            mask = mask[:, None, None, :]
        out = sdpa(q_p, k_p, v_p, scale=scale, attn_mask=mask)
    else:
        out = dense_pointwise(q_p, k_p, v_p, activation=activation, scale=scale)
    out = out.transpose(1, 2).reshape(num_req, max_cands, seeds, heads, -1)
    return out[req, rank]


def torch_replicate_kv(
    q_cand: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    *,
    activation: str = "softmax",
    scale: float | None = None,
    max_candidates: int | None = None,  # the caller's bounds, unused here
    max_history: int | None = None,
) -> torch.Tensor:
    """Replicate-then-attend, what the in-kernel broadcast avoids: every candidate gets its own
    copy of its request's history, [C, H, max_len, D] (a gather inside the call), then attends
    with SDPA (softmax) or eager products (silu). The copies are made a bounded chunk of
    candidates at a time: the same traffic as one C-fold copy, without its memory (64 GiB for
    2048 candidates over a 16k history). Missing keys gather a zero row (unmasked only for an
    empty history, whose output is then 0)."""
    num_cand, seeds, heads, dim = q_cand.shape
    scale = dim**-0.5 if scale is None else scale
    total = k.shape[0]
    if num_cand == 0 or total == 0:
        return q_cand.new_zeros(num_cand, seeds, heads, v.shape[-1])
    lengths = kv_offsets[1:] - kv_offsets[:-1]
    req = cand_to_request.long()
    cand_len = lengths[req]
    max_len = int(lengths.max())
    keys = torch.arange(max_len, device=k.device)
    valid = keys < cand_len[:, None]  # [C, max_len]
    rows = torch.where(valid, kv_offsets[req].long()[:, None] + keys, total)  # `total`: the zero row
    # Head-major [H, T + 1, D] with a zero row last: each chunk's copy is gathered straight into a
    # contiguous [H, c, max_len, D], which both SDPA and the products read without another copy
    # (the dims are (batch, heads) = (H, c) to them, the same math).
    k_z, v_z = (torch.cat([x, x.new_zeros(1, heads, x.shape[-1])]).transpose(0, 1) for x in (k, v))
    full = bool(valid.all())
    step = max(1, DENSE_BUDGET // (max_len * heads * dim))
    pieces = []
    for c0 in range(0, num_cand, step):
        cs = slice(c0, min(c0 + step, num_cand))
        k_rep, v_rep = (x[:, rows[cs]] for x in (k_z, v_z))  # [H, c, max_len, D]
        q_c = q_cand[cs].permute(2, 0, 1, 3)  # [H, c, S, D]
        if activation == "softmax":
            mask = None if full else (valid[cs] | (keys == 0))[None, :, None, :]
            out = sdpa(q_c, k_rep, v_rep, scale=scale, attn_mask=mask)
        else:
            out = dense_pointwise(q_c, k_rep, v_rep, activation=activation, scale=scale)
        pieces.append(out.permute(1, 2, 0, 3))  # [c, S, H, Dv]
    return torch.cat(pieces)


_BLOCK_MASKS = IndexCache()


def _block_mask(kv_offsets: torch.Tensor, cand_to_request: torch.Tensor, seeds: int, total_kv: int):
    kseq, _ = token_positions(kv_offsets, total_kv)
    q_table = padded_table(cand_to_request.long().repeat_interleave(seeds), -1)
    k_table = padded_table(kseq, -2)

    def mask_mod(b, h, q_idx, kv_idx):
        return q_table[q_idx] == k_table[kv_idx]

    return block_mask(mask_mod, cand_to_request.numel() * seeds, total_kv, kv_offsets.device)


def torch_flex(
    q_cand: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    *,
    activation: str = "softmax",
    scale: float | None = None,
    max_candidates: int | None = None,  # the caller's bounds, unused here
    max_history: int | None = None,
) -> torch.Tensor:
    """flex_attention of all seeds [1, H, C * S, D] against the packed histories [1, H, T, D],
    a block mask pairing each candidate with its request's keys (histories are not copied).
    The mask depends only on kv_offsets and cand_to_request, which a serving batch has once for
    all its layers: built outside the timed call, at the first call with these tensors (see
    IndexCache). Softmax only: flex_attention always normalizes. An empty history is a fully
    masked row, which flex_attention returns as zeros."""
    if activation != "softmax":
        raise ValueError(f"flex_attention computes softmax attention only, not {activation!r}")
    num_cand, seeds, heads, dim = q_cand.shape
    total = k.shape[0]
    if num_cand == 0 or total == 0:
        return q_cand.new_zeros(num_cand, seeds, heads, v.shape[-1])
    mask = _BLOCK_MASKS.get(
        (kv_offsets, cand_to_request),
        (seeds, total),
        lambda: _block_mask(kv_offsets, cand_to_request, seeds, total),
    )
    q4 = q_cand.reshape(num_cand * seeds, heads, dim).transpose(0, 1).unsqueeze(0)
    k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))
    out = flex(q4, k4, v4, block_mask=mask, scale=scale)
    return out[0].transpose(0, 1).reshape(num_cand, seeds, heads, -1)


def _softmax_shape(shape: Shape) -> bool:
    return shape.params.get("activation", "softmax") == "softmax"


# --- shapes ---------------------------------------------------------------------------------


_s = Shape.of


def _check_shapes(dtype: str) -> tuple[Shape, ...]:
    h = {"heads": 2}
    return (
        _s(
            "mixed-softmax",
            dtype,
            **h,
            dim=32,
            seeds=4,
            lengths=[30, 0, 7, 65],
            cands=[3, 2, 1, 4],
            with_lse=True,
        ),
        _s(
            "unsorted-silu",
            dtype,
            **h,
            dim=32,
            seeds=3,
            lengths=[12, 50, 1],
            cands=[4, 1, 3],
            shuffle=True,
            activation="silu",
            with_lse=True,
        ),
        _s(
            "empty-histories",
            dtype,
            **h,
            dim=16,
            seeds=2,
            lengths=[0, 0, 9],
            cands=[2, 1, 2],
            shuffle=True,
            with_lse=True,
        ),
        _s(
            "requests-without-candidates",
            dtype,
            **h,
            dim=16,
            seeds=5,
            lengths=[5, 40, 17, 3],
            cands=[0, 3, 0, 2],
            activation="silu",
        ),
        _s("no-candidates", dtype, **h, dim=16, seeds=4, lengths=[6, 2], cands=[0, 0]),
        _s("no-requests", dtype, **h, dim=16, seeds=4, lengths=[], cands=[], with_lse=True),
        _s("one-seed-one-key", dtype, **h, dim=32, seeds=1, lengths=[1, 1], cands=[1, 2]),
        _s(
            "int32-indices",
            dtype,
            **h,
            dim=32,
            seeds=3,
            lengths=[20, 33],
            cands=[2, 2],
            shuffle=True,
            index_dtype="int32",
        ),
        _s("long-history", dtype, **h, dim=32, seeds=2, lengths=[300, 2, 4], cands=[1, 2, 2]),
        _s(
            "explicit-scale-silu",
            dtype,
            **h,
            dim=32,
            seeds=3,
            lengths=[17, 9],
            cands=[2, 2],
            scale=0.3,
            activation="silu",
        ),
        _s(
            "sampled-uniform",
            dtype,
            **h,
            dim=32,
            seeds=4,
            num_requests=4,
            cands_per_request=3,
            dist="uniform",
            max_len=60,
            min_frac=0.2,
            sampled=True,
            shuffle=True,
        ),
        _s("d128-softmax", dtype, **h, dim=128, seeds=4, lengths=[37, 0, 80], cands=[2, 2, 1], shuffle=True),
        _s("d128-silu", dtype, **h, dim=128, seeds=8, lengths=[64, 5], cands=[3, 1], activation="silu"),
    )


CHECK_SHAPES = scale_drawn(
    (
        *_check_shapes("fp32"),
        *_check_shapes("bf16"),
        *(s for s in _check_shapes("fp16") if s.name in ("mixed-softmax", "unsorted-silu")),
    )
)

_H = {"heads": workload.ATTENTION_HEADS, "dim": workload.ATTENTION_HEAD_DIM}
_FEW_SEEDS, _MANY_SEEDS = workload.TARGET_SEEDS
_SHORTEST, _LONGEST = workload.TARGET_HISTORY
_SERVING = {
    **_H,
    "num_requests": workload.SERVING_REQUESTS,
    "cands_per_request": workload.SERVING_CANDIDATES_PER_REQUEST,
    "dist": "uniform",
    "max_len": _LONGEST,
    "min_frac": _SHORTEST / _LONGEST,
}
TIMING_SHAPES = (
    _s("r15-c70-s32-h2000-softmax", "bf16", **_SERVING, seeds=_FEW_SEEDS),
    # The training form (the statistics asked for, as a training step's forward is called): a
    # kernel serves training in a bucket only where this shows it is not slower there.
    _s("r15-c70-s32-h2000-softmax-train", "bf16", **_SERVING, seeds=_FEW_SEEDS, with_lse=True),
    _s("r15-c70-s256-h2000-softmax", "bf16", **_SERVING, seeds=_MANY_SEEDS),
    _s("r15-c70-s128-h2000-silu", "bf16", **_SERVING, seeds=128, activation="silu"),
    # One request ranking 2048 candidates over a long history.
    _s(
        "r1-c2048-s32-h16k-softmax",
        "bf16",
        **_H,
        num_requests=1,
        cands_per_request=workload.SERVING_ONE_REQUEST_CANDIDATES,
        dist="fixed",
        max_len=workload.SERVING_LONG_HISTORY,
        seeds=_FEW_SEEDS,
    ),
)

# Interpreted Triton runs a few thousand elements per second: this only shows the path works.
INTERPRETED_TIMING_SHAPES = (
    _s(
        "interp-r2-c3-s4-h40",
        "fp32",
        heads=2,
        dim=32,
        seeds=4,
        num_requests=2,
        cands_per_request=3,
        dist="uniform",
        max_len=40,
        min_frac=0.5,
    ),
)

PROBLEM = Problem(
    name="target_attention",
    op_family="attention",
    entry=ENTRY,
    signature=(
        "target_attention(q_cand: Tensor[C, S, H, D], k: Tensor[T, H, D], v: Tensor[T, H, Dv], "
        "kv_offsets: int32|int64 Tensor[R + 1], cand_to_request: int32|int64 Tensor[C], *, "
        "activation: 'softmax' | 'silu' = 'softmax', scale: float | None = None, "
        "max_candidates: int | None = None (>= any request's candidates), max_history: int | None = "
        "None (>= every history; launch from the bounds where given, with no host sync), "
        "return_lse: bool = False) -> Tensor[C, S, H, Dv], or with return_lse (out, lse fp32 "
        "Tensor[H, C * S])"
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
    reference=reference,
    baselines={"torch.padded": torch_padded, "torch.replicate_kv": torch_replicate_kv},
    shape_baselines={"torch.flex_attention": ShapeBaseline(fn=torch_flex, applies=_softmax_shape)},
    flops=flops,
    bytes=bytes_moved,
    bucket=bucket,
    template="target_attention",
    forbidden_ops=FORBIDDEN_OPS,
    screen_extras=SCREEN_EXTRAS,
    statistics=SOFTMAX_LSE,
)

TEMPLATE = tile_template("target_attention")


# --- the op ------------------------------------------------------------------------------------


def _fake(q_cand, k, v, kv_offsets, cand_to_request, *, activation="softmax", return_lse=False, **options):
    num_cand, seeds, heads, _ = q_cand.shape
    out = q_cand.new_empty((num_cand, seeds, heads, v.shape[2]))
    if not return_lse:
        return out
    lse_shape = (heads, num_cand * seeds) if activation == "softmax" else (0,)
    return out, q_cand.new_empty(lse_shape, dtype=torch.float32)


def _call_bucket(q_cand, k, v, kv_offsets, cand_to_request, *, activation="softmax", scale=None,
                 max_candidates=None, max_history=None) -> str:  # fmt: skip
    return call_bucket(q_cand.shape[-1], max_history, kv_offsets)


def call_cost(
    q_cand,
    k,
    v,
    kv_offsets,
    cand_to_request,
    *,
    activation="softmax",
    scale=None,
    max_candidates=None,
    max_history=None,
) -> tuple[float, float]:
    """Every candidate's seeds against its request's history (read from the offsets)."""
    lengths = (kv_offsets[1:] - kv_offsets[:-1]).long()
    seeds = q_cand.shape[1]
    pairs = float(lengths[cand_to_request.long()].sum()) * seeds
    flops, _ = attention_cost(pairs, 0, q_cand.shape[2], q_cand.shape[3], q_cand.element_size())
    elem = q_cand.element_size()
    moved = 2 * q_cand.numel() * elem + (k.numel() + v.numel()) * elem
    return flops, float(moved)


OP = Op(
    cost=call_cost,
    name="target_attention",
    problem=PROBLEM,
    default="kernels.attention:target_attention_forward",
    check="kernels.attention_ops:check_target_attention",
    prepare=prepare_scale,
    fake=_fake,
    bucket=_call_bucket,
    bounds=("max_candidates", "max_history"),
    saves_statistics=softmax_saves_statistics,
    backward=Backward(gradient_op="target_attention_grad", differentiable=("q_cand", "k", "v")),
    # Without Triton, the math as it is: the problem's reference checks the bounds against the
    # data and splits the candidates into groups, which the sandbox's big timing shapes need.
    reference=target_attention_reference,
    reference_options=("attend",),
    doc="""Request-broadcast target attention: every seed of candidate c attends to the history of
    request cand_to_request[c], which is never copied per candidate.

    q_cand [C, S, H, D]; k, v [total_kv, H, D] with kv_offsets [R + 1] (request r's history is
    rows kv_offsets[r]:kv_offsets[r + 1]); cand_to_request [C] in [0, R), in any order;
    activation 'softmax' or 'silu' (unnormalised) -> out [C, S, H, D]; an empty history gives
    zeros. Differentiable in q_cand, k and v.

    The Triton path syncs the host once per forward and once per backward (checking the inputs,
    grouping the candidates by request and sizing the launch). Given max_candidates (>= the
    candidates of any one request) and max_history (>= every history length), the default
    kernels sync never and check nothing on the device (like jagged_attention's max_seq_len,
    the bounds are trusted), so the call can be captured in a CUDA graph.
    """,
)
