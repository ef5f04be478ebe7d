"""Gradients of jagged attention (HSTU / Jagged Flash Attention): dq, dk, dv and d rel_bias."""

from __future__ import annotations

from search_space import jagged_attention as forward
from search_space.attention_grads import grad_problem, grad_template, gradient_op

# Where padded SDPA's autograd fits on one GPU (the 512-sequence HSTU layer with a bias does not).
_TIMED = ("b512-n1024-uniform-softmax", "b256-n4096-power-softmax", "b256-n4096-uniform-silu")

PROBLEM = grad_problem(
    forward.PROBLEM,
    output_shape=lambda inputs: tuple(inputs.args[0].shape[:2]) + (inputs.args[2].shape[2],),
    timing_shapes=tuple(s for s in forward.TIMING_SHAPES if s.name in _TIMED),
)
TEMPLATE = grad_template(PROBLEM.name)
OP = gradient_op(
    forward.OP,
    PROBLEM,
    default="kernels.attention_ops:jagged_attention_grad",
    default_from_saved="kernels.attention_ops:jagged_attention_grad_from_saved",
)
