"""Load-balanced jagged batches: a batch of chosen requests, the parts that split a global batch
among ranks (each request once, near-equal attention work and request counts), and their errors."""

from __future__ import annotations

import pytest
import torch
from batches import assert_same_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.balance import attention_work, balanced_parts, contiguous_parts, imbalance, rank_batch
from model.config import load_config
from model.data import Bags, RequestBatch, TrafficGenerator


def _batch(num_requests: int = 40, index: int = 1) -> RequestBatch:
    """A tiny-config batch (power-law histories, 4 to 12 candidates) with weights on one bag
    feature of each side, so that the selection of weights is checked too."""
    batch = TrafficGenerator(load_config("tiny"), seed=2).batch(index, num_requests=num_requests)
    gen = torch.Generator().manual_seed(index)
    for side in (batch.user_features, batch.item_features):
        name, bags = next((n, b) for n, b in side.items() if int(b.offsets.diff().max()) > 1)
        side[name] = Bags(bags.ids, bags.offsets, torch.rand(bags.ids.numel(), generator=gen))
    return batch


def _request(batch: RequestBatch, r: int) -> dict[str, torch.Tensor]:
    """Everything request r holds, read directly from its offsets."""
    h0, h1 = int(batch.history_offsets[r]), int(batch.history_offsets[r + 1])
    c0, c1 = int(batch.candidate_offsets[r]), int(batch.candidate_offsets[r + 1])
    out = {
        "history_items": batch.history_items[h0:h1],
        "history_actions": batch.history_actions[h0:h1],
        "history_ages": batch.history_ages[h0:h1],
        "dense": batch.dense[c0:c1],
        "labels": batch.labels[c0:c1],
    }
    for name, bags in batch.user_features.items():
        b0, b1 = int(bags.offsets[r]), int(bags.offsets[r + 1])
        out[f"user.{name}"] = bags.ids[b0:b1]
        if bags.weights is not None:
            out[f"user.{name}.weights"] = bags.weights[b0:b1]
    for name, bags in batch.item_features.items():
        for c in range(c0, c1):
            b0, b1 = int(bags.offsets[c]), int(bags.offsets[c + 1])
            out[f"item.{name}.{c - c0}"] = bags.ids[b0:b1]
            if bags.weights is not None:
                out[f"item.{name}.{c - c0}.weights"] = bags.weights[b0:b1]
    return out


def _check_request(got: RequestBatch, j: int, want: RequestBatch, r: int) -> None:
    a, b = _request(got, j), _request(want, r)
    assert a.keys() == b.keys(), (j, r, sorted(a.keys() ^ b.keys()))
    for key in a:
        assert torch.equal(a[key], b[key]), f"request {j} (was {r}): {key} differs"
    c0, c1 = int(got.candidate_offsets[j]), int(got.candidate_offsets[j + 1])
    assert bool((got.cand_to_request[c0:c1] == j).all()), f"request {j}: cand_to_request"


def test_select_requests_takes_the_requests_in_order_with_repeats() -> None:
    batch = _batch(num_requests=12)
    requests = torch.tensor([7, 0, 7, 11, 3, 3, 5])
    selected = batch.select_requests(requests)
    assert selected.num_requests == requests.numel()
    assert (selected.max_history, selected.max_candidates) == (batch.max_history, batch.max_candidates)
    for j, r in enumerate(requests.tolist()):
        _check_request(selected, j, batch, r)
    empty = batch.select_requests(torch.zeros(0, dtype=torch.int64))
    assert empty.num_requests == 0 and empty.num_candidates == 0 and empty.history_items.numel() == 0


def test_a_permutation_and_its_inverse_give_back_the_batch() -> None:
    batch = _batch()
    perm = torch.randperm(batch.num_requests, generator=torch.Generator().manual_seed(0))
    assert_same_batch(batch.select_requests(perm).select_requests(torch.argsort(perm)), batch)
    assert_same_batch(batch.select_requests(torch.arange(batch.num_requests)), batch)


@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("world", [1, 3, 8])
def test_the_ranks_parts_preserve_the_batch(balance: bool, world: int) -> None:
    batch = _batch()
    work = attention_work(batch)
    parts = balanced_parts(work, world) if balance else contiguous_parts(batch.num_requests, world)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(batch.num_requests))
    counts = sorted(p.numel() for p in parts)
    assert counts[-1] - counts[0] <= 1 and counts[0] >= 1
    ranks = [rank_batch(batch, rank, world, balance=balance) for rank in range(world)]
    for rank, (part, rb) in enumerate(zip(parts, ranks, strict=True)):
        assert rb.num_requests == part.numel(), rank
        for j, r in enumerate(part.tolist()):
            _check_request(rb, j, batch, r)
    # Concatenated in part order, the ranks' contents are the batch's, request by request.
    order = torch.cat(parts)
    whole = batch.select_requests(order)
    for name in ("history_items", "history_actions", "history_ages", "dense", "labels"):
        assert torch.equal(torch.cat([getattr(rb, name) for rb in ranks]), getattr(whole, name)), name
    for name in batch.item_features:
        ids = torch.cat([rb.item_features[name].ids for rb in ranks])
        assert torch.equal(ids, whole.item_features[name].ids), name
    assert sum(rb.num_candidates for rb in ranks) == batch.num_candidates


def test_attention_work_is_history_and_candidates_squared() -> None:
    batch = _batch(num_requests=6)
    history = batch.history_offsets.diff()
    candidates = batch.candidate_offsets.diff()
    assert torch.equal(attention_work(batch), (history + candidates) ** 2)
    assert attention_work(batch).dtype == torch.int64


@pytest.mark.parametrize("world", [2, 4, 8])
def test_balancing_power_law_histories_is_near_even(world: int) -> None:
    config = load_config("tiny")  # Pareto histories of median 12, at most 64
    unshuffled = []
    for index in range(3):
        batch = TrafficGenerator(config, seed=5).batch(index, num_requests=128)
        work = attention_work(batch)
        contiguous = imbalance(work, contiguous_parts(batch.num_requests, world))
        balanced = imbalance(work, balanced_parts(work, world))
        assert balanced <= contiguous, (index, balanced, contiguous)
        assert balanced < 1.01, (index, balanced, contiguous)
        unshuffled.append(contiguous)
    assert max(unshuffled) > 1.05, unshuffled  # without a shuffle, a rank waits


def test_the_parts_are_a_function_of_the_work() -> None:
    config = load_config("tiny")
    a = attention_work(TrafficGenerator(config, seed=4).batch(3, num_requests=200))
    b = attention_work(TrafficGenerator(config, seed=4).batch(3, num_requests=200))
    for x, y in zip(balanced_parts(a, 8), balanced_parts(b, 8), strict=True):
        assert torch.equal(x, y)
    # Ties are broken by request and part index, not by chance.
    equal = balanced_parts(torch.full((10,), 7), 4)
    assert [p.tolist() for p in equal] == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]


@settings(max_examples=60, deadline=None, database=None)
@given(
    work=st.lists(st.integers(0, 10**6), min_size=1, max_size=120),
    world=st.integers(1, 9),
)
def test_any_work_is_partitioned_no_worse_than_without_a_shuffle(work: list[int], world: int) -> None:
    if len(work) < world:
        world = len(work)
    work_R = torch.tensor(work)
    parts = balanced_parts(work_R, world)
    assert len(parts) == world
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(len(work)))
    counts = sorted(p.numel() for p in parts)
    assert counts[0] >= 1 and counts[-1] - counts[0] <= 1, counts
    assert all(bool((p.diff() > 0).all()) for p in parts)  # ascending within each part
    assert imbalance(work_R, parts) <= imbalance(work_R, contiguous_parts(len(work), world)) + 1e-12


def test_bad_worlds_ranks_and_work_are_refused() -> None:
    batch = _batch(num_requests=4)
    work = attention_work(batch)
    with pytest.raises(ValueError, match="world must be at least 1"):
        balanced_parts(work, 0)
    with pytest.raises(ValueError, match="4 requests cannot give each of 5 ranks one"):
        balanced_parts(work, 5)
    with pytest.raises(ValueError, match="world must be at least 1"):
        contiguous_parts(4, 0)
    with pytest.raises(ValueError, match="cannot give each"):
        contiguous_parts(3, 4)
    with pytest.raises(ValueError, match="cannot give each"):
        rank_batch(batch, 0, 5)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world = 2\), got 2"):
        rank_batch(batch, 2, 2)
    with pytest.raises(ValueError, match="rank must be in"):
        rank_batch(batch, -1, 2, balance=False)
    with pytest.raises(ValueError, match="non-negative"):
        balanced_parts(torch.tensor([3, -1, 2]), 2)
    with pytest.raises(ValueError, match="one value per request"):
        balanced_parts(work.reshape(2, 2), 2)
