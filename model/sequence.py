"""The user-history side of the model: an HSTU-style jagged sequence encoder over each request's
history, and request-broadcast target attention from every candidate to its request's history.

Both attention calls go through `kernels.ops`, so whichever kernels the library holds for them
run in training and serving alike. Layout: history tokens are jagged `[total_tokens, ...]`
with `offsets [R + 1]` per request; the batch's rows are candidates, `cand_to_request [B]`
names each one's request, and a request's history is encoded once, however many candidates it
has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.ops import jagged_attention, target_attention


@dataclass(kw_only=True)
class SequenceConfig:
    """An HSTU encoder of `num_layers` layers (model_dim, heads x head_dim, pointwise silu
    attention with a relative-position bias) and `num_seeds` target-attention queries per
    candidate; items come from a table of `num_items` rows."""

    num_items: int
    model_dim: int = 64
    num_heads: int = 2
    head_dim: int = 32
    num_layers: int = 2
    num_buckets: int = 32
    max_seq_len: int = 256
    num_seeds: int = 2

    def __post_init__(self) -> None:
        for name in ("num_items", "model_dim", "num_heads", "num_layers", "max_seq_len", "num_seeds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim < 16 or self.head_dim & (self.head_dim - 1):
            raise ValueError(f"head_dim must be a power of two >= 16, got {self.head_dim}")

    @property
    def output_dim(self) -> int:
        return self.num_seeds * self.num_heads * self.head_dim


@dataclass(kw_only=True)
class UserHistory:
    """Each request's item history (jagged) and which request each candidate belongs to."""

    item_ids: torch.Tensor  # [total_tokens] int64
    offsets: torch.Tensor  # [R + 1] int64
    cand_to_request: torch.Tensor  # [B] int64
    candidate_item_ids: torch.Tensor  # [B] int64

    def to(self, device: torch.device | str) -> UserHistory:
        return UserHistory(
            item_ids=self.item_ids.to(device),
            offsets=self.offsets.to(device),
            cand_to_request=self.cand_to_request.to(device),
            candidate_item_ids=self.candidate_item_ids.to(device),
        )


class HSTULayer(nn.Module):
    """x + W_o(norm(attn) * u) with [u, v, q, k] = silu(W norm(x)) and jagged attention
    (pointwise silu, or softmax), causal within each sequence, a sequence's last `num_targets`
    tokens seeing the history and themselves only, with a learned relative-position bias."""

    def __init__(
        self,
        model_dim: int,
        num_heads: int,
        head_dim: int,
        *,
        num_buckets: int,
        max_seq_len: int,
        activation: str = "silu",
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.max_seq_len, self.activation = max_seq_len, activation
        inner = num_heads * head_dim
        self.norm_in = nn.LayerNorm(model_dim, device=device)
        self.uvqk = nn.Linear(model_dim, 4 * inner, device=device)
        self.norm_attn = nn.LayerNorm(inner, device=device)
        self.out = nn.Linear(inner, model_dim, device=device)
        self.rel_bias = nn.Parameter(torch.zeros(num_heads, num_buckets, device=device))

    def forward(
        self, x_TM: torch.Tensor, offsets: torch.Tensor, num_targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        u_TI, v_TI, q_TI, k_TI = F.silu(self.uvqk(self.norm_in(x_TM))).chunk(4, dim=1)
        heads = (-1, self.num_heads, self.head_dim)
        attn_THD = jagged_attention(
            q_TI.reshape(heads),
            k_TI.reshape(heads),
            v_TI.reshape(heads),
            offsets,
            max_seq_len=self.max_seq_len,
            activation=self.activation,
            causal=True,
            num_targets=num_targets,
            rel_bias=self.rel_bias,
        )
        gated_TI = self.norm_attn(attn_THD.reshape(x_TM.shape[0], -1)) * u_TI
        return x_TM + self.out(gated_TI)


class SequenceArch(nn.Module):
    """History encoder plus target attention: [B] candidates -> [B, output_dim] features."""

    def __init__(self, config: SequenceConfig, *, device: torch.device | None = None) -> None:
        super().__init__()
        self.config = config
        inner = config.num_heads * config.head_dim
        self.items = nn.Embedding(config.num_items, config.model_dim, device=device)
        self.layers = nn.ModuleList(
            HSTULayer(
                config.model_dim,
                config.num_heads,
                config.head_dim,
                num_buckets=config.num_buckets,
                max_seq_len=config.max_seq_len,
                device=device,
            )
            for _ in range(config.num_layers)
        )
        self.kv = nn.Linear(config.model_dim, 2 * inner, device=device)
        self.seeds = nn.Linear(config.model_dim, config.num_seeds * inner, device=device)

    def forward(self, history: UserHistory) -> torch.Tensor:
        c = self.config
        x_TM = self.items(history.item_ids)
        for layer in self.layers:
            x_TM = layer(x_TM, history.offsets)
        k_TI, v_TI = self.kv(x_TM).chunk(2, dim=1)
        cand_BM = self.items(history.candidate_item_ids)
        q_BSHD = self.seeds(cand_BM).reshape(-1, c.num_seeds, c.num_heads, c.head_dim)
        pooled_BSHD = target_attention(
            q_BSHD,
            k_TI.reshape(-1, c.num_heads, c.head_dim),
            v_TI.reshape(-1, c.num_heads, c.head_dim),
            history.offsets,
            history.cand_to_request,
            activation="softmax",
        )
        return pooled_BSHD.reshape(q_BSHD.shape[0], -1)
