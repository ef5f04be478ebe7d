"""The model's FLOPs, counted analytically per op from a batch's sizes, and the GPU's peak.

A multiply-add is two FLOPs. The count is what `GEMModel.forward` computes (the request-oriented
path: the user's share once per request), matrix products and attention scores and sums; the
pooling sums of the embedding bags count one FLOP per element added. A training step counts the
forward and twice the forward's matrix work for the backward (the input's and the weights'
gradients); pooling's backward is a scatter of the same size. MFU is model FLOPs per second over
the device's dense peak at the dtype the matrix work runs in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import ModelConfig
from model.data import RequestBatch

# Dense peaks (FLOP/s, without sparsity) by device name and compute dtype: tensor cores for
# bf16 and fp16; for fp32 the vector units' (the library multiplies fp32 in full fp32, and
# torch.matmul does by default: no TF32).
PEAKS: dict[str, dict[torch.dtype, float]] = {
    "H200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 66.9e12},
    "H100": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 66.9e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak at `dtype` where it is known (None on a CPU or an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAKS.items():
        if key in name:
            return peaks.get(dtype)
    return None


@dataclass(frozen=True)
class BatchSizes:
    """What a batch's FLOPs depend on (read once, on the host)."""

    requests: int
    candidates: int
    history_tokens: int
    # Sum over requests of the attention pairs each HSTU layer computes (causal, with targets).
    history_pairs: int
    # Sum over candidates of their request's history length (target attention's keys).
    candidate_history: int
    # Ids per feature.
    feature_ids: dict[str, int]

    @classmethod
    def of(cls, batch: RequestBatch, *, candidates_as_targets: bool = False) -> BatchSizes:
        hist = (batch.history_offsets[1:] - batch.history_offsets[:-1]).cpu().long()
        cands = (batch.candidate_offsets[1:] - batch.candidate_offsets[:-1]).cpu().long()
        pairs = hist * (hist + 1) // 2
        if candidates_as_targets:
            pairs = pairs + cands * (hist + 1)
        ids = {name: int(b.ids.shape[0]) for name, b in (batch.user_features | batch.item_features).items()}
        return cls(
            requests=batch.num_requests,
            candidates=batch.num_candidates,
            history_tokens=int(hist.sum()),
            history_pairs=int(pairs.sum()),
            candidate_history=int((hist * cands).sum()),
            feature_ids=ids,
        )


def forward_flops(config: ModelConfig, s: BatchSizes) -> dict[str, float]:
    """FLOPs of one forward, by component: embeddings, history, scoring, dense, interaction,
    heads (each split into `.matmul`, `.attention`, `.pooling`, and the Wukong block's `.fm` and
    the experts' `.experts`, where it has them)."""
    c, d = config, config.interaction.dim
    R, B = s.requests, s.candidates
    out: dict[str, float] = {}

    pooling = projection = 0.0
    for f in c.features:
        table = c.table(f.table)
        bags = R if f.side == "user" else B
        pooling += s.feature_ids.get(f.name, 0) * table.dim
        if table.dim != d:
            projection += 2 * bags * table.dim * d
    out["embeddings.pooling"] = pooling
    out["embeddings.matmul"] = projection

    h = c.history
    if h is not None:
        inner = h.num_heads * h.head_dim
        item_dim = c.table(h.item_table).dim
        tokens = s.history_tokens + (B if h.candidates_as_targets else 0)
        # The history's item rows and the candidates' tokens (scoring's queries).
        out["embeddings.pooling"] += (s.history_tokens + B) * item_dim
        layer = 2 * tokens * h.model_dim * 4 * inner + 2 * tokens * inner * h.model_dim
        out["history.matmul"] = 2 * (s.history_tokens + B) * item_dim * h.model_dim + h.num_layers * layer
        # Scores and weighted sums: two products of head_dim per allowed pair and head.
        out["history.attention"] = h.num_layers * 4 * s.history_pairs * inner
        seeds = c.scoring.num_seeds
        out["scoring.matmul"] = (
            2 * s.history_tokens * h.model_dim * 2 * inner
            + 2 * B * h.model_dim * seeds * inner
            + 2 * B * seeds * inner * d
        )
        out["scoring.attention"] = 4 * seeds * s.candidate_history * inner
        if h.candidates_as_targets:
            out["scoring.matmul"] += 2 * B * h.model_dim * d

    out["dense.matmul"] = 2 * B * c.data.num_dense * d

    i = c.interaction
    n_user = len(c.features_of("user"))
    n = n_user + len(c.features_of("item")) + 1
    if h is not None:
        n += c.scoring.num_seeds + (1 if h.candidates_as_targets else 0)
    interaction = fm = 0.0
    for index in range(i.num_layers):
        n_u = n_user if index == 0 else 0
        n_c = n - n_u
        n_out = i.outputs
        # wukong_fm: X^T Y with the user's rows once per request (what the model needs; the
        # default kernel forms it per candidate) and X (X^T Y) for every candidate.
        fm += 2 * (R * n_u + B * n_c) * d * i.fm_rank + 2 * B * n * d * i.fm_rank
        dims = [n * i.fm_rank, *i.mlp_dims, i.fm_outputs * d]
        interaction += sum(2 * B * a * b for a, b in zip(dims, dims[1:], strict=False))
        interaction += 2 * (R * n_u + B * n_c) * i.compressed_outputs * d
        if n_out != n:
            interaction += 2 * (R * n_u + B * n_c) * n_out * d
        n = n_out
    out["interaction.matmul"] = interaction
    out["interaction.fm"] = fm

    hd = c.heads
    flat = n * d
    heads = 0.0
    if hd.num_experts:
        heads += 2 * B * flat * hd.num_experts  # the gate
        # The experts' two grouped products over the top_k rows routed per candidate.
        out["heads.experts"] = hd.top_k * B * (2 * flat * hd.expert_dim + 2 * hd.expert_dim * hd.expert_dim)
        flat = hd.expert_dim
    dims = [flat, *hd.mlp_dims, 1]
    heads += len(hd.tasks) * sum(2 * B * a * b for a, b in zip(dims, dims[1:], strict=False))
    out["heads.matmul"] = heads
    return out


def training_flops(forward: dict[str, float]) -> dict[str, float]:
    """A training step's FLOPs: the forward, plus twice its matrix and attention work (input
    and weight gradients), plus pooling's scatter."""
    return {k: v * (2 if k.endswith(".pooling") else 3) for k, v in forward.items()}


def by_component(flops: dict[str, float]) -> dict[str, float]:
    """Sums per component (the part before the dot)."""
    out: dict[str, float] = {}
    for key, value in flops.items():
        component = key.split(".")[0]
        out[component] = out.get(component, 0.0) + value
    return out
