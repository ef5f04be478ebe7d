"""The serving pass captured in CUDA graphs: one graph per batch capacity, replayed for every
batch that fits it, so that a batch's hundreds of launches cost the host one replay (the
request-oriented step was bound by the host's launches: BENCHMARKS.md, nineteenth session).

A graph replays fixed shapes, and batches vary. Each batch is padded up to a capacity: its
sizes (candidates, history events, each feature's ids) with a quarter and a few more of room
(`HEADROOM`, `SLACK`: sizes vary from batch to batch, and one capacity should hold many),
rounded up on a grid of steps of at most 1/8 (`round_up`), with padding requests enough to
hold all of it; a feature of one id a bag keeps one a bag. A batch takes the smallest graph
already captured that holds it (`holds`); only one that none holds captures another, and the
least recently used graph goes when more than `max_graphs` are kept. The static bounds
(max_candidates, max_history) are part of the capacity: the kernels size their grids by them.
The room costs work: on the configs' own serving traffic, capacities hold 1.3 to 1.6 times
the batch's candidates and events, and 200 batches take 3 (small) to 5 (tiny) graphs.

The padding is requests of no real user appended after the batch's own, which hold the
padding candidates and history events, each within the bounds, and bags holding the padding
ids (row 0, weight 0). Every op scores a candidate from its own request alone, so the real
candidates' scores are those of the batch unpadded (`pad_batch`'s test checks it); the
padding's are dropped.

Capture needs a pass that never waits for the device: the model's ops take the batch's static
bounds for their grids (kernels.ops; the plain reference ops copy to the host, and cannot be
captured), and the warm-up before each capture fills the caches that a first call makes
(kernels compiled, dispatch resolved, the tables' metadata on the device).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from model.data import Bags, RequestBatch
from model.gem import GEMModel
from model.serving import score

WARMUP_CALLS = 2
HEADROOM = 1.25
SLACK = 8
MAX_GRAPHS = 8


def round_up(n: int) -> int:
    """The least m * 2^e >= n with m in 8..15 (n itself up to 8): steps of at most 1/8."""
    if n <= 8:
        return max(n, 0)
    e = n.bit_length() - 4  # n < 16 * 2^e
    return -(-n // (1 << e)) << e


@dataclass(frozen=True)
class Capacity:
    """The padded sizes of a batch and its bounds: the shapes and grids of one graph."""

    requests: int
    candidates: int
    history: int
    max_candidates: int
    max_history: int
    user_ids: tuple[tuple[str, int], ...]  # (feature, ids), in the order of their names
    item_ids: tuple[tuple[str, int], ...]
    # The features of one id a bag, which hold one id for each request or candidate.
    single: frozenset[str] = frozenset()
    # The features whose ids are weighted (per_sample_weights).
    weighted: frozenset[str] = frozenset()


def _single(bags: Bags) -> bool:
    return bags.ids.shape[0] == bags.num_bags


def _features(batch: RequestBatch) -> dict[str, Bags]:
    """Both sides' features by name (a feature is of one side)."""
    return {**batch.user_features, **batch.item_features}


def _room(n: int) -> int:
    """A capacity for n: a quarter and a few more, rounded up on the grid."""
    return round_up(math.ceil(n * HEADROOM) + SLACK)


def _padding_requests(batch: RequestBatch, candidates: int, history: int, *, whole: bool = False) -> int:
    """Padding requests that `candidates` and `history` need for this batch (with whole: all of
    them, padding alone), within its bounds (one at least: it holds the users' padding ids)."""
    spare_candidates = candidates - (0 if whole else batch.num_candidates)
    spare_events = history - (0 if whole else batch.history_items.shape[0])
    if spare_events and not batch.max_history:
        raise ValueError("a batch with history events needs a positive max_history")
    return max(
        1,
        math.ceil(spare_candidates / max(batch.max_candidates, 1)),
        math.ceil(spare_events / batch.max_history) if batch.max_history else 0,
    )


def capacity_for(batch: RequestBatch, single: frozenset[str] | None = None) -> Capacity:
    """The capacity that `batch` pads to when no graph holds it: its sizes with room for larger
    batches, rounded up, with one padding candidate at least (it holds the items' padding ids)
    and as many padding requests as the padding needs within the batch's bounds. `single`: the
    features of one id a bag (their config's max_bag is 1); by default, those whose bags all
    hold one in this batch."""
    features = _features(batch)
    if single is None:
        single = frozenset(name for name, b in features.items() if _single(b))
    candidates = _room(batch.num_candidates + 1)
    history = _room(batch.history_items.shape[0])
    # Padding requests enough to hold every candidate and event of the capacity: a smaller
    # batch leaves more to pad.
    requests = round_up(batch.num_requests + _padding_requests(batch, candidates, history, whole=True))

    def ids(side: dict[str, Bags], bags_there: int) -> tuple[tuple[str, int], ...]:
        return tuple(
            (name, bags_there if name in single else _room(b.ids.shape[0]))
            for name, b in sorted(side.items())
        )

    return Capacity(
        requests=requests,
        candidates=candidates,
        history=history,
        max_candidates=batch.max_candidates,
        max_history=batch.max_history,
        user_ids=ids(batch.user_features, requests),
        item_ids=ids(batch.item_features, candidates),
        single=single,
        weighted=frozenset(name for name, b in features.items() if b.weights is not None),
    )


def holds(capacity: Capacity, batch: RequestBatch) -> str | None:
    """Why `capacity` cannot hold `batch` and its padding, or None where it can."""
    if (capacity.max_candidates, capacity.max_history) != (batch.max_candidates, batch.max_history):
        return "other bounds"
    candidates, events = batch.num_candidates, batch.history_items.shape[0]
    if capacity.candidates <= candidates or capacity.history < events:
        return "too few candidates or history events"
    if capacity.requests - batch.num_requests < _padding_requests(
        batch, capacity.candidates, capacity.history
    ):
        return "too few padding requests for the padding within the bounds"
    for side, sizes, bags_there in (
        (batch.user_features, capacity.user_ids, capacity.requests),
        (batch.item_features, capacity.item_ids, capacity.candidates),
    ):
        if sorted(side) != [name for name, _ in sizes]:
            return "other features"
        for name, size in sizes:
            bags = side[name]
            if (name in capacity.weighted) != (bags.weights is not None):
                return f"feature {name} is weighted in one and not the other"
            if name in capacity.single and not _single(bags):
                return f"feature {name} holds other than one id a bag"
            if size < bags.ids.shape[0] or (name in capacity.single and size != bags_there):
                return f"too few ids of feature {name}"
    return None


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
    """`batch` padded to `capacity` (one that holds it: `holds`): its requests, then padding
    requests that hold the padding candidates and events, each within the batch's bounds; its
    features in the order of their names (every padded batch alike)."""
    why = holds(capacity, batch)
    if why is not None:
        raise ValueError(f"capacity {capacity} does not hold this batch: {why}")
    return _pad(batch, capacity)


def _pad(batch: RequestBatch, capacity: Capacity) -> RequestBatch:
    """pad_batch without the check: `capacity` holds `batch`."""
    device = batch.candidate_offsets.device
    requests, candidates, events = batch.num_requests, batch.num_candidates, batch.history_items.shape[0]
    extra_requests = capacity.requests - requests
    extra_candidates = capacity.candidates - candidates
    extra_events = capacity.history - events
    features = [
        {name: _pad_bags(side[name], count, size) for name, size in sizes}
        for side, sizes, count in (
            (batch.user_features, capacity.user_ids, extra_requests),
            (batch.item_features, capacity.item_ids, extra_candidates),
        )
    ]
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


@dataclass
class _Graph:
    inputs: RequestBatch  # the static batch the graph reads
    output: torch.Tensor  # [capacity candidates, tasks], written by each replay
    graph: torch.cuda.CUDAGraph


class GraphedScorer:
    """`model.serving.score` of `model` on a GPU, each batch padded to the smallest captured
    capacity that holds it (or a new one, captured at its first batch; at most `max_graphs`
    kept, the least recently used dropped) and scored by a replay of that capacity's graph.
    The returned probabilities [B, tasks] are a view of the graph's output: the next call that
    replays the same graph overwrites them."""

    def __init__(self, model: GEMModel, *, max_graphs: int = MAX_GRAPHS) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.model, self.max_graphs = model, max_graphs
        self.single = frozenset(f.name for f in model.config.features if f.max_bag == 1)
        self.graphs: OrderedDict[Capacity, _Graph] = OrderedDict()
        self.captures = 0

    def capacity(self, batch: RequestBatch) -> Capacity:
        """The smallest captured capacity that holds `batch`, else the one it would capture."""
        fitting = [c for c in self.graphs if holds(c, batch) is None]
        if fitting:
            return min(fitting, key=lambda c: (c.candidates + c.history, c.requests))
        return capacity_for(batch, self.single)

    def __call__(self, batch: RequestBatch) -> torch.Tensor:
        if batch.candidate_offsets.device.type != "cuda":
            raise ValueError(
                f"CUDA graphs score batches on a GPU; this one is on {batch.candidate_offsets.device}"
            )
        capacity = self.capacity(batch)
        padded = _pad(batch, capacity)  # held: chosen so, or made for it
        entry = self.graphs.get(capacity)
        if entry is None:
            while len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)
            entry = self.graphs[capacity] = self._capture(padded)
            self.captures += 1
        else:
            self.graphs.move_to_end(capacity)
            torch._foreach_copy_(entry.inputs.tensors(), padded.tensors())
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
