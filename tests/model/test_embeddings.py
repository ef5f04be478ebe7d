"""model.embeddings: the fused update's bookkeeping across backward passes (the math is tested
against the unfused path in test_model_training.py)."""

from __future__ import annotations

import pytest
import torch

from model.config import TableConfig
from model.embeddings import TableBatchedEmbeddings

TABLES = [TableConfig(name="items", num_rows=30, dim=8), TableConfig(name="users", num_rows=20, dim=4)]


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom")


def _step(embeddings: TableBatchedEmbeddings, *, boom: bool = False) -> None:
    ids = torch.tensor([1, 2, 2, 5, 7, 19])
    offsets = torch.tensor([0, 2, 3, 4, 6])  # two features of two samples
    leaf = torch.ones(1, requires_grad=True)
    first = _Boom.apply(leaf) if boom else leaf * 1  # made first: its backward runs last
    out = embeddings(["items", "users"], ids, offsets)
    (out.pow(2).sum() + first.sum()).backward()


def test_a_backward_that_raises_leaves_no_gradient_for_the_next_pass() -> None:
    torch.manual_seed(0)
    broken, clean = TableBatchedEmbeddings(TABLES), TableBatchedEmbeddings(TABLES)
    clean.load_state_dict(broken.state_dict())
    with pytest.raises(RuntimeError, match="boom"):
        _step(broken, boom=True)
    assert len(broken._pending) == 1  # kept by a pass that never ended
    _step(broken)
    _step(clean)
    assert broken._pending == [] and broken.steps == clean.steps == 1
    torch.testing.assert_close(broken.weights, clean.weights, rtol=0, atol=0)
    torch.testing.assert_close(broken.state, clean.state, rtol=0, atol=0)


def test_the_update_count_is_saved_with_the_tables() -> None:
    embeddings = TableBatchedEmbeddings(TABLES)
    _step(embeddings)
    _step(embeddings)
    again = TableBatchedEmbeddings(TABLES)
    again.load_state_dict(embeddings.state_dict())
    assert again.steps == 2 and torch.equal(again.weights, embeddings.weights)
