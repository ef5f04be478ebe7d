"""The attention ops' argument checks and default gradient kernels in the conventions their
declarations call them with (search_space/<op>.py and <op>_grad.py: search_space.op.Op): a
check takes the op's whole signature; a gradient op's default takes its gradient problem's
arguments (grad_out, then the forward's) and returns [dq, dk, dv] and d rel_bias where the call
has a bias; `*_from_saved` reads the forward's saved output and statistics instead of running
the forward again. The kernels are kernels/attention.py's."""

from __future__ import annotations

import torch

from kernels import attention as _attn


def check_jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    max_seq_len: int,
    activation: str = "softmax",
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    rel_bias: torch.Tensor | None = None,
    scale: float | None = None,
) -> None:
    _attn.check_jagged_attention(
        q, k, v, offsets, max_seq_len=max_seq_len, activation=activation, num_targets=num_targets,
        rel_bias=rel_bias,
    )  # fmt: skip


def check_gdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor,
    *,
    activation: str = "gelu",
    scale: float | None = None,
    broadcast_q: bool = False,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
) -> None:
    _attn.check_gdpa(
        q, k, v, q_offsets, kv_offsets, activation=activation, broadcast_q=broadcast_q,
        max_q_len=max_q_len, max_kv_len=max_kv_len,
    )  # fmt: skip


def check_target_attention(
    q_cand: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    *,
    activation: str = "softmax",
    scale: float | None = None,
    max_candidates: int | None = None,
    max_history: int | None = None,
) -> None:
    _attn.check_target_attention(
        q_cand, k, v, kv_offsets, cand_to_request, activation=activation,
        max_candidates=max_candidates, max_history=max_history,
    )  # fmt: skip


def _as_problem_returns(grads: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv), and d rel_bias where the call has a bias."""
    return tuple(grads[:4]) if kwargs.get("rel_bias") is not None else tuple(grads[:3])


def jagged_attention_grad_from_saved(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    saved_output: torch.Tensor,
    saved_statistics: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, ...]:
    grads = _attn.jagged_attention_backward(
        grad_out, q, k, v, offsets, saved_output, saved_statistics, **kwargs
    )
    return _as_problem_returns(grads, kwargs)


def jagged_attention_grad(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, **kwargs
) -> tuple[torch.Tensor, ...]:
    out, lse = _attn.jagged_attention_forward(q, k, v, offsets, return_lse=True, **kwargs)
    return jagged_attention_grad_from_saved(grad_out, q, k, v, offsets, out, lse, **kwargs)


def target_attention_grad_from_saved(
    grad_out: torch.Tensor,
    q_cand: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    saved_output: torch.Tensor,
    saved_statistics: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, ...]:
    return _attn.target_attention_backward(
        grad_out, q_cand, k, v, kv_offsets, cand_to_request, saved_output, saved_statistics, **kwargs
    )


def target_attention_grad(
    grad_out: torch.Tensor,
    q_cand: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    cand_to_request: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, ...]:
    args = (q_cand, k, v, kv_offsets, cand_to_request)
    out, lse = _attn.target_attention_forward(*args, return_lse=True, **kwargs)
    return target_attention_grad_from_saved(grad_out, *args, out, lse, **kwargs)
