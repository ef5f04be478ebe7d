"""Serving through CUDA graphs: a batch padded to its capacity scores its candidates as the batch
does unpadded (on every model variant), the padding stays within the batch's bounds, and on a
GPU the captured graphs score as the eager pass, one capture per capacity."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from batches import VARIANTS

from kernels.registry import DISPATCHER
from model.config import config_from_dict
from model.data import RequestBatch, TrafficGenerator
from model.gem import GEMModel
from model.graphed import Capacity, GraphedScorer, capacity_for, holds, pad_batch, round_up
from model.serving import score


def _setup(variant: str, device: torch.device, **batch) -> tuple[GEMModel, RequestBatch]:
    config = config_from_dict({"size": "tiny", **VARIANTS[variant]})
    torch.manual_seed(0)
    model = GEMModel(config, device=device)
    with torch.no_grad():  # a bias that matters
        for layer in model.history.layers:
            layer.rel_bias.normal_()
    return model, TrafficGenerator(config, seed=3).batch(0, **batch).to(device)


def test_round_up_steps_by_an_eighth_at_most() -> None:
    assert [round_up(n) for n in (0, 1, 8, 9, 16, 17, 100, 4096, 4097)] == [
        0,
        1,
        8,
        9,
        16,
        18,
        104,
        4096,
        4608,
    ]
    for n in range(1, 5000):
        r = round_up(n)
        assert r >= n and round_up(r) == r and (n <= 8 or r <= n * 1.125)


def _lengths(offsets: torch.Tensor) -> list[int]:
    return offsets.diff().tolist()


@pytest.mark.parametrize(
    ("variant", "candidates"),
    [(v, None) for v in sorted(VARIANTS)] + [("target-silu", 16)],  # 16 x 4 candidates: on the grid
)
def test_a_padded_batch_scores_its_candidates_as_the_batch_does(variant: str, candidates: int | None) -> None:
    cpu = torch.device("cpu")
    exact = {} if candidates is None else {"candidates_per_request": candidates, "exact_candidates": True}
    model, batch = _setup(variant, cpu, num_requests=5 if candidates is None else 4, **exact)
    capacity = capacity_for(batch)
    padded = pad_batch(batch, capacity)
    real_requests, real = batch.num_requests, batch.num_candidates
    # The capacity's shapes, the padding within the batch's bounds and after its own rows.
    assert padded.num_requests == capacity.requests > real_requests
    assert padded.num_candidates == capacity.candidates > real
    assert padded.history_items.shape[0] == capacity.history >= batch.history_items.shape[0]
    for side, sizes in ((padded.user_features, capacity.user_ids), (padded.item_features, capacity.item_ids)):
        assert [(name, b.ids.shape[0]) for name, b in side.items()] == list(sizes)  # by name
        assert all(
            int(b.offsets[-1]) == b.ids.shape[0] and min(_lengths(b.offsets)) >= 0 for b in side.values()
        )
    assert sorted(padded.user_features) == sorted(batch.user_features)
    for name, bags in batch.item_features.items():  # a feature of one id a bag keeps one a bag
        if bags.ids.shape[0] == bags.num_bags:
            assert _lengths(padded.item_features[name].offsets) == [1] * capacity.candidates
    padding_candidates = _lengths(padded.candidate_offsets)[real_requests:]
    padding_events = _lengths(padded.history_offsets)[real_requests:]
    assert max(padding_candidates) <= batch.max_candidates and max(padding_events) <= batch.max_history
    assert padded.cand_to_request[real:].tolist() == [
        r for r, n in enumerate(_lengths(padded.candidate_offsets)) if r >= real_requests for _ in range(n)
    ]
    torch.testing.assert_close(padded.candidate_offsets[: real_requests + 1], batch.candidate_offsets)
    # Scored: the batch's candidates as the batch scores them.
    with DISPATCHER.references_only():
        want, got = score(model, batch), score(model, pad_batch(batch, capacity))
    assert got.shape == (capacity.candidates, 2) and torch.isfinite(got).all()
    torch.testing.assert_close(got[:real], want, atol=1e-5, rtol=1e-5)


def test_a_capacity_too_small_of_other_bounds_or_features_is_refused() -> None:
    _, batch = _setup("target-silu", torch.device("cpu"), num_requests=2)
    capacity = capacity_for(batch)
    refusals = {
        "too few candidates": dataclasses.replace(capacity, candidates=batch.num_candidates),
        "within the bounds": dataclasses.replace(capacity, requests=batch.num_requests + 1, history=10**6),
        "other features": dataclasses.replace(capacity, item_ids=capacity.item_ids[1:]),
        "other bounds": dataclasses.replace(capacity, max_candidates=batch.max_candidates + 1),
        "weighted in one and not the other": dataclasses.replace(
            capacity, weighted=capacity.weighted ^ {capacity.user_ids[0][0]}
        ),
        "too few ids of feature": dataclasses.replace(
            capacity, user_ids=tuple((name, 0) for name, _ in capacity.user_ids)
        ),
    }
    for why, wrong in refusals.items():
        with pytest.raises(ValueError, match=f"does not hold this batch: .*{why}"):
            pad_batch(batch, wrong)
    with pytest.raises(ValueError, match="score batches on a GPU"):
        GraphedScorer(GEMModel(config_from_dict({"size": "tiny"})))(batch)
    assert isinstance(capacity, Capacity)


def test_a_stream_of_batches_shares_a_few_capacities() -> None:
    """The capacities a stream of serving batches needs, each batch taking the smallest that
    holds it (as GraphedScorer chooses, without the captures): a few, not one per batch; and a
    batch of other bounds never takes another's."""
    config = config_from_dict({"size": "tiny"})
    scorer = GraphedScorer(GEMModel(config))
    traffic = TrafficGenerator(config, seed=5)
    d = config.data
    for i in range(60):
        batch = traffic.batch(i, num_requests=d.serve_requests, candidates_per_request=d.serve_candidates)
        capacity = scorer.capacity(batch)
        assert holds(capacity, batch) is None and capacity.max_candidates == batch.max_candidates
        scorer.graphs.setdefault(capacity, None)
    assert len(scorer.graphs) <= 6, len(scorer.graphs)
    single = {f.name for f in config.features if f.max_bag == 1}
    assert single and all(name in c.single for c in scorer.graphs for name in single)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_graphs_score_as_the_eager_pass_one_capture_per_capacity(variant: str) -> None:
    cuda = torch.device("cuda")
    model, first = _setup(variant, cuda, num_requests=4)
    generator = TrafficGenerator(model.config, seed=3)
    graphed = GraphedScorer(model)
    batches = [
        first,
        generator.batch(1, num_requests=4).to(cuda),
        generator.batch(2, num_requests=9).to(cuda),
        # Bounds of their own: a graph sized by smaller bounds would drop candidates.
        generator.batch(3, num_requests=4, candidates_per_request=14, exact_candidates=True).to(cuda),
        generator.batch(4, num_requests=4, candidates_per_request=15, exact_candidates=True).to(cuda),
    ]
    for batch in batches * 2:
        got = graphed(batch).clone()
        torch.testing.assert_close(got, score(model, batch), atol=2e-2, rtol=2e-2)
    assert graphed.captures == len(graphed.graphs) <= len(batches)
    assert len({(c.max_candidates, c.max_history) for c in graphed.graphs}) >= 3
