"""layer_norm_gate: the HSTU layer's output norm fused with its gate,

    out = (LayerNorm(x) * weight + bias) * u      (over each row's I elements)

x [T, I] and u [T, I] (one dtype: fp32, bf16 or fp16), weight [I] and bias [I] (LayerNorm's
parameters, fp32 under autocast), eps -> [T, I] in x's dtype: the mean, variance, normalization,
affine map and gate computed in fp32 and rounded once. In eager code these are separate passes
over the [T, I] activations (the norm in fp32 under autocast, the product, the casts), which
a step of the large model's HSTU layers runs at T ~ 250k tokens. Differentiable in x, u, weight
and bias, through its gradient op (search_space/layer_norm_gate_grad.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from search_space.op import Backward, Op
from search_space.problem import Inputs, Problem, Shape, Tolerance
from search_space.template import Knob, KnobTemplate

NAME = ENTRY = "layer_norm_gate"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def reference(
    x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """Plain PyTorch in fp64, cast once: the oracle's own rounding is far below any dtype's
    bound. (In fp32, on an H100, it was 1.4e-5 off at a row of one value, whose output is bias *
    u exactly: an error in the mean is multiplied by 1 / sqrt(eps), 316 at 1e-5, and a correct
    kernel failed against it.)"""
    f64 = torch.float64
    normed = F.layer_norm(x.to(f64), (x.shape[-1],), weight.to(f64), bias.to(f64), eps)
    return (normed * u.to(f64)).to(x.dtype)


def eager(x, u, weight, bias, eps=1e-5):
    """What the model ran before the op: the norm in fp32 (as autocast runs it, its parameters
    fp32), the gate multiplied in after it, the product cast back for the next layer."""
    return (F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps) * u).to(x.dtype)


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    """x ~ offset + scale * N(0, 1) (every `constant_every`-th row one value instead, the first
    of them 0), u ~ N(0, 1), weight ~ 1 + 0.1 N(0, 1) and bias ~ 0.1 N(0, 1) in `param_dtype`
    (fp32 unless the shape names another). Drawn on `device`: the sandbox draws a set for each
    timed call, and a CPU's draw of a 250k x 512 set takes seconds."""
    p, dtype = shape.params, shape.torch_dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    total, dim = p["tokens"], p["dim"]
    scale, offset = p.get("scale", 1.0), p.get("offset", 0.0)
    x = offset + scale * torch.randn(total, dim, generator=gen, device=device)
    every = p.get("constant_every", 0)
    if every:
        rows = torch.arange(0, total, every, device=device)
        values = offset + scale * torch.randn(rows.numel(), 1, generator=gen, device=device)
        values[:1] = 0.0
        x[rows] = values.expand(-1, dim)
    u = torch.randn(total, dim, generator=gen, device=device)
    weight = 1.0 + 0.1 * torch.randn(dim, generator=gen, device=device)
    bias = 0.1 * torch.randn(dim, generator=gen, device=device)
    return Inputs(
        args=(
            x.to(dtype),
            u.to(dtype),
            weight.to(PARAM_DTYPES[p.get("param_dtype", "fp32")]),
            bias.to(PARAM_DTYPES[p.get("param_dtype", "fp32")]),
            float(p.get("eps", 1e-5)),
        )
    )


def flops(shape: Shape) -> float:
    """About 8 per element: the mean and the variance (3), the normalization (2), the affine
    map (2) and the gate (1)."""
    return 8.0 * shape.params["tokens"] * shape.params["dim"]


def bytes_moved(shape: Shape) -> float:
    """x and u read once, the output written once, weight and bias read (fp32)."""
    p, elem = shape.params, shape.torch_dtype.itemsize
    return 3.0 * p["tokens"] * p["dim"] * elem + 2 * 4 * p["dim"]


def bucket_of(dim: int) -> str:
    """The row's width, as the kernels pad it (a power of two): the tile a program holds."""
    for width in (128, 256, 512, 1024, 2048):
        if dim <= width:
            return f"I<={width}"
    return "I>2048"


def shape_bucket(shape: Shape) -> str:
    return bucket_of(shape.params["dim"])


_s = Shape.of

# Edge cases: no rows; one row; widths that are no power of two (100, 200: a padded tile); rows
# of one value (variance 0, the first of them zeros: a variance taken as E[x^2] - E[x]^2, or a
# mean an ulp off, leaves them normalized values far from 0, which fp32's bounds see); magnitudes
# far from 1, three standard deviations off zero (squares of fp16 values overflow fp16); rows
# whose variance is near eps (eps misplaced or dropped moves every element); rows wider than the
# model's, to 2100 columns (a kernel that caps its tile); parameters in bf16 and fp16 (their
# gradients come back in their dtype); an eps other than the default; fp16.
CHECK_SHAPES = (
    _s("empty", "fp32", tokens=0, dim=512),
    _s("empty", "bf16", tokens=0, dim=512),
    _s("one-row", "fp32", tokens=1, dim=100),
    _s("odd-width", "bf16", tokens=37, dim=200),
    _s("odd-width", "fp16", tokens=19, dim=100, param_dtype="fp16"),
    _s("constant-rows", "fp32", tokens=24, dim=100, constant_every=3),
    _s("constant-rows", "bf16", tokens=24, dim=200, constant_every=3),
    _s("large-magnitude", "fp32", tokens=16, dim=256, scale=1e4, offset=3e4),
    _s("large-magnitude", "bf16", tokens=16, dim=256, scale=1e3, offset=2e3),
    _s("large-magnitude", "fp16", tokens=16, dim=256, scale=1e3, offset=2e3),
    _s("small-variance", "bf16", tokens=16, dim=256, scale=3e-3),
    _s("small-variance", "fp32", tokens=8, dim=128, scale=2e-3),
    _s("wide", "bf16", tokens=9, dim=1000, param_dtype="bf16"),
    _s("wide", "fp32", tokens=3, dim=2100),
    _s("hstu-width", "fp32", tokens=33, dim=512, eps=1e-6),
    _s("hstu-width", "bf16", tokens=70, dim=512),
)

# The large model's HSTU layers (model dim 512, 4 heads of 128: I = 512) at about 250k history
# tokens a batch, and at a quarter of them; one in fp32 (autocast off); the width of a model of
# half the heads.
TIMING_SHAPES = (
    _s("hstu-t250k", "bf16", tokens=250_000, dim=512),
    _s("hstu-t64k", "bf16", tokens=65_536, dim=512),
    _s("hstu-t250k-fp32", "fp32", tokens=250_000, dim=512),
    _s("hstu-t128k-i256", "bf16", tokens=131_072, dim=256),
)
INTERPRETED_TIMING_SHAPES = (_s("interp-t256", "fp32", tokens=256, dim=128),)

# fp32: the statistics are sums over a row's I elements in fp32 (a few units of 2^-24 of the
# sum of magnitudes, log2(I) deep in a tree), rsqrt on a GPU is within 2^-22 of the true value,
# and the affine map and gate add three roundings: each output within about 1e-6 of its row's
# scale (the fp64 reference's own rounding is far below). The row bound allows 2^-17 of the row's norm
# (7.6e-6), the element bound 1e-5 of the output's RMS and of itself. A mean rounded an ulp off
# on a row of one value is multiplied by 1/sqrt(eps) (316): 4e-5 of the value, above these.
# bf16 and fp16: the fp32 result rounded once to the output dtype, half an ulp (2^-9 and 2^-12
# of an element), or a whole one where the cast truncates (the interpreter's): the row bounds
# allow twice a whole ulp (2^-7 and 2^-9), with a floor far below.
TOLERANCES = {
    "fp32": Tolerance(atol=1e-5, rtol=1e-5, norm_rtol=2e-6, row_rtol=2**-17, row_atol=2**-20),
    "bf16": Tolerance(atol=2e-2, rtol=2e-2, norm_rtol=8e-3, row_rtol=2**-7, row_atol=2**-12),
    "fp16": Tolerance(atol=3e-3, rtol=3e-3, norm_rtol=2e-3, row_rtol=2**-9, row_atol=2**-15),
}

# Torch functions that compute the op (or its statistics), which a candidate may not fall back to.
FORBIDDEN_OPS = (
    "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "batch_norm",
    "native_batch_norm", "instance_norm", "rms_norm", "var", "var_mean", "std", "std_mean",
    "mean", "normalize",
)  # fmt: skip

TEMPLATE = KnobTemplate(
    problem=NAME,
    source_module="kernels.layer_norm_gate",
    entry=ENTRY,
    knobs=(
        Knob("BLOCK_T", (None, 1, 2, 4, 8, 16, 32), default=None, help="rows per program (whole rows)"),
        Knob("num_warps", (None, 1, 2, 4, 8, 16), default=None, help="warps per program"),
    ),
    constraint=lambda knobs: None,
)

PROBLEM = Problem(
    name=NAME,
    op_family="normalization",
    entry=ENTRY,
    signature=(
        "layer_norm_gate(x: Tensor[T, I], u: Tensor[T, I] (x's dtype), weight: fp32|bf16|fp16 Tensor[I], "
        "bias: Tensor[I] (weight's dtype), eps: float = 1e-5) -> Tensor[T, I] in x's dtype"
    ),
    description=__doc__,
    check_shapes=CHECK_SHAPES,
    timing_shapes=TIMING_SHAPES,
    interpreted_timing_shapes=INTERPRETED_TIMING_SHAPES,
    tolerances=TOLERANCES,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.layer_norm fp32, then gate": eager},
    flops=flops,
    bytes=bytes_moved,
    bucket=shape_bucket,
    template=NAME,
    forbidden_ops=FORBIDDEN_OPS,
)


def check_arguments(x, u, weight, bias, eps=1e-5) -> None:
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be an fp32, bf16 or fp16 [T, I] tensor, got {x.dtype} {tuple(x.shape)}")
    if u.shape != x.shape or u.dtype != x.dtype:
        raise ValueError(f"u must be like x ({x.dtype} {tuple(x.shape)}), got {u.dtype} {tuple(u.shape)}")
    dim = x.shape[1]
    if (
        weight.shape != (dim,)
        or bias.shape != (dim,)
        or weight.dtype not in DTYPES
        or bias.dtype != weight.dtype
    ):
        raise ValueError(
            f"weight and bias must be [{dim}] tensors of one dtype (fp32, bf16 or fp16), got "
            f"{weight.dtype} {tuple(weight.shape)} and {bias.dtype} {tuple(bias.shape)}"
        )
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")


def call_cost(x, u, weight, bias, eps=1e-5) -> tuple[float, float]:
    total, dim = x.shape
    moved = 3 * x.numel() * x.element_size() + (weight.numel() + bias.numel()) * weight.element_size()
    return 8.0 * total * dim, float(moved)


OP = Op(
    name=NAME,
    problem=PROBLEM,
    default="kernels.layer_norm_gate:layer_norm_gate",
    check=check_arguments,
    fake=lambda x, u, weight, bias, eps=1e-5: x.new_empty(x.shape),
    bucket=lambda x, u, weight, bias, eps=1e-5: bucket_of(x.shape[1]),
    cost=call_cost,
    backward=Backward(gradient_op="layer_norm_gate_grad", differentiable=("x", "u", "weight", "bias")),
    doc="""The HSTU layer's output norm and gate in one pass: (LayerNorm(x) * weight + bias) * u.

    x [T, I] and u [T, I] (one dtype), weight [I] and bias [I] (fp32 under autocast, or any of
    fp32, bf16, fp16), eps -> [T, I] in x's dtype, computed in fp32 and rounded once.
    Differentiable in x, u, weight and bias (layer_norm_gate_grad, which recomputes the row
    statistics from x).
    """,
)
