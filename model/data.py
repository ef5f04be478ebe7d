"""Synthetic ads traffic for the GEM-class model: what matters for its kernels and for learning.

A batch is a set of requests. A request is one user (its user features, one bag each, and its
history of (item, action, age) events) and its candidates (their item features and dense
features). Everything is jagged, without padding: histories by `history_offsets [R + 1]`,
candidates by `candidate_offsets [R + 1]` (a request's candidates are consecutive rows), bags by
their own offsets. Lengths follow the production laws: ids power-law (hot rows repeat), bags of
1 to `max_bag` ids power-law (most single-id features hold exactly one), histories heavy-tailed
with the configured median and cap, about `candidates_per_request` candidates per request.

Labels come from a hidden ground-truth model (random vectors per id, hashed), so the loss falls
and AUC rises when a model learns: a click is likelier when the candidate's item vectors align
with the user's (its user features and its history, weighted by action), for popular items,
and with the dense features; a conversion follows a click with a probability of its own.

`Batches` is the training loader: batch i is a pure function of (seed, i), generated on a
background thread and copied to the device while the previous batch trains.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from model.config import FeatureConfig, ModelConfig

# The hidden model: vectors of this size, hashed from ids into tables of this many rows.
HIDDEN_DIM = 8
HIDDEN_ROWS = 4099
# Bags of a multi-id feature that are empty (a user without that signal).
EMPTY_BAG_FRACTION = 0.05
# Histories: a fraction are short (new users, 0 to the Pareto minimum); the rest are Pareto
# with the config's median, capped at max_len.
SHORT_HISTORY_FRACTION = 0.05


@dataclass
class Bags:
    """Bag i of a feature is ids[offsets[i]:offsets[i + 1]] (with weights beside, if weighted)."""

    ids: torch.Tensor  # [N] int64
    offsets: torch.Tensor  # [num_bags + 1] int64
    weights: torch.Tensor | None = None  # [N] float32

    @property
    def num_bags(self) -> int:
        return self.offsets.numel() - 1

    def map(self, fn) -> Bags:
        """The bags with `fn` applied to each tensor (a copy to a device, pinning)."""
        return Bags(*(None if t is None else fn(t) for t in (self.ids, self.offsets, self.weights)))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Bags:
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def select(self, bags: torch.Tensor) -> Bags:
        """The bags at `bags` (indices, repeats allowed), in that order."""
        lengths = (self.offsets[1:] - self.offsets[:-1])[bags]
        offsets = torch.zeros(bags.numel() + 1, dtype=torch.int64, device=bags.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        rows = jagged_rows(self.offsets, bags, lengths, offsets)
        weights = None if self.weights is None else self.weights[rows]
        return Bags(self.ids[rows], offsets, weights)


def jagged_rows(
    offsets: torch.Tensor, seqs: torch.Tensor, lengths: torch.Tensor, new_offsets: torch.Tensor
) -> torch.Tensor:
    """The rows of sequences `seqs` (of `offsets`), concatenated: for a gather of whole sequences."""
    total = int(new_offsets[-1])
    owner = torch.repeat_interleave(
        torch.arange(seqs.numel(), device=seqs.device), lengths, output_size=total
    )
    within = torch.arange(total, device=seqs.device) - new_offsets[:-1][owner]
    return offsets[:-1][seqs][owner] + within


@dataclass
class RequestBatch:
    user_features: dict[str, Bags]  # one bag per request
    item_features: dict[str, Bags]  # one bag per candidate
    history_items: torch.Tensor  # [T] int64, item ids (of the history's item table)
    history_actions: torch.Tensor  # [T] int64 in [0, num_actions)
    history_ages: torch.Tensor  # [T] int64: the event's age bucket in [0, time_buckets)
    history_offsets: torch.Tensor  # [R + 1] int64
    candidate_offsets: torch.Tensor  # [R + 1] int64
    cand_to_request: torch.Tensor  # [B] int64
    dense: torch.Tensor  # [B, num_dense] float32
    labels: torch.Tensor  # [B, tasks] float32 (ctr, cvr)
    # Static bounds for sync-free launches: the config's, not this batch's (which would sync).
    max_history: int
    max_candidates: int

    @property
    def num_requests(self) -> int:
        return self.candidate_offsets.numel() - 1

    @property
    def num_candidates(self) -> int:
        return self.cand_to_request.numel()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RequestBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Marks every tensor as used on `stream` (copied on another): the allocator then keeps
        its memory from the next copies until the work queued on `stream` is done."""
        self._map(lambda t: t.record_stream(stream) or t)

    def pin_memory(self) -> RequestBatch:
        return self._map(lambda t: t.pin_memory())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch, in one order (the fields', each feature's ids, offsets and
        weights): two batches of one shape list theirs alike."""
        out: list[torch.Tensor] = []
        self._map(lambda t: out.append(t) or t)
        return out

    def _map(self, fn) -> RequestBatch:
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = fn(value)
            elif isinstance(value, dict):
                value = {k: b.map(fn) for k, b in value.items()}
            values[f.name] = value
        return RequestBatch(**values)

    def select_requests(self, requests: torch.Tensor) -> RequestBatch:
        """The batch of requests `requests` (indices [N], repeats allowed), in that order: their
        user features and histories, their candidates (item features, dense features, labels;
        cand_to_request renumbered to the new order), the static bounds kept. A data-parallel
        rank's part of a global batch (`model.balance.rank_batch`)."""
        requests = requests.to(self.candidate_offsets.device)
        cand_counts = (self.candidate_offsets[1:] - self.candidate_offsets[:-1])[requests]
        cand_rows = jagged_rows(self.candidate_offsets, requests, cand_counts, _offsets(cand_counts))
        return self._regroup(requests, cand_rows, cand_counts, self.max_candidates)

    def _regroup(
        self, requests: torch.Tensor, cand_rows: torch.Tensor, cand_counts: torch.Tensor, max_candidates: int
    ) -> RequestBatch:
        """A batch of requests `requests` of this one (their user features and histories), the
        i-th holding `cand_counts[i]` candidates, the next of `cand_rows` (rows of this batch)."""
        cand_offsets = _offsets(cand_counts)
        hist_lengths = (self.history_offsets[1:] - self.history_offsets[:-1])[requests]
        hist_offsets = _offsets(hist_lengths)
        hist_rows = jagged_rows(self.history_offsets, requests, hist_lengths, hist_offsets)
        return RequestBatch(
            user_features={k: b.select(requests) for k, b in self.user_features.items()},
            item_features={k: b.select(cand_rows) for k, b in self.item_features.items()},
            history_items=self.history_items[hist_rows],
            history_actions=self.history_actions[hist_rows],
            history_ages=self.history_ages[hist_rows],
            history_offsets=hist_offsets,
            candidate_offsets=cand_offsets,
            cand_to_request=torch.repeat_interleave(
                torch.arange(requests.numel(), device=requests.device),
                cand_counts,
                output_size=cand_rows.numel(),
            ),
            dense=self.dense[cand_rows],
            labels=self.labels[cand_rows],
            max_history=self.max_history,
            max_candidates=max_candidates,
        )

    def per_candidate_requests(self, *, with_all_candidates: bool) -> tuple[RequestBatch, torch.Tensor]:
        """The naive form of this batch: one request per candidate, each a copy of its request's
        user side (features and history), holding that candidate alone, or (with_all_candidates)
        all its request's candidates (what a model that encodes candidates beside the history
        needs to score one of them exactly as the request would). Returns the batch and, for
        each of this batch's candidates, its row there."""
        req = self.cand_to_request
        counts = (self.candidate_offsets[1:] - self.candidate_offsets[:-1])[req]
        if with_all_candidates:
            cand_rows = jagged_rows(self.candidate_offsets, req, counts, _offsets(counts))
            cand_counts = counts
        else:
            cand_rows = torch.arange(self.num_candidates, device=req.device)
            cand_counts = torch.ones_like(req)
        batch = self._regroup(req, cand_rows, cand_counts, self.max_candidates if with_all_candidates else 1)
        cand_offsets = batch.candidate_offsets
        own = torch.arange(self.num_candidates, device=req.device)
        slot = own - self.candidate_offsets[:-1][req]
        pick = cand_offsets[:-1] + (slot if with_all_candidates else 0)
        return batch, pick


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def power_law(count: int, max_len: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """`count` lengths in [1, max_len], P(L) proportional to L^-alpha."""
    if max_len == 1 or count == 0:
        return torch.ones(count, dtype=torch.int64)
    probs = torch.arange(1, max_len + 1, dtype=torch.float64).pow(-alpha)
    return torch.multinomial(probs / probs.sum(), count, replacement=True, generator=gen) + 1


def zipf_ids(count: int, num: int, gen: torch.Generator) -> torch.Tensor:
    """`count` ids in [0, num), log-uniform (P(id near k) ~ 1/k: popularity as in production logs)."""
    log_ids = torch.rand(count, generator=gen, dtype=torch.float64) * math.log(num + 1)
    return (log_ids.exp().floor().long() - 1).clamp_(0, num - 1)


class TrafficGenerator:
    """Request batches for a model config, labels from a hidden model fixed by `seed`."""

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        self.config = config
        gen = torch.Generator().manual_seed(10_000 + seed)
        self.seed = seed
        # One hidden table per embedding table: ids of unified features share their vectors.
        self.hidden = {t.name: torch.randn(HIDDEN_ROWS, HIDDEN_DIM, generator=gen) for t in config.tables}
        self.popularity = {t.name: torch.randn(HIDDEN_ROWS, generator=gen) for t in config.tables}
        self.action_weight = (
            torch.rand(config.history.num_actions if config.history else 1, generator=gen) + 0.5
        )
        self.dense_weight = torch.randn(config.data.num_dense, generator=gen)
        self.conversion = torch.randn(HIDDEN_DIM, generator=gen)

    def _bags(self, feature: FeatureConfig, num: int, gen: torch.Generator) -> Bags:
        lengths = power_law(num, feature.max_bag, self.config.data.length_alpha, gen)
        if feature.max_bag > 1:
            lengths[torch.rand(num, generator=gen) < EMPTY_BAG_FRACTION] = 0
        offsets = _offsets(lengths)
        ids = zipf_ids(int(offsets[-1]), self.config.hash_size(feature), gen)
        weights = torch.rand(ids.numel(), generator=gen) if feature.weighted else None
        return Bags(ids, offsets, weights)

    def _history_lengths(self, num: int, gen: torch.Generator) -> torch.Tensor:
        h = self.config.history
        assert h is not None
        alpha = self.config.data.length_alpha
        low = max(1.0, h.median_len / 2 ** (1 / alpha))  # a Pareto's median is low * 2^(1/alpha)
        pareto = low * torch.rand(num, generator=gen, dtype=torch.float64).clamp_(min=1e-12).pow(-1 / alpha)
        lengths = pareto.floor().long().clamp_(1, h.max_len)
        short = torch.rand(num, generator=gen) < SHORT_HISTORY_FRACTION
        lengths[short] = torch.randint(0, int(low) + 1, (int(short.sum()),), generator=gen)
        return lengths

    def _history_events(self, total: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        """(items, actions, ages) of `total` history events: items power-law, actions likelier
        the lower their index, ages uniform over the time buckets."""
        h = self.config.history
        assert h is not None
        items = zipf_ids(total, self.config.table(h.item_table).num_rows, gen)
        actions = (
            torch.multinomial(torch.linspace(1.0, 0.1, h.num_actions), total, replacement=True, generator=gen)
            if total
            else torch.zeros(0, dtype=torch.int64)
        )
        ages = torch.rand(total, generator=gen, dtype=torch.float64) * (h.time_buckets - 1)
        return items, actions, ages.floor().long()

    def variant(self, batch: RequestBatch, gen: torch.Generator) -> RequestBatch:
        """A batch of `batch`'s sizes that no step has seen: its requests in a random order, with
        every id, weight, history event and dense feature drawn again (the labels go with their
        candidates: no kernel reads them). What a step is timed on, so that no implementation's
        memo of earlier answers pays, and nothing compiles in it: every size and bound a kernel
        is launched with (each feature's ids, the candidates, the history events; a feature's
        longest bag and a request's longest history) is `batch`'s, the order alone differs, so
        the kernels compiled for one batch (Triton specializes on integer arguments) serve all
        its variants. `batch` is on the host, as the generator makes it."""
        out = batch.select_requests(torch.randperm(batch.num_requests, generator=gen))
        features = {f.name: f for f in self.config.features}

        def redrawn(name: str, bags: Bags) -> Bags:
            ids = zipf_ids(bags.ids.numel(), self.config.hash_size(features[name]), gen)
            weights = None if bags.weights is None else torch.rand(ids.numel(), generator=gen)
            return Bags(ids, bags.offsets, weights)

        history = out.history_items, out.history_actions, out.history_ages
        if self.config.history is not None:
            history = self._history_events(out.history_items.numel(), gen)
        return replace(
            out,
            user_features={k: redrawn(k, b) for k, b in out.user_features.items()},
            item_features={k: redrawn(k, b) for k, b in out.item_features.items()},
            history_items=history[0],
            history_actions=history[1],
            history_ages=history[2],
            dense=torch.randn(out.dense.shape, generator=gen),
        )

    def variant_on(self, batch: RequestBatch, gen: torch.Generator, device: torch.device) -> RequestBatch:
        """A variant of `batch` (variant), on `device`: what a timed step or call runs on, made
        before the timing starts."""
        return self.variant(batch, gen).to(device)

    def _vectors(self, table: str, bags: Bags) -> torch.Tensor:
        """The hidden vector of each bag: the mean of its ids' ([num_bags, HIDDEN_DIM], zeros if empty)."""
        rows = self.hidden[table][bags.ids % HIDDEN_ROWS]
        owner = torch.repeat_interleave(torch.arange(bags.num_bags), bags.offsets[1:] - bags.offsets[:-1])
        out = torch.zeros(bags.num_bags, HIDDEN_DIM).index_add_(0, owner, rows)
        return out / (bags.offsets[1:] - bags.offsets[:-1]).clamp(min=1).unsqueeze(1)

    def batch(
        self,
        index: int,
        *,
        num_requests: int | None = None,
        candidates_per_request: int | None = None,
        exact_candidates: bool = False,
        history_length: int | None = None,
    ) -> RequestBatch:
        """Batch `index` (the same batch for the same seed and index). `candidates_per_request`
        is the mean (uniform in [c/2, 3c/2]), or every request's count with exact_candidates;
        `history_length`, every request's history length (else drawn)."""
        c, d = self.config, self.config.data
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        num_requests = d.requests_per_batch if num_requests is None else num_requests
        mean_cands = d.candidates_per_request if candidates_per_request is None else candidates_per_request
        if num_requests < 1 or mean_cands < 1:
            raise ValueError(f"a batch needs requests and candidates, got {num_requests} and {mean_cands}")
        if history_length is not None and c.history is None:
            raise ValueError("history_length given, but the config has no history")
        if exact_candidates:
            counts = torch.full((num_requests,), mean_cands, dtype=torch.int64)
        else:
            counts = torch.randint(
                max(1, mean_cands // 2), mean_cands + mean_cands // 2 + 1, (num_requests,), generator=gen
            )
        candidate_offsets = _offsets(counts)
        num_cands = int(candidate_offsets[-1])
        cand_to_request = torch.repeat_interleave(torch.arange(num_requests), counts)

        user = {f.name: self._bags(f, num_requests, gen) for f in c.features_of("user")}
        item = {f.name: self._bags(f, num_cands, gen) for f in c.features_of("item")}
        dense = torch.randn(num_cands, d.num_dense, generator=gen)

        # The hidden model: the user's vector from its features and its history.
        user_vec = torch.zeros(num_requests, HIDDEN_DIM)
        for f in c.features_of("user"):
            user_vec += self._vectors(f.table, user[f.name])
        h = c.history
        if h is not None:
            lengths = self._history_lengths(num_requests, gen)
            if history_length is not None:
                if not 0 <= history_length <= h.max_len:
                    raise ValueError(f"history_length {history_length} is outside [0, max_len = {h.max_len}]")
                lengths = torch.full_like(lengths, history_length)
            history_offsets = _offsets(lengths)
            total = int(history_offsets[-1])
            history_items, history_actions, history_ages = self._history_events(total, gen)
            weight = self.action_weight[history_actions] * torch.exp(-history_ages.float() / h.time_buckets)
            owner = torch.repeat_interleave(torch.arange(num_requests), lengths)
            events = self.hidden[h.item_table][history_items % HIDDEN_ROWS] * weight.unsqueeze(1)
            user_vec += torch.zeros(num_requests, HIDDEN_DIM).index_add_(0, owner, events) / lengths.clamp(
                min=1
            ).sqrt().unsqueeze(1)
            max_history = h.max_len
        else:
            history_offsets = torch.zeros(num_requests + 1, dtype=torch.int64)
            history_items = history_actions = history_ages = torch.zeros(0, dtype=torch.int64)
            max_history = 1
        user_vec = user_vec / user_vec.norm(dim=1, keepdim=True).clamp(min=1e-6)

        item_vec = torch.zeros(num_cands, HIDDEN_DIM)
        popularity = torch.zeros(num_cands)
        for f in c.features_of("item"):
            bags = item[f.name]
            item_vec += self._vectors(f.table, bags)
            if f.max_bag == 1:
                popularity += _per_bag(self.popularity[f.table], bags)
        item_vec = item_vec / item_vec.norm(dim=1, keepdim=True).clamp(min=1e-6)
        affinity = (user_vec[cand_to_request] * item_vec).sum(1)
        ctr_logit = (
            d.signal * 2.0 * affinity
            + 0.5 * popularity
            + 0.5 * dense @ self.dense_weight / math.sqrt(d.num_dense)
            - 2.0
        )
        click = torch.bernoulli(torch.sigmoid(ctr_logit), generator=gen)
        cvr_logit = d.signal * (item_vec @ self.conversion) / math.sqrt(HIDDEN_DIM) - 0.5
        convert = click * torch.bernoulli(torch.sigmoid(cvr_logit), generator=gen)
        by_task = {"ctr": click, "cvr": convert}
        labels = torch.stack([by_task[t] for t in c.tasks], dim=1)
        return RequestBatch(
            user_features=user,
            item_features=item,
            history_items=history_items,
            history_actions=history_actions,
            history_ages=history_ages,
            history_offsets=history_offsets,
            candidate_offsets=candidate_offsets,
            cand_to_request=cand_to_request,
            dense=dense,
            labels=labels,
            max_history=max_history,
            max_candidates=int(counts.max()) if exact_candidates else mean_cands + mean_cands // 2,
        )


def _per_bag(values: torch.Tensor, bags: Bags) -> torch.Tensor:
    """Sum over each bag of `values` at its ids (hashed)."""
    owner = torch.repeat_interleave(torch.arange(bags.num_bags), bags.offsets[1:] - bags.offsets[:-1])
    return torch.zeros(bags.num_bags).index_add_(0, owner, values[bags.ids % HIDDEN_ROWS])


class Batches:
    """Training batches start, start + 1, ... (`count` of them, or without end) of a generator on
    `device`, as (index, batch, measure(batch)): the next batch is generated (and measured, on
    the host) on a background thread, pinned on a GPU, and copied on a side stream while the
    current one trains; iteration hands over a batch whose copy has finished."""

    def __init__(
        self,
        generator: TrafficGenerator,
        device: torch.device | str,
        *,
        start: int = 0,
        count: int | None = None,
        measure: Callable[[RequestBatch], Any] | None = None,
        part: Callable[[RequestBatch], RequestBatch] | None = None,
        depth: int = 2,
    ) -> None:
        """`measure` sees the whole batch; `part` (a data-parallel rank's share of it) makes the
        batch handed over."""
        self.generator, self.device = generator, torch.device(device)
        self.start, self.count, self.measure, self.part = start, count, measure, part
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._produce, daemon=True, name="recforge-batches")
        self._thread.start()

    def _produce(self) -> None:
        index = self.start
        try:
            while not self._stop.is_set() and (self.count is None or index < self.start + self.count):
                batch = self.generator.batch(index)
                measured = self.measure(batch) if self.measure is not None else None
                if self.part is not None:
                    batch = self.part(batch)
                if self.device.type == "cuda":
                    batch = batch.pin_memory()
                if not self._put((index, batch, measured)):
                    return
                index += 1
            self._put(None)
        except BaseException as exc:  # handed to the consumer, who raises it
            self._put(exc)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[tuple[int, RequestBatch, Any]]:
        pending = self._fetch()
        while pending is not None:
            following = self._fetch()  # its copy overlaps the caller's work on `pending`
            index, batch, measured, ready = pending
            if ready is not None:
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(ready)
                batch.record_stream(stream)
            yield index, batch, measured
            pending = following

    def _fetch(self) -> tuple[int, RequestBatch, Any, torch.cuda.Event | None] | None:
        item = self._queue.get()
        if item is None:
            self._queue.put(None)
            return None
        if isinstance(item, BaseException):
            raise item
        index, batch, measured = item
        if self._stream is None:
            return index, batch.to(self.device), measured, None
        with torch.cuda.stream(self._stream):
            batch = batch.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return index, batch, measured, ready

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
