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
from model.sequence import SequenceConfig, UserHistory

# Candidates scored per request in a synthetic batch (a serving request ranks tens of ads).
CANDIDATES_PER_REQUEST = 4
# Exponent of the truncated power law P(L) ~ L^-a of synthetic bag and history lengths: the
# production pooling factors that the kernels' workload assumes too (a mean bag of about 19 ids
# in 1..120, with a long tail).
LENGTH_ALPHA = 1.1


def power_law_lengths(count: int, max_len: int, gen: torch.Generator) -> torch.Tensor:
    """`count` lengths in [1, max_len], int64 on the CPU, P(L) proportional to L^-LENGTH_ALPHA."""
    probs = torch.arange(1, max_len + 1, dtype=torch.float32).pow(-LENGTH_ALPHA)
    return torch.multinomial(probs / probs.sum(), count, replacement=True, generator=gen) + 1


@dataclass(kw_only=True)
class Batch:
    dense_BF: torch.Tensor  # [B, num_dense_features]
    sparse: dict[str, JaggedFeature]  # each with B bags
    labels_B: torch.Tensor  # [B] float, 1.0 for a click
    history: UserHistory | None = None  # for models with a sequence encoder

    @property
    def batch_size(self) -> int:
        return self.dense_BF.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            dense_BF=self.dense_BF.to(device),
            sparse={name: jagged.to(device) for name, jagged in self.sparse.items()},
            labels_B=self.labels_B.to(device),
            history=None if self.history is None else self.history.to(device),
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
    sparse = {}
    for f in config.sparse_features:
        lengths_B = power_law_lengths(batch_size, f.max_bag_length, gen)
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
    history = None
    if config.sequence is not None:
        history = synthetic_history(config.sequence, batch_size, gen, empty_fraction=empty_fraction)
    return Batch(dense_BF=dense_BF, sparse=sparse, labels_B=labels_B, history=history).to(device)


def synthetic_history(
    config: SequenceConfig, batch_size: int, gen: torch.Generator, *, empty_fraction: float = 0.1
) -> UserHistory:
    """Candidates grouped into requests of about CANDIDATES_PER_REQUEST (in order, as a serving
    batch arrives), each request with a power-law history in [1, max_seq_len] (some empty)."""
    num_requests = max(1, math.ceil(batch_size / CANDIDATES_PER_REQUEST))
    cand_to_request = torch.arange(batch_size) * num_requests // batch_size
    lengths_R = power_law_lengths(num_requests, config.max_seq_len, gen)
    lengths_R[torch.rand(num_requests, generator=gen) < empty_fraction] = 0
    offsets = torch.zeros(num_requests + 1, dtype=torch.int64)
    torch.cumsum(lengths_R, 0, out=offsets[1:])
    return UserHistory(
        item_ids=torch.randint(0, config.num_items, (int(offsets[-1]),), generator=gen),
        offsets=offsets,
        cand_to_request=cand_to_request,
        candidate_item_ids=torch.randint(0, config.num_items, (batch_size,), generator=gen),
    )


def train_step(model: Recommender, batch: Batch, optimizer: torch.optim.Optimizer) -> float:
    """One step of binary cross-entropy on the click labels; returns the loss."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    logits_B = model(batch.dense_BF, batch.sparse, batch.history)
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
        return torch.sigmoid(forward(batch.dense_BF, batch.sparse, batch.history))
