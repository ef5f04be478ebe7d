"""The serving pass captured in CUDA graphs: one graph per batch capacity, replayed for every
batch that fits it, so that a batch's hundreds of launches cost the host one replay (the
request-oriented step was bound by the host's launches: BENCHMARKS.md, nineteenth session).

A graph replays fixed shapes, and batches vary. Each batch is padded up to its capacity: every
size (requests, candidates, history events, each feature's ids; a feature of one id a bag
keeps one a bag) rounded up on a grid of steps of at most 1/8 (`round_up`), so that a few
graphs serve a stream of batches. The padding is
requests of no real user appended after the batch's own, which hold the padding candidates and
history events, each within the batch's static bounds (max_candidates, max_history), and bags
holding the padding ids (row 0, weight 0). Every op scores a candidate from its own request
alone, so the real candidates' scores are those of the batch unpadded (`pad_batch`'s test
checks it); the padding's are dropped.

Capture needs a pass that never waits for the device: the model's ops take the batch's static
bounds for their grids (kernels.ops), and the warm-up before each capture fills the caches
that a first call makes (kernels compiled, dispatch resolved, the tables' metadata on the
device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from model.data import Bags, RequestBatch
from model.gem import GEMModel
from model.serving import score

WARMUP_CALLS = 2


def round_up(n: int) -> int:
    """The least m * 2^e >= n with m in 8..15 (n itself up to 8): steps of at most 1/8."""
    if n <= 8:
        return max(n, 0)
    e = n.bit_length() - 4  # n < 16 * 2^e
    return -(-n // (1 << e)) << e


@dataclass(frozen=True)
class Capacity:
    """The padded sizes of a batch: the shapes of one graph."""

    requests: int
    candidates: int
    history: int
    user_ids: tuple[int, ...]  # per user feature, in the batch's order
    item_ids: tuple[int, ...]  # per item feature


def capacity_for(batch: RequestBatch) -> Capacity:
    """The capacity that `batch` pads to: its sizes rounded up, with one padding candidate at
    least (it holds the items' padding ids), and as many padding requests as the padding
    candidates and events need within the batch's bounds, one at least (it holds the users')."""
    candidates = round_up(batch.num_candidates + 1)
    history = round_up(batch.history_items.shape[0])
    spare_candidates = candidates - batch.num_candidates
    spare_events = history - batch.history_items.shape[0]
    padding_requests = max(
        1,
        math.ceil(spare_candidates / max(batch.max_candidates, 1)),
        math.ceil(spare_events / batch.max_history) if batch.max_history else 0,
    )
    if spare_events and not batch.max_history:
        raise ValueError("a batch with history events needs a positive max_history")
    requests = round_up(batch.num_requests + padding_requests)

    def ids(bags: Bags, capacity: int) -> int:
        # A feature of one id a bag stays so (the model reads the candidate's item feature as
        # one row per candidate); the others are rounded up.
        return capacity if bags.ids.shape[0] == bags.num_bags else round_up(bags.ids.shape[0])

    return Capacity(
        requests=requests,
        candidates=candidates,
        history=history,
        user_ids=tuple(ids(b, requests) for b in batch.user_features.values()),
        item_ids=tuple(ids(b, candidates) for b in batch.item_features.values()),
    )


def _fill(start: int, count: int, total: int, most: int, device: torch.device) -> torch.Tensor:
    """The offsets after `start` of `count` segments that hold `total` rows, each at most `most`,
    the first ones full: start + min(i * most, total) for i in 1..count (no host sync)."""
    steps = torch.arange(1, count + 1, device=device, dtype=torch.int64)
    return steps.mul_(most).clamp_(max=total).add_(start)


def _pad_bags(bags: Bags, count: int, capacity: int) -> Bags:
    """`bags` and `count` more, which share the ids up to `capacity` (id 0, weight 0) evenly."""
    device, have = bags.ids.device, bags.ids.shape[0]
    spare = capacity - have
    ids = torch.cat([bags.ids, bags.ids.new_zeros(spare)])
    offsets = torch.cat([bags.offsets, _fill(have, count, spare, -(-spare // count), device)])
    weights = None
    if bags.weights is not None:
        weights = torch.cat([bags.weights, bags.weights.new_zeros(spare)])
    return Bags(ids, offsets, weights)


def pad_batch(batch: RequestBatch, capacity: Capacity) -> RequestBatch:
    """`batch` padded to `capacity` (capacity_for(batch), or one larger in every size): its
    requests, then padding requests that hold the padding candidates and events, each within
    the batch's bounds."""
    device = batch.candidate_offsets.device
    requests, candidates, events = batch.num_requests, batch.num_candidates, batch.history_items.shape[0]
    extra_requests = capacity.requests - requests
    extra_candidates = capacity.candidates - candidates
    extra_events = capacity.history - events
    if extra_requests < 1 or extra_candidates < 1 or extra_events < 0:
        raise ValueError(f"capacity {capacity} does not hold this batch and its padding")
    if extra_candidates > extra_requests * batch.max_candidates or (
        extra_events > extra_requests * batch.max_history
    ):
        raise ValueError(
            f"capacity {capacity}: its padding requests cannot hold the padding within the bounds"
        )
    per_side = (
        (batch.user_features, capacity.user_ids, extra_requests),
        (batch.item_features, capacity.item_ids, extra_candidates),
    )
    features = []
    for side, capacities, count in per_side:
        if len(capacities) != len(side):
            raise ValueError(f"capacity {capacity} is not of this batch's features")
        features.append(
            {
                name: _pad_bags(bags, count, c)
                for (name, bags), c in zip(side.items(), capacities, strict=True)
            }
        )
    padding_owner = torch.arange(extra_candidates, device=device) // batch.max_candidates + requests

    def extended(t: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((rows, *t.shape[1:]))])

    return RequestBatch(
        user_features=features[0],
        item_features=features[1],
        history_items=extended(batch.history_items, extra_events),
        history_actions=extended(batch.history_actions, extra_events),
        history_ages=extended(batch.history_ages, extra_events),
        history_offsets=torch.cat(
            [batch.history_offsets, _fill(events, extra_requests, extra_events, batch.max_history, device)]
        ),
        candidate_offsets=torch.cat(
            [
                batch.candidate_offsets,
                _fill(candidates, extra_requests, extra_candidates, batch.max_candidates, device),
            ]
        ),
        cand_to_request=torch.cat([batch.cand_to_request, padding_owner]),
        dense=extended(batch.dense, extra_candidates),
        labels=extended(batch.labels, extra_candidates),
        max_history=batch.max_history,
        max_candidates=batch.max_candidates,
    )


def _tensors(batch: RequestBatch) -> list[torch.Tensor]:
    """Every tensor of `batch`, in one fixed order."""
    out = []
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, dict):
            for bags in value.values():
                out += [t for t in (bags.ids, bags.offsets, bags.weights) if t is not None]
    return out


@dataclass
class _Graph:
    inputs: RequestBatch  # the static batch the graph reads
    output: torch.Tensor  # [capacity candidates, tasks], written by each replay
    graph: torch.cuda.CUDAGraph


class GraphedScorer:
    """`model.serving.score` of `model` on a GPU, each batch padded to its capacity and scored
    by a replay of that capacity's graph (captured at its first batch). The returned
    probabilities [B, tasks] are a view of the graph's output: the next call of the same
    capacity overwrites them."""

    def __init__(self, model: GEMModel) -> None:
        self.model = model
        self.graphs: dict[Capacity, _Graph] = {}

    def __call__(self, batch: RequestBatch) -> torch.Tensor:
        if batch.candidate_offsets.device.type != "cuda":
            raise ValueError(
                f"CUDA graphs score batches on a GPU; this one is on {batch.candidate_offsets.device}"
            )
        capacity = capacity_for(batch)
        padded = pad_batch(batch, capacity)
        entry = self.graphs.get(capacity)
        if entry is None:
            entry = self.graphs[capacity] = self._capture(padded)
        else:
            torch._foreach_copy_(_tensors(entry.inputs), _tensors(padded))
        entry.graph.replay()
        return entry.output[: batch.num_candidates]

    def _capture(self, padded: RequestBatch) -> _Graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                score(self.model, padded)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = score(self.model, padded)
        return _Graph(padded, output, graph)
