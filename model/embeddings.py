"""Sparse features and the embedding-bag collection that pools them.

Every lookup goes through `kernels.ops.embedding_bag`, so whichever kernel the dispatcher picks
for a table's (arch, dtype, dim bucket) runs in training and serving alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from kernels.ops import embedding_bag


@dataclass(kw_only=True)
class SparseFeatureConfig:
    """One categorical feature: an embedding table of `num_rows` x `dim`, pooled per sample."""

    name: str
    num_rows: int
    dim: int
    pooling: Literal["sum", "mean"] = "sum"
    max_bag_length: int = 20
    # Per-id weights (e.g. recency or counts) scaling each row before a sum pooling.
    weighted: bool = False

    def __post_init__(self) -> None:
        # Names become ParameterDict keys, which reject dots and other non-identifiers.
        if not self.name.isidentifier():
            raise ValueError(f"feature name must be a Python identifier, got {self.name!r}")
        if self.num_rows < 1 or self.dim < 1 or self.max_bag_length < 1:
            raise ValueError(
                f"feature {self.name!r}: num_rows, dim and max_bag_length must be >= 1, got "
                f"{self.num_rows}, {self.dim}, {self.max_bag_length}"
            )
        if self.pooling not in ("sum", "mean"):
            raise ValueError(f"feature {self.name!r}: pooling must be 'sum' or 'mean', got {self.pooling!r}")
        if self.weighted and self.pooling != "sum":
            raise ValueError(f"feature {self.name!r}: weighted ids need pooling='sum'")


@dataclass(kw_only=True)
class JaggedFeature:
    """The ids of one feature for a batch: bag b is indices[offsets[b]:offsets[b + 1]]."""

    indices: torch.Tensor  # [nnz] int64
    offsets: torch.Tensor  # [B + 1] int64
    weights: torch.Tensor | None = None  # [nnz], only for weighted features

    def to(self, device: torch.device | str) -> JaggedFeature:
        return JaggedFeature(
            indices=self.indices.to(device),
            offsets=self.offsets.to(device),
            weights=None if self.weights is None else self.weights.to(device),
        )


class EmbeddingBagCollection(nn.Module):
    """One table per sparse feature; forward pools each feature's bags and concatenates them."""

    def __init__(
        self, features: Sequence[SparseFeatureConfig], *, device: torch.device | None = None
    ) -> None:
        super().__init__()
        names = [f.name for f in features]
        if len(set(names)) != len(names):
            raise ValueError(f"sparse feature names must be unique, got {names}")
        self.features = list(features)
        self.tables = nn.ParameterDict(
            {f.name: nn.Parameter(torch.empty(f.num_rows, f.dim, device=device)) for f in features}
        )
        self.reset_parameters()

    @property
    def output_dim(self) -> int:
        return sum(f.dim for f in self.features)

    def reset_parameters(self) -> None:
        # torchrec's default: U(-1/sqrt(num_rows), 1/sqrt(num_rows)) keeps pooled sums of hot
        # rows small at the start whatever the table size.
        for f in self.features:
            bound = 1.0 / math.sqrt(f.num_rows)
            nn.init.uniform_(self.tables[f.name], -bound, bound)

    def forward(self, sparse: Mapping[str, JaggedFeature]) -> torch.Tensor:
        """sparse: feature name -> its JaggedFeature, all with B bags -> pooled [B, sum of dims]."""
        missing = [f.name for f in self.features if f.name not in sparse]
        if missing:
            raise ValueError(f"batch lacks sparse feature(s) {missing}")
        pooled = []
        for f in self.features:
            jagged = sparse[f.name]
            pooled_BD = embedding_bag(
                self.tables[f.name],
                jagged.indices,
                jagged.offsets,
                mode=f.pooling,
                per_sample_weights=jagged.weights,
            )
            pooled.append(pooled_BD)
        return torch.cat(pooled, dim=1)
