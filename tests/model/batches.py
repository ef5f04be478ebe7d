"""What the model's tests share."""

from __future__ import annotations

import torch

from model.data import RequestBatch

# The model's variants that its scoring tests run: the tiny config as it is, candidates as
# targets of the history with softmax attention and GDPA scoring, and sparse experts.
VARIANTS = {
    "target-silu": {},
    "targets-gdpa-softmax": {
        "history": {"candidates_as_targets": True, "attention": "softmax", "max_targets": 32},
        "scoring": {"attention": "gdpa"},
    },
    "experts": {"heads": {"num_experts": 4, "top_k": 2, "expert_dim": 16}},
}


def assert_same_batch(a: RequestBatch, b: RequestBatch) -> None:
    """Every tensor and bound of `a` equals `b`'s (features, weights, histories, candidates)."""
    assert (a.max_history, a.max_candidates) == (b.max_history, b.max_candidates)
    for name in (
        "history_items",
        "history_actions",
        "history_ages",
        "history_offsets",
        "candidate_offsets",
        "cand_to_request",
        "dense",
        "labels",
    ):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for side in ("user_features", "item_features"):
        assert getattr(a, side).keys() == getattr(b, side).keys()
        for feature, bags in getattr(a, side).items():
            other = getattr(b, side)[feature]
            assert torch.equal(bags.ids, other.ids) and torch.equal(bags.offsets, other.offsets), feature
            assert (bags.weights is None) == (other.weights is None), feature
            assert bags.weights is None or torch.equal(bags.weights, other.weights), feature
