"""The recommender trains and serves through the kernel library, and follows it when it changes."""

from __future__ import annotations

import copy
import functools
from collections import Counter
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from kernels.registry import ARCH_INTERPRETER, DISPATCHER, KernelLibrary, device_arch
from model import (
    Batch,
    Recommender,
    RecommenderConfig,
    SparseFeatureConfig,
    make_synthetic_batch,
    serve,
    train_step,
)
from search_space import embedding_bag as eb_problem

OP = "embedding_bag"
BATCH_SIZE = 16

# Tiny on purpose (interpreted Triton runs a few thousand elements a second); the dims cover a
# non-power of two (48, bucket d64) and all three pooling flavours.
CONFIG = RecommenderConfig(
    sparse_features=[
        SparseFeatureConfig(name="user_ids", num_rows=500, dim=16),
        SparseFeatureConfig(name="ad_ids", num_rows=1000, dim=48, pooling="mean"),
        SparseFeatureConfig(name="history", num_rows=300, dim=32, weighted=True, max_bag_length=30),
    ],
    num_dense_features=5,
    dense_mlp_dims=[16],
    interaction_mlp_dims=[32, 16],
)
NUM_FEATURES = len(CONFIG.sparse_features)


@pytest.fixture
def model(device: torch.device) -> Recommender:
    torch.manual_seed(0)
    return CONFIG.build(device)


@pytest.fixture
def batch(device: torch.device) -> Batch:
    return make_synthetic_batch(CONFIG, BATCH_SIZE, seed=1, device=device)


@pytest.fixture
def cheap_compile(monkeypatch) -> None:
    # The aot_eager backend traces what inductor would (dynamo, fake kernels, functionalized
    # graph) without its C++ codegen, which costs ~20 s cold on a CPU.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))


def _backward(model: Recommender, batch: Batch) -> None:
    logits_B = model(batch.dense_BF, batch.sparse)
    F.binary_cross_entropy_with_logits(logits_B, batch.labels_B).backward()


def _calls_during(fn: Callable[[], object]) -> Counter[tuple[str, str]]:
    before = DISPATCHER.calls.copy()
    fn()
    return DISPATCHER.calls - before


def test_train_step_updates_only_rows_looked_up(model: Recommender, batch: Batch) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tables_before = {name: t.detach().clone() for name, t in model.sparse_arch.tables.items()}

    losses = [train_step(model, batch, optimizer) for _ in range(3)]

    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], f"loss did not go down on a repeated batch: {losses}"
    for name, table in model.sparse_arch.tables.items():
        seen = torch.zeros(table.shape[0], dtype=torch.bool, device=table.device)
        seen[batch.sparse[name].indices] = True
        changed = (table.detach() != tables_before[name]).any(dim=1)
        assert seen.any() and not seen.all(), f"{name}: batch should use some rows, not all"
        unchanged_seen = seen & ~changed
        assert not unchanged_seen.any(), (
            f"{name}: rows looked up but not updated: {unchanged_seen.nonzero().flatten().tolist()}"
        )
        changed_unseen = ~seen & changed
        assert not changed_unseen.any(), (
            f"{name}: rows never looked up but updated: {changed_unseen.nonzero().flatten().tolist()}"
        )


def test_gradients_match_reference(model: Recommender, batch: Batch, monkeypatch) -> None:
    reference_model = copy.deepcopy(model)
    _backward(model, batch)
    # The reference model's lookups run the plain PyTorch reference under plain autograd.
    monkeypatch.setattr("model.embeddings.embedding_bag", eb_problem.reference)
    _backward(reference_model, batch)

    expected = dict(reference_model.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        expected_grad = expected[name].grad
        # Gradients are ~1e-4 here: atol scales with their size (as in search_space's
        # Tolerance) so that a relative error cannot hide under an absolute floor.
        torch.testing.assert_close(
            param.grad,
            expected_grad,
            atol=1e-5 * expected_grad.pow(2).mean().sqrt().item(),
            rtol=1e-5,
            msg=lambda m, name=name: f"gradient of {name}: {m}",
        )


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.usefixtures("cheap_compile")
def test_serve_matches_eager_forward(model: Recommender, batch: Batch, compile: bool) -> None:
    probs_B = serve(model, batch, compile=compile)

    with torch.no_grad():
        expected_B = torch.sigmoid(model(batch.dense_BF, batch.sparse))
    assert probs_B.shape == (BATCH_SIZE,)
    assert ((probs_B >= 0) & (probs_B <= 1)).all(), probs_B
    torch.testing.assert_close(probs_B, expected_B, atol=1e-6, rtol=1e-5)


@pytest.mark.usefixtures("cheap_compile")
def test_registered_kernel_replaces_default_in_training_and_serving(
    model: Recommender, batch: Batch, empty_library: KernelLibrary, device: torch.device
) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    default = Counter({(OP, "default"): NUM_FEATURES})
    # Training also dispatches each table's gradient (the op's backward is an op of its own).
    backward = Counter({(f"{OP}_backward", "default"): NUM_FEATURES})

    assert _calls_during(lambda: train_step(model, batch, optimizer)) == default + backward
    assert DISPATCHER.last[OP] == "default"
    probs_default_B = serve(model, batch)
    assert _calls_during(lambda: serve(model, batch, compile=True)) == default
    assert DISPATCHER.last[OP] == "default"

    arch = device_arch(device)
    source = eb_problem.TEMPLATE.render({"BLOCK_D": 32, "BLOCK_L": 8, "BLOCK_B": 2, "ACC_3D": True})
    entry = empty_library.add(
        op=OP,
        entry=eb_problem.TEMPLATE.entry,
        source=source,
        arch=arch,
        dtype="fp32",
        buckets=sorted(
            {eb_problem.bucket_of(f.dim, ids) for f in CONFIG.sparse_features for ids in (1, 20)}
        ),  # both bag regimes of every feature's dim
        median_us=None,
        interpreted=arch == ARCH_INTERPRETER,
        evidence={},
        provenance={"test": "registered_kernel_replaces_default"},
    )
    name = f"library:{entry.kernel_id}"
    registered = Counter({(OP, name): NUM_FEATURES})

    # Serving first, with the weights unchanged: the new kernel must give the same answer.
    probs_library_B = serve(model, batch)
    assert DISPATCHER.last[OP] == name
    torch.testing.assert_close(probs_library_B, probs_default_B, atol=1e-6, rtol=1e-5)
    # The graph compiled before registration picks the kernel up: dispatch is inside the op.
    assert _calls_during(lambda: serve(model, batch, compile=True)) == registered
    assert _calls_during(lambda: train_step(model, batch, optimizer)) == registered + backward
    assert DISPATCHER.last[OP] == name


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "ad.ids", "num_rows": 10, "dim": 16}, "identifier"),
        ({"name": "ad_ids", "num_rows": 0, "dim": 16}, "must be >= 1"),
        ({"name": "ad_ids", "num_rows": 10, "dim": 16, "pooling": "max"}, "pooling"),
        ({"name": "ad_ids", "num_rows": 10, "dim": 16, "pooling": "mean", "weighted": True}, "sum"),
    ],
)
def test_feature_config_rejects_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SparseFeatureConfig(**kwargs)


def test_model_config_rejects_bad_input() -> None:
    feature = SparseFeatureConfig(name="ad_ids", num_rows=10, dim=16)
    with pytest.raises(ValueError, match="at least one sparse feature"):
        RecommenderConfig(sparse_features=[])
    with pytest.raises(ValueError, match="dense_mlp_dims"):
        RecommenderConfig(sparse_features=[feature], dense_mlp_dims=[])
    with pytest.raises(ValueError, match="unique"):
        RecommenderConfig(sparse_features=[feature, feature]).build()
