"""Gradients of generalized dot-product attention: dq (summed over samples for broadcast query
seeds), dk, dv."""

from __future__ import annotations

from search_space import gdpa as forward
from search_space.attention_grads import grad_problem, grad_template, gradient_op
from search_space.problem import Inputs


def _output_shape(inputs: Inputs) -> tuple[int, ...]:
    q, _, v, _, kv_offsets = inputs.args
    rows = q.shape[0] * (kv_offsets.numel() - 1) if inputs.kwargs.get("broadcast_q") else q.shape[0]
    return (rows, q.shape[1], v.shape[2])


_TIMED = ("self-b1024-n2048-s0.5-gelu", "broadcast-b1024-seeds256-kv1024-s0.75-silu")

PROBLEM = grad_problem(
    forward.PROBLEM,
    output_shape=_output_shape,
    timing_shapes=tuple(s for s in forward.TIMING_SHAPES if s.name in _TIMED),
)
TEMPLATE = grad_template(PROBLEM.name)
# Pointwise attention has no forward statistics to read: gdpa_backward takes the problem's arguments.
OP = gradient_op(forward.OP, PROBLEM, default="kernels.attention:gdpa_backward")
