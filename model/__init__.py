"""A small GEM-like ads-ranking model whose embedding bags run on the kernel library."""

from model.embeddings import EmbeddingBagCollection, JaggedFeature, SparseFeatureConfig
from model.recommender import Recommender, RecommenderConfig
from model.train import Batch, make_synthetic_batch, serve, train_step

__all__ = [
    "Batch",
    "EmbeddingBagCollection",
    "JaggedFeature",
    "Recommender",
    "RecommenderConfig",
    "SparseFeatureConfig",
    "make_synthetic_batch",
    "serve",
    "train_step",
]
