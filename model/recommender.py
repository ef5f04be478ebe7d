"""A small ads-ranking model with the layout of GEM-class rankers: pooled embedding bags for the
sparse features, an MLP for the dense ones, an interaction MLP over both, and a CTR logit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from model.embeddings import EmbeddingBagCollection, JaggedFeature, SparseFeatureConfig
from model.sequence import SequenceArch, SequenceConfig, UserHistory


@dataclass(kw_only=True)
class RecommenderConfig:
    sparse_features: list[SparseFeatureConfig]
    num_dense_features: int = 13
    dense_mlp_dims: list[int] = field(default_factory=lambda: [64, 32])
    interaction_mlp_dims: list[int] = field(default_factory=lambda: [128, 64])
    # The user-history encoder and target attention; None: a model of sparse and dense features only.
    sequence: SequenceConfig | None = None

    def __post_init__(self) -> None:
        if not self.sparse_features:
            raise ValueError("a recommender needs at least one sparse feature")
        if self.num_dense_features < 1:
            raise ValueError(f"num_dense_features must be >= 1, got {self.num_dense_features}")
        for name in ("dense_mlp_dims", "interaction_mlp_dims"):
            dims = getattr(self, name)
            if not dims or min(dims) < 1:
                raise ValueError(f"{name} must be a non-empty list of positive sizes, got {dims}")

    def build(self, device: torch.device | str | None = None) -> Recommender:
        return Recommender(self, device=torch.device(device) if device is not None else None)


def mlp(in_dim: int, dims: Sequence[int], *, device: torch.device | None = None) -> nn.Sequential:
    """Linear + ReLU for each size in `dims`."""
    layers: list[nn.Module] = []
    for out_dim in dims:
        layers += [nn.Linear(in_dim, out_dim, device=device), nn.ReLU()]
        in_dim = out_dim
    return nn.Sequential(*layers)


class Recommender(nn.Module):
    def __init__(self, config: RecommenderConfig, *, device: torch.device | None = None) -> None:
        super().__init__()
        self.config = config
        self.sparse_arch = EmbeddingBagCollection(config.sparse_features, device=device)
        self.dense_arch = mlp(config.num_dense_features, config.dense_mlp_dims, device=device)
        interaction_in = self.sparse_arch.output_dim + config.dense_mlp_dims[-1]
        self.sequence_arch = None
        if config.sequence is not None:
            self.sequence_arch = SequenceArch(config.sequence, device=device)
            interaction_in += config.sequence.output_dim
        self.interaction_arch = mlp(interaction_in, config.interaction_mlp_dims, device=device)
        self.head = nn.Linear(config.interaction_mlp_dims[-1], 1, device=device)

    def forward(
        self,
        dense_BF: torch.Tensor,
        sparse: Mapping[str, JaggedFeature],
        history: UserHistory | None = None,
    ) -> torch.Tensor:
        """dense_BF [B, num_dense_features]; sparse: feature name -> B bags; history: the requests'
        item histories (needed when the config has a sequence encoder) -> CTR logits [B]."""
        features = [self.sparse_arch(sparse), self.dense_arch(dense_BF)]
        if self.sequence_arch is not None:
            if history is None:
                raise ValueError("this model encodes user histories: pass history=UserHistory(...)")
            features.append(self.sequence_arch(history))
        hidden_BH = self.interaction_arch(torch.cat(features, dim=1))
        return self.head(hidden_BH).squeeze(1)
