"""Synthetic ads traffic: deterministic batches with the workload's laws, the naive form of a
batch, and the loader that prefetches."""

from __future__ import annotations

import torch
from batches import assert_same_batch

from model.config import config_from_dict, load_config
from model.data import Batches, TrafficGenerator


def test_a_batch_is_a_function_of_seed_and_index() -> None:
    config = load_config("tiny")
    assert_same_batch(TrafficGenerator(config, seed=3).batch(5), TrafficGenerator(config, seed=3).batch(5))
    a, b = TrafficGenerator(config, seed=3).batch(5), TrafficGenerator(config, seed=3).batch(6)
    assert a.dense.shape != b.dense.shape or not torch.equal(a.dense, b.dense)


def test_a_variant_has_the_batchs_sizes_and_values_of_its_own() -> None:
    config = load_config("tiny")
    traffic = TrafficGenerator(config, seed=3)
    batch = traffic.batch(0)
    variant = traffic.variant(batch, torch.Generator().manual_seed(1))
    # What kernels are launched with: every tensor's shape and the static bounds.
    assert [t.shape for t in variant.tensors()] == [t.shape for t in batch.tensors()]
    assert (variant.max_history, variant.max_candidates) == (batch.max_history, batch.max_candidates)

    def lengths(offsets: torch.Tensor) -> list[int]:
        return sorted(offsets.diff().tolist())

    # The same requests, histories and bags in another order, with ids drawn again.
    assert lengths(variant.candidate_offsets) == lengths(batch.candidate_offsets)
    assert lengths(variant.history_offsets) == lengths(batch.history_offsets)
    assert not torch.equal(variant.history_items, batch.history_items)
    features = batch.user_features | batch.item_features
    for f in config.features:
        bags = (variant.user_features | variant.item_features)[f.name]
        assert lengths(bags.offsets) == lengths(features[f.name].offsets), f.name
        assert not torch.equal(bags.ids, features[f.name].ids), f.name
        assert int(bags.ids.min()) >= 0 and int(bags.ids.max()) < config.hash_size(f), f.name
    assert not torch.equal(variant.dense, batch.dense)
    other = traffic.variant(batch, torch.Generator().manual_seed(2))
    assert not torch.equal(other.dense, variant.dense)


def test_lengths_follow_the_workload() -> None:
    config = load_config("large")
    batch = TrafficGenerator(config).batch(0)
    history = batch.history_offsets.diff()
    assert 350 <= float(history.float().median()) <= 650  # median about 500
    assert int(history.max()) <= 4096 and int(history.min()) >= 0
    assert (history < 50).any()  # some short (new users)
    per_request = batch.candidate_offsets.diff()
    assert int(per_request.min()) >= 16 and int(per_request.max()) <= 48  # about 32
    for f in config.features:
        bags = (batch.user_features | batch.item_features)[f.name]
        lengths = bags.offsets.diff()
        assert int(lengths.max()) <= f.max_bag
        if f.max_bag == 1:
            assert bool((lengths == 1).all()), f.name
        assert bags.ids.numel() and int(bags.ids.max()) < config.hash_size(f) and int(bags.ids.min()) >= 0
    short = [f for f in config.features if f.max_bag == 3]
    lengths = torch.cat([(batch.user_features | batch.item_features)[f.name].offsets.diff() for f in short])
    assert float((lengths == 1).float().mean()) > 0.4  # power law: one id is the commonest bag


def test_labels_follow_the_hidden_model() -> None:
    batch = TrafficGenerator(load_config("tiny")).batch(0, num_requests=400)
    click, convert = batch.labels[:, 0], batch.labels[:, 1]
    assert 0.05 < float(click.mean()) < 0.6
    assert bool((convert <= click).all())  # a conversion follows a click


def test_the_naive_form_copies_each_request_per_candidate() -> None:
    config = config_from_dict({"size": "tiny"})
    batch = TrafficGenerator(config).batch(1, num_requests=5)
    copies, pick = batch.per_candidate_requests(with_all_candidates=False)
    assert copies.num_requests == batch.num_candidates == copies.num_candidates
    assert torch.equal(pick, torch.arange(batch.num_candidates))
    for c in range(batch.num_candidates):
        r = int(batch.cand_to_request[c])
        own = batch.history_items[batch.history_offsets[r] : batch.history_offsets[r + 1]]
        copied = copies.history_items[copies.history_offsets[c] : copies.history_offsets[c + 1]]
        assert torch.equal(own, copied)
        for name, bags in batch.user_features.items():
            theirs = copies.user_features[name]
            assert torch.equal(
                bags.ids[bags.offsets[r] : bags.offsets[r + 1]],
                theirs.ids[theirs.offsets[c] : theirs.offsets[c + 1]],
            )
    every, pick_all = batch.per_candidate_requests(with_all_candidates=True)
    counts = batch.candidate_offsets.diff()
    assert every.num_candidates == int((counts[batch.cand_to_request]).sum())
    assert torch.equal(every.dense[pick_all], batch.dense)


def test_the_loader_hands_over_batches_in_order_and_resumes() -> None:
    config = load_config("tiny")
    traffic = TrafficGenerator(config, seed=1)
    loader = Batches(traffic, "cpu", start=4, count=3, measure=lambda b: b.num_candidates)
    try:
        seen = list(loader)
    finally:
        loader.close()
    assert [index for index, _, _ in seen] == [4, 5, 6]
    for index, batch, measured in seen:
        assert_same_batch(batch, traffic.batch(index))
        assert measured == batch.num_candidates


def test_a_failing_generator_is_raised_to_the_consumer() -> None:
    config = load_config("tiny")
    traffic = TrafficGenerator(config)

    def broken(index: int, **_):
        raise RuntimeError(f"no batch {index}")

    traffic.batch = broken
    loader = Batches(traffic, "cpu", count=2)
    try:
        raised = None
        try:
            list(loader)
        except RuntimeError as exc:
            raised = exc
        assert raised is not None and "no batch 0" in str(raised)
    finally:
        loader.close()
