"""A small GEM-like ads-ranking model whose embedding bags and attention run on the kernel library."""

from model.embeddings import EmbeddingBagCollection, JaggedFeature, SparseFeatureConfig
from model.recommender import Recommender, RecommenderConfig
from model.sequence import HSTULayer, SequenceArch, SequenceConfig, UserHistory
from model.train import Batch, make_synthetic_batch, serve, train_step

__all__ = [
    "Batch",
    "EmbeddingBagCollection",
    "HSTULayer",
    "JaggedFeature",
    "Recommender",
    "RecommenderConfig",
    "SequenceArch",
    "SequenceConfig",
    "SparseFeatureConfig",
    "UserHistory",
    "make_synthetic_batch",
    "serve",
    "train_step",
]
