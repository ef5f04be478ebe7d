"""layer_norm_gate_grad: the gradients of layer_norm_gate (search_space/layer_norm_gate.py),

    y = xhat * weight + bias,  xhat = (x - mean) * rstd        (per row of I elements)
    du = g * y,   dy = g * u,   dweight = sum_rows dy * xhat,   dbias = sum_rows dy,
    dx = rstd * (dy weight - mean_I(dy weight) - xhat * mean_I(dy weight xhat))

grad_out g [T, I] (x's dtype), then layer_norm_gate's arguments -> (dx, du, dweight, dbias), each
in its argument's dtype, computed in fp32. The call goes from the forward's inputs to the
gradients: the row statistics are the candidate's to recompute (they cost no memory traffic: x
is read anyway). dweight and dbias are sums over every row, as many as the batch's tokens. This
is layer_norm_gate's gradient op: its backward dispatches it, so a kernel a campaign registers
here runs in training.
"""

from __future__ import annotations

import dataclasses

import torch

from search_space import layer_norm_gate as forward
from search_space.op import Op, gradient_signature
from search_space.problem import Inputs, Shape, Tolerance
from search_space.template import Knob, KnobTemplate

NAME = ENTRY = "layer_norm_gate_grad"


def reference(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients written out, in fp64, each cast once: the oracle's own rounding is far
    below any dtype's bound. (In fp32, on an H100, the sums over 70,001 rows for dweight and
    dbias came out about as far from the exact ones as a correct kernel's, and such a kernel
    failed against them; a row of one value also has xhat exactly 0 only if its mean is exact.)
    (No autograd: dispatch runs this inside a custom op, where autograd is switched off.)"""
    if x.shape[0] == 0:  # no rows: nothing to normalize, sums of nothing
        return x.clone(), u.clone(), torch.zeros_like(weight), torch.zeros_like(bias)
    g, xs, us, w, b = (t.to(torch.float64) for t in (grad_out, x, u, weight, bias))
    var, mean = torch.var_mean(xs, dim=1, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    xhat = (xs - mean) * rstd
    du = g * (xhat * w + b)
    dy = g * us
    dyw = dy * w
    dx = rstd * (dyw - dyw.mean(dim=1, keepdim=True) - xhat * (dyw * xhat).mean(dim=1, keepdim=True))
    dweight, dbias = (dy * xhat).sum(0), dy.sum(0)
    return dx.to(x.dtype), du.to(u.dtype), dweight.to(weight.dtype), dbias.to(bias.dtype)


def autograd_of_eager(grad_out, x, u, weight, bias, eps=1e-5):
    """What autograd runs for the eager forward (search_space.layer_norm_gate.eager) given its
    saved statistics: torch's layer-norm backward in fp32 and the product's gradients; the
    statistics are recomputed here, as a candidate recomputes them."""
    xs = x.float()
    normed, mean, rstd = torch.native_layer_norm(xs, (x.shape[1],), weight.float(), bias.float(), eps)
    g = grad_out.float()
    du = (g * normed).to(u.dtype)
    dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
        g * u.float(), xs, (x.shape[1],), mean, rstd, weight.float(), bias.float(), [True, True, True]
    )
    return dx.to(x.dtype), du, dweight.to(weight.dtype), dbias.to(bias.dtype)


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    """The forward's inputs and an upstream gradient of its output's shape and dtype."""
    fwd = forward.make_inputs(shape, seed, device)
    x = fwd.args[0]
    gen = torch.Generator(device=device).manual_seed(seed ^ 0x6A7D)
    grad_out = torch.randn(x.shape, generator=gen, device=device).to(x.dtype)
    return Inputs(args=(grad_out, *fwd.args))


def flops(shape: Shape) -> float:
    """About 20 per element: the statistics again (5), du (3), dy and the two row sums for the
    parameters (4), dx's two row means and its combination (8)."""
    return 20.0 * shape.params["tokens"] * shape.params["dim"]


def bytes_moved(shape: Shape) -> float:
    """grad_out, x and u read once, dx and du written once; weight and bias read, their
    gradients written (fp32)."""
    p, elem = shape.params, shape.torch_dtype.itemsize
    return 5.0 * p["tokens"] * p["dim"] * elem + 4 * 4 * p["dim"]


# dx and du are rounded once to the inputs' dtype from fp32, as the forward's output is: its
# bf16 and fp16 bounds. dweight and dbias come back in the parameters' dtype, and each output is
# judged by its own dtype's bounds (Problem.closeness): fp32 parameters' gradients by fp32's
# whatever the activations' dtype. In fp32, dx
# combines three terms of its row's scale (dy w, its mean, xhat times a mean of products), and
# dweight and dbias sum up to 250k rows (at the timing shapes) in per-program partial sums: the
# order of those sums moves an element by about 2^-24 sqrt(number of partial sums) of the
# column's magnitude, a few 1e-7 of it; the bounds allow 1e-5, and an element's own bound
# (row_atol, of the output's RMS) 2^-18, 3.8e-6: the default kernel's error over the 70,001 rows
# of the many-rows check is 6e-7 of the RMS interpreted, and on an H100 it and the fp32
# reference of then were 1.26 times 2^-20 apart (the bound then). A gradient rounded to bf16 is
# off by 2^-9 of its value.
TOLERANCES = {
    **forward.TOLERANCES,
    "fp32": Tolerance(atol=1e-5, rtol=1e-5, norm_rtol=4e-6, row_rtol=1e-5, row_atol=2**-18),
}

TEMPLATE = KnobTemplate(
    problem=NAME,
    source_module="kernels.layer_norm_gate",
    entry=ENTRY,
    knobs=(
        Knob("GRAD_BLOCK_T", (None, 1, 2, 4, 8, 16), default=None, help="rows per step (whole rows)"),
        Knob("GRAD_num_warps", (None, 1, 2, 4, 8, 16), default=None, help="warps per program"),
        Knob(
            "GRAD_PROGRAMS",
            (None, 256, 512, 1024, 2048, 4096),
            default=None,
            help="programs (each sums its rows' weight and bias gradients; more: more partial sums to add)",
        ),
    ),
    constraint=lambda knobs: None,
)

# The forward's check shapes, and one of more rows than every configuration's programs times
# their rows a step (4096 x 16 at most): each program then walks several blocks of rows, and
# the parameters' gradients sum hundreds of partial sums (on a GPU's defaults; four interpreted).
CHECK_SHAPES = (*forward.CHECK_SHAPES, Shape.of("many-rows", "bf16", tokens=70_001, dim=128))

PROBLEM = dataclasses.replace(
    forward.PROBLEM,
    check_shapes=CHECK_SHAPES,
    name=NAME,
    entry=ENTRY,
    op_family="normalization-grad",
    signature=(
        "layer_norm_gate_grad(grad_out: Tensor[T, I] (x's dtype), x: Tensor[T, I], u: Tensor[T, I], "
        "weight: Tensor[I], bias: Tensor[I], eps: float = 1e-5) -> (dx: Tensor[T, I], du: Tensor[T, I], "
        "dweight: Tensor[I], dbias: Tensor[I]), each in its argument's dtype"
    ),
    description=__doc__,
    tolerances=TOLERANCES,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.native_layer_norm_backward fp32": autograd_of_eager},
    flops=flops,
    bytes=bytes_moved,
    template=NAME,
    forbidden_ops=(
        *forward.FORBIDDEN_OPS,
        "native_layer_norm_backward",
        "autograd",
        "grad",
        "backward",
        "vjp",
    ),
    optimizes="backward",
)


def check_arguments(grad_out, x, u, weight, bias, eps=1e-5) -> None:
    forward.check_arguments(x, u, weight, bias, eps)
    if grad_out.shape != x.shape or grad_out.dtype != x.dtype:
        raise ValueError(
            f"grad_out must be like x ({x.dtype} {tuple(x.shape)}), "
            f"got {grad_out.dtype} {tuple(grad_out.shape)}"
        )


def _fake(grad_out, x, u, weight, bias, eps=1e-5) -> list[torch.Tensor]:
    return [t.new_empty(t.shape) for t in (x, u, weight, bias)]


def call_cost(grad_out, x, u, weight, bias, eps=1e-5) -> tuple[float, float]:
    total, dim = x.shape
    moved = 5 * x.numel() * x.element_size() + 2 * (weight.numel() + bias.numel()) * weight.element_size()
    return 20.0 * total * dim, float(moved)


OP = Op(
    name=NAME,
    problem=PROBLEM,
    default="kernels.layer_norm_gate:layer_norm_gate_grad",
    check=check_arguments,
    fake=_fake,
    bucket=lambda grad_out, x, u, weight, bias, eps=1e-5: forward.bucket_of(x.shape[1]),
    cost=call_cost,
    gradient_of=forward.NAME,
    signature=gradient_signature(forward.OP, list[torch.Tensor]),
    doc="""Gradients of layer_norm_gate: grad_out (like its output), then its arguments -> [dx, du,
    dweight, dbias], each in its argument's dtype. Dispatched inside layer_norm_gate's backward;
    see search_space/layer_norm_gate_grad.py.""",
)
