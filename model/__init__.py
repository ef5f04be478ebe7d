"""The GEM-class ads ranking model, on the kernel library: its config (model.config), synthetic
traffic (model.data), the model (model.gem), training (model.training), serving (model.serving)
and profiles per op (model.profile). It imports torch and kernels only."""

from model.config import ModelConfig, load_config
from model.data import Batches, RequestBatch, TrafficGenerator
from model.gem import GEMModel

__all__ = ["Batches", "GEMModel", "ModelConfig", "RequestBatch", "TrafficGenerator", "load_config"]
