"""Synthetic batches, one training step and serving for `Recommender`."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.embeddings import JaggedFeature
from model.recommender import Recommender, RecommenderConfig
from search_space import workload
from search_space.embedding_bag import bag_lengths


@dataclass(kw_only=True)
class Batch:
    dense_BF: torch.Tensor  # [B, num_dense_features]
    sparse: dict[str, JaggedFeature]  # each with B bags
    labels_B: torch.Tensor  # [B] float, 1.0 for a click

    @property
    def batch_size(self) -> int:
        return self.dense_BF.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            dense_BF=self.dense_BF.to(device),
            sparse={name: jagged.to(device) for name, jagged in self.sparse.items()},
            labels_B=self.labels_B.to(device),
        )


def make_synthetic_batch(
    config: RecommenderConfig,
    batch_size: int,
    seed: int,
    device: torch.device | str = "cpu",
    *,
    empty_fraction: float = 0.1,
) -> Batch:
    """A batch with power-law bag lengths in [1, max_bag_length], about `empty_fraction` of the
    bags of each feature empty (users without that signal), and skewed ids (hot rows repeat)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0.0 <= empty_fraction <= 1.0:
        raise ValueError(f"empty_fraction must be in [0, 1], got {empty_fraction}")
    # Generated on the CPU so that a seed gives the same batch on every device.
    gen = torch.Generator().manual_seed(seed)
    cpu = torch.device("cpu")
    sparse = {}
    for f in config.sparse_features:
        lengths_B = bag_lengths(batch_size, f.max_bag_length, workload.BAG_LENGTH_ALPHA, gen, cpu)
        lengths_B[torch.rand(batch_size, generator=gen) < empty_fraction] = 0
        offsets = torch.zeros(batch_size + 1, dtype=torch.int64)
        torch.cumsum(lengths_B, 0, out=offsets[1:])
        nnz = int(offsets[-1])
        # Log-uniform ids: P(id near k) ~ 1/k, a Zipf-like popularity as in production logs.
        log_ids = torch.rand(nnz, generator=gen, dtype=torch.float64) * math.log(f.num_rows)
        indices = (log_ids.exp().floor().long() - 1).clamp_(0, f.num_rows - 1)
        weights = torch.rand(nnz, generator=gen) if f.weighted else None
        sparse[f.name] = JaggedFeature(indices=indices, offsets=offsets, weights=weights)
    dense_BF = torch.randn(batch_size, config.num_dense_features, generator=gen)
    # Clicks depend on the dense features, so a model has something to learn.
    ctr_B = torch.sigmoid(dense_BF.sum(1) / math.sqrt(config.num_dense_features) - 1.0)
    labels_B = torch.bernoulli(ctr_B, generator=gen)
    return Batch(dense_BF=dense_BF, sparse=sparse, labels_B=labels_B).to(device)


def train_step(model: Recommender, batch: Batch, optimizer: torch.optim.Optimizer) -> float:
    """One step of binary cross-entropy on the click labels; returns the loss."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    logits_B = model(batch.dense_BF, batch.sparse)
    loss = F.binary_cross_entropy_with_logits(logits_B, batch.labels_B)
    loss.backward()
    optimizer.step()
    return loss.item()


_COMPILED: weakref.WeakKeyDictionary[Recommender, Callable[..., torch.Tensor]] = weakref.WeakKeyDictionary()


def serve(model: Recommender, batch: Batch, *, compile: bool = False) -> torch.Tensor:
    """Click probabilities [B] in eval mode without autograd. With `compile`, the model runs
    through torch.compile (compiled once per model); the embedding-bag custom op stays opaque to
    the compiler, so kernels registered later are still picked up without recompiling."""
    model.eval()
    forward: Callable[..., torch.Tensor] = model
    if compile:
        if model not in _COMPILED:
            _COMPILED[model] = torch.compile(model)
        forward = _COMPILED[model]
    with torch.inference_mode():
        return torch.sigmoid(forward(batch.dense_BF, batch.sparse))
