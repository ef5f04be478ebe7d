"""Load-balanced jagged batches for data-parallel training.

Every rank builds the same global `RequestBatch` (batch i is a pure function of (seed, i)) and
trains on its part of the requests. Split into consecutive blocks, a part's attention work is
left to chance: a request's history attention grows with the square of its length, histories are
heavy-tailed, and the step waits for the rank that drew the long ones. `balanced_parts` assigns
the requests so that every rank gets near-equal attention work and the same number of requests
as the consecutive split, deterministically, so that every rank computes the same parts.

    python3 -m evals.studies.balance    # imbalance of both splits at W = 2, 4, 8
"""

from __future__ import annotations

import heapq
from itertools import accumulate

import torch

from model.data import RequestBatch


def attention_work(batch: RequestBatch) -> torch.Tensor:
    """Each request's attention work, [R] int64: (history length + candidates)^2.

    The square of the history length is the HSTU layers' causal attention (L(L + 1)/2 pairs a
    layer). A request's candidates add work that grows with its history: joined to the history
    as targets, each sees the history and itself (C(L + 1) more pairs, a sequence of L + C
    tokens); scored by target attention, each reads the whole history (num_seeds C L pairs).
    (L + C)^2 = L^2 + 2 C L + C^2 holds both terms (it is about twice the pairs of the targets'
    layout, the square of the sequence its attention runs over) and is never zero for a request
    with candidates, so that a new user's short history still counts its candidates. Constant
    factors cancel in the balance, so one definition serves both layouts.
    """
    lengths = batch.history_offsets[1:] - batch.history_offsets[:-1]
    candidates = batch.candidate_offsets[1:] - batch.candidate_offsets[:-1]
    return (lengths + candidates).square()


def contiguous_parts(
    num_requests: int, world: int, *, device: torch.device | str = "cpu"
) -> list[torch.Tensor]:
    """The split without a shuffle: `world` blocks of consecutive requests, the first
    num_requests % world of them one request longer."""
    _check_world(num_requests, world)
    return list(torch.arange(num_requests, device=device).tensor_split(world))


def balanced_parts(work: torch.Tensor, world: int) -> list[torch.Tensor]:
    """A partition of the requests (indices into `work` [R], each part ascending) into `world`
    parts of near-equal total work, each of R // world requests or one more (R % world parts),
    like the consecutive split's.

    Equal request counts keep the candidates (and with them the dense part of the step: the
    embeddings, interaction and heads run per candidate) as even as the consecutive split
    keeps them; the work is balanced within that constraint by longest-processing-time greedy:
    requests in decreasing work, each to the part of least work that may still take one (ties
    to fewer requests, then the lower part), so the heavy requests spread first and the light
    ones fill the gaps. Where one request holds more than 1/world of the work, no partition
    balances it. The greedy is a heuristic: where the consecutive split has less work in its
    heaviest part, that split is returned, so a balanced batch is never worse than an unshuffled
    one.

    Runs on the host in O(R log R) (one copy of `work` if it is on a GPU: compute the parts
    from the host batch before it is copied); the result is a pure function of `work` and
    `world`, the same on every rank. Work must be non-negative (it keeps every part non-empty).
    """
    if work.dim() != 1:
        raise ValueError(f"work must be one value per request [R], got shape {tuple(work.shape)}")
    num_requests = work.numel()
    _check_world(num_requests, world)
    weights = work.tolist()
    if min(weights) < 0:
        raise ValueError(f"work must be non-negative, got {min(weights)}")
    base, num_larger = divmod(num_requests, world)
    sizes = [base + 1] * num_larger + [base] * (world - num_larger)  # the consecutive split's
    # (work, requests, part): the heap pops the part of least work, then of fewest requests.
    lightest = [(0, 0, part) for part in range(world)]
    loads = [0] * world
    part_of = [0] * num_requests
    for request in sorted(range(num_requests), key=weights.__getitem__, reverse=True):
        load, count, part = heapq.heappop(lightest)
        while count == base and num_larger == 0:  # full: the parts of base + 1 are all taken
            load, count, part = heapq.heappop(lightest)
        part_of[request] = part
        loads[part] = load + weights[request]
        if count == base:
            num_larger -= 1
        else:
            heapq.heappush(lightest, (loads[part], count + 1, part))

    bounds = [0, *accumulate(sizes)]
    if max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)) < max(loads):
        return contiguous_parts(num_requests, world, device=work.device)
    owner = torch.tensor(part_of)
    requests = torch.sort(owner, stable=True).indices
    counts = torch.bincount(owner, minlength=world).tolist()
    return list(requests.to(work.device).split(counts))


def imbalance(work: torch.Tensor, parts: list[torch.Tensor]) -> float:
    """The heaviest part's work over the mean part's (1 is perfect balance; 1 where there is no
    work at all). `work` is per request; the parts are indices into it."""
    totals = torch.stack([work[part.to(work.device)].sum() for part in parts]).double()
    mean = float(totals.mean())
    return float(totals.max()) / mean if mean > 0 else 1.0


def rank_batch(batch: RequestBatch, rank: int, world: int, balance: bool = True) -> RequestBatch:
    """Rank `rank`'s part of the global `batch` among `world` ranks: balanced by attention work,
    or (balance=False) the consecutive block."""
    _check_world(batch.num_requests, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world = {world}), got {rank}")
    if balance:
        parts = balanced_parts(attention_work(batch), world)
    else:
        parts = contiguous_parts(batch.num_requests, world, device=batch.candidate_offsets.device)
    return batch.select_requests(parts[rank])


def _check_world(num_requests: int, world: int) -> None:
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    if num_requests < world:
        raise ValueError(f"{num_requests} requests cannot give each of {world} ranks one")
