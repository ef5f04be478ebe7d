"""Gradients of request-broadcast target attention: dq for every candidate's seeds, dk and dv
of each request's history (summed over its candidates, never replicated)."""

from __future__ import annotations

from search_space import target_attention as forward
from search_space.attention_grads import grad_problem, grad_template, gradient_op

_TIMED = ("r15-c70-s32-h2000-softmax", "r15-c70-s128-h2000-silu")

PROBLEM = grad_problem(
    forward.PROBLEM,
    output_shape=lambda inputs: tuple(inputs.args[0].shape[:3]) + (inputs.args[2].shape[2],),
    timing_shapes=tuple(s for s in forward.TIMING_SHAPES if s.name in _TIMED),
)
TEMPLATE = grad_template(PROBLEM.name)
OP = gradient_op(
    forward.OP,
    PROBLEM,
    default="kernels.attention_ops:target_attention_grad",
    default_from_saved="kernels.attention_ops:target_attention_grad_from_saved",
)
