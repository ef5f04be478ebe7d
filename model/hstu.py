"""The HSTU layer: the sequence encoder of generative recommenders, over jagged histories.

Its attention goes through `kernels.ops.jagged_attention`, and the norm of its output with the
gate through `kernels.ops.layer_norm_gate` (one pass over the activations, forward and
backward), so whichever kernels the library holds for the calls' buckets run in training and
serving alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.ops import jagged_attention, layer_norm_gate


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
        # norm_attn holds the norm's parameters (and its eps); the norm and the gate run as one op.
        norm = self.norm_attn
        attn_TI = attn_THD.reshape(x_TM.shape[0], self.num_heads * self.head_dim)
        gated_TI = layer_norm_gate(attn_TI, u_TI, norm.weight, norm.bias, norm.eps)
        return x_TM + self.out(gated_TI)
