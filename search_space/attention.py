"""The attention family's math, in plain PyTorch: the single definition that kernels, problems,
benchmarks and tests are checked against.

Layout: jagged values `[total_tokens, heads, dim]` with `offsets [B + 1]` (int64 or int32);
sequence b holds rows `offsets[b]:offsets[b + 1]`. The references loop over sequences and build
each one's dense `[heads, n, n]` scores, so they are exact but never fast; they compute in fp32
(fp64 when given fp64) and return the input's dtype. Each takes `attend`, the dense attention
of one sequence (plain PyTorch unless given; `compiled_reference` passes a compiled one).

jagged_attention (HSTU encoder, Jagged Flash Attention)
    s_ij = scale * q_i . k_j + rel_bias[h, bucket(|i - j|)]          (positions within the sequence)
    allowed(i, j) = j == i or (j < n_hist and (not causal or j <= i or i >= n_hist))
    softmax: out_i = sum_j softmax_j(s_ij over allowed j) v_j
    silu:    out_i = sum_{allowed j} silu(s_ij) / max_seq_len * v_j
where n_hist = n - num_targets[b]: the last num_targets[b] tokens are candidates that see the
whole history and themselves, never each other; history tokens never see candidates.

gdpa (generalized dot-product attention, non-causal, no normalization)
    out_i = sum_{j in kv sequence of i} act(scale * q_i . k_j) v_j,  act in gelu|silu|relu|none
with jagged queries (q_offsets) against jagged keys (kv_offsets), or, with broadcast_q, one
set of learned query seeds q [n_q, H, D] shared by every sample (output [B * n_q, H, D]).

target_attention (request-broadcast)
    out[c, s] = attend(q_cand[c, s], K/V of request cand_to_request[c])
softmax as above (no mask), silu as gdpa's (no normalization); an empty history gives zeros.

The softmax statistics (`return_lse=True`: the forward's saved values, which its backward reads)
    lse[h, i] = log2 sum_{allowed j} exp(s_ij)                        fp32 [heads, rows]
in the output's row order (tokens; for target attention candidate-major rows c * S + s); a row
with no key (an empty history) has lse -inf. silu has no statistics: lse is empty, [0].
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS = ("softmax", "silu", "gelu", "relu", "none")
LOG2E = 1.0 / math.log(2.0)


def relative_bucket(distance: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket of a non-negative integer distance d, for num_buckets = 2E (E a power of two):
    d itself below E; above, two buckets per octave, E + 2 (floor(log2 d) - log2 E) + h where
    h = 1 in the upper half of the octave (d >= 1.5 * 2^floor(log2 d)); the last bucket holds
    every larger distance. Integer-exact, so a kernel can compute it from the bits of d."""
    exact = num_buckets // 2
    if num_buckets < 2 or exact & (exact - 1):
        raise ValueError(f"num_buckets must be twice a power of two, got {num_buckets}")
    d = distance.to(torch.int64)
    # frexp is exact (d = m 2^e with m in [0.5, 1)): floor(log2 d) = e - 1, and the upper half
    # of the octave is m >= 0.75. A float log2 may round 2^k down on some devices.
    mantissa, exponent = torch.frexp(d.clamp(min=1).double())
    octave = exponent.to(torch.int64) - 1
    upper = (mantissa >= 0.75).to(torch.int64)
    far = exact + 2 * (octave - int(math.log2(exact))) + upper
    return torch.where(d < exact, d, far.clamp(max=num_buckets - 1))


def allowed_mask(n: int, n_hist: int, causal: bool, device: torch.device) -> torch.Tensor:
    """[n, n] boolean: may query i attend key j (see the module docstring)."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    history = j < n_hist
    if causal:
        history = history & ((j <= i) | (i >= n_hist))
    return history | (i == j)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _activate(s: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(s)
    if activation == "gelu":
        return F.gelu(s)
    if activation == "relu":
        return F.relu(s)
    if activation == "none":
        return s
    raise ValueError(f"unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}")


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    activation: str,
    scale: float,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    divide_by: float = 1.0,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of one sequence: q [m, H, D], k and v [n, H, D] -> [m, H, D] (acc dtype),
    and with `with_lse` (softmax) the rows' log2-sum-exp [H, m] beside it."""
    s = torch.einsum("mhd,nhd->hmn", q, k) * scale
    if bias is not None:
        s = s + bias
    if activation == "softmax":
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1) if s.shape[-1] else s
    else:
        p = _activate(s, activation) / divide_by
        if mask is not None:
            p = p.masked_fill(~mask, 0.0)
    out = torch.einsum("hmn,nhd->mhd", p, v)
    if with_lse:
        return out, torch.logsumexp(s, dim=-1) * LOG2E
    return out


def _no_lse(rows: int, heads: int, activation: str, device: torch.device) -> torch.Tensor:
    """The statistics tensor a reference fills: -inf per row (no key yet) for softmax, else empty."""
    if activation != "softmax":
        return torch.empty(0, dtype=torch.float32, device=device)
    return torch.full((heads, rows), float("-inf"), dtype=torch.float32, device=device)


def compiled_reference(reference: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`reference` with its dense attention of one sequence (or request) compiled by
    torch.compile with dynamic shapes; the loop over sequences stays in Python. Compiling the
    whole reference instead unrolls that loop over the batch's lengths (host values, baked in
    as constants), so every batch with other lengths compiles again."""
    return functools.partial(reference, attend=torch.compile(dense_attention, dynamic=True))


def jagged_attention_reference(
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
    attend: Callable[..., torch.Tensor] = dense_attention,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HSTU / Jagged Flash Attention self-attention; rel_bias is [H, num_buckets]. With
    return_lse, (out, lse) as the module's docstring defines lse."""
    if activation not in ("softmax", "silu"):
        raise ValueError(f"jagged_attention supports softmax and silu, got {activation!r}")
    acc = _acc_dtype(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=acc, device=q.device)
    lse = _no_lse(q.shape[0], q.shape[1], activation, q.device)
    with_lse = return_lse and activation == "softmax"
    bounds = offsets.tolist()
    targets = num_targets.tolist() if num_targets is not None else [0] * (len(bounds) - 1)
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        n = end - start
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        bias = None
        if rel_bias is not None:
            buckets = relative_bucket((pos[:, None] - pos[None, :]).abs(), rel_bias.shape[1])
            bias = rel_bias.to(acc)[:, buckets]  # [H, n, n]
        got = attend(
            q[start:end].to(acc),
            k[start:end].to(acc),
            v[start:end].to(acc),
            activation=activation,
            scale=scale,
            mask=allowed_mask(n, n - min(int(targets[b]), n), causal, q.device),
            bias=bias,
            divide_by=max_seq_len,
            with_lse=with_lse,
        )
        if with_lse:
            got, lse_b = got
            lse[:, start:end] = lse_b
        out[start:end] = got
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def check_bound(name: str, bound: int | None, offsets: torch.Tensor) -> None:
    """A caller's bound on the longest sequence of `offsets` must hold (None: no bound)."""
    if bound is None or offsets.numel() < 2:
        return
    longest = int((offsets[1:] - offsets[:-1]).max())
    if longest > bound:
        raise ValueError(f"{name} {bound} is below the longest sequence ({longest})")


def check_target_bounds(
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    max_candidates: int | None,
    max_history: int | None,
) -> None:
    """Target attention's bounds, where given, must hold for the whole batch."""
    check_bound("max_history", max_history, kv_offsets)
    if max_candidates is not None and cand_to_request.numel():
        most = int(torch.bincount(cand_to_request.long()).max())
        if most > max_candidates:
            raise ValueError(f"max_candidates {max_candidates} is below a request's {most} candidates")


def gdpa_reference(
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
    attend: Callable[..., torch.Tensor] = dense_attention,
) -> torch.Tensor:
    """Generalized dot-product attention; with broadcast_q, q is [n_q, H, D] for every sample.
    max_q_len and max_kv_len, where given, bound the longest query and key sequences (kernels
    launch from them without reading the offsets); the math does not depend on them."""
    if activation not in ("gelu", "silu", "relu", "none"):
        raise ValueError(f"gdpa supports gelu, silu, relu and none, got {activation!r}")
    check_bound("max_kv_len", max_kv_len, kv_offsets)
    if not broadcast_q and q_offsets is not None:
        check_bound("max_q_len", max_q_len, q_offsets)
    acc = _acc_dtype(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kv_bounds = kv_offsets.tolist()
    num_seqs = len(kv_bounds) - 1
    if broadcast_q:
        n_q = q.shape[0]
        q_bounds = [b * n_q for b in range(num_seqs + 1)]
    else:
        if q_offsets is None:
            raise ValueError("gdpa needs q_offsets unless broadcast_q")
        q_bounds = q_offsets.tolist()
        if len(q_bounds) != num_seqs + 1:
            raise ValueError(f"q_offsets has {len(q_bounds)} entries, kv_offsets {num_seqs + 1}")
    out = torch.zeros(q_bounds[-1], q.shape[1], v.shape[2], dtype=acc, device=q.device)
    for b in range(num_seqs):
        qs, qe = q_bounds[b], q_bounds[b + 1]
        ks, ke = kv_bounds[b], kv_bounds[b + 1]
        if qe == qs or ke == ks:
            continue
        q_b = q if broadcast_q else q[qs:qe]
        out[qs:qe] = attend(
            q_b.to(acc), k[ks:ke].to(acc), v[ks:ke].to(acc), activation=activation, scale=scale
        )
    return out.to(q.dtype)


def target_attention_reference(
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
    """Candidates [C, S, H, D] attend to their request's history; histories are never copied.
    max_candidates and max_history, where given, bound the candidates of any request and the
    longest history (kernels launch from them); the math does not depend on them. With
    return_lse, (out, lse) as the module's docstring defines lse."""
    if activation not in ("softmax", "silu"):
        raise ValueError(f"target_attention supports softmax and silu, got {activation!r}")
    check_target_bounds(kv_offsets, cand_to_request, max_candidates, max_history)
    acc = _acc_dtype(q_cand)
    scale = q_cand.shape[-1] ** -0.5 if scale is None else scale
    num_cand, seeds, heads, _ = q_cand.shape
    out = torch.zeros(num_cand, seeds, heads, v.shape[2], dtype=acc, device=q_cand.device)
    lse = _no_lse(num_cand * seeds, heads, activation, q_cand.device)
    with_lse = return_lse and activation == "softmax"
    bounds = kv_offsets.tolist()
    requests = cand_to_request.tolist()
    for r in sorted(set(requests)):
        start, end = bounds[r], bounds[r + 1]
        if end == start:
            continue
        cands = torch.tensor([c for c, req in enumerate(requests) if req == r], device=q_cand.device)
        q_r = q_cand[cands].reshape(-1, heads, q_cand.shape[-1]).to(acc)  # every seed of the request
        o_r = attend(
            q_r, k[start:end].to(acc), v[start:end].to(acc), activation=activation, scale=scale,
            with_lse=with_lse,
        )  # fmt: skip
        if with_lse:
            o_r, lse_r = o_r
            lse.view(heads, num_cand, seeds)[:, cands] = lse_r.reshape(heads, len(cands), seeds).float()
        out[cands] = o_r.reshape(len(cands), seeds, heads, -1)
    return (out.to(q_cand.dtype), lse) if return_lse else out.to(q_cand.dtype)
