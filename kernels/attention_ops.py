"""The attention ops' argument checks and default gradient kernels in the conventions their
declarations call them with (search_space/<op>.py and <op>_grad.py: search_space.op.Op): a
check takes the op's whole signature; a gradient op's default takes its gradient problem's
arguments (grad_out, then the forward's) and returns [dq, dk, dv] and d rel_bias where the call
has a bias; `*_from_saved` reads the forward's saved output and statistics instead of running
the forward again. The kernels are kernels.attention's (the kit's forward, kernels/kit, and
backward.py)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from kernels import attention as _attn


def _given_what_it_takes(check: Callable[..., None]) -> Callable[..., None]:
    """`check` (kernels.attention's) called with its op's whole signature: the keywords it does
    not take (causal, scale) are left out."""
    takes = set(inspect.signature(check).parameters)

    def call(*args, **kwargs) -> None:
        check(*args, **{name: value for name, value in kwargs.items() if name in takes})

    return call


check_jagged_attention = _given_what_it_takes(_attn.check_jagged_attention)
check_gdpa = _given_what_it_takes(_attn.check_gdpa)
check_target_attention = _given_what_it_takes(_attn.check_target_attention)


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
