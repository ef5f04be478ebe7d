"""grouped_gemm: rows sorted by group, each group's rows times the group's own matrix,

    out[r] = x[r] @ weight[g] + bias[g]      for group_offsets[g] <= r < group_offsets[g + 1],

x [N, K], group_offsets [G + 1] (0 first, N last), weight [G, K, M], bias [G, M] or None ->
[N, M]. The experts of a sparse mixture of experts after top-k routing (the rows routed to
expert g, sorted by expert), in one call instead of a loop of G matrix products; groups may be
empty, and routing makes them uneven. Its gradients: grad_out times each group's matrix
transposed (this op again) and, per group, x's rows transposed times grad_out's
(grouped_gemm_weight_grad).
"""

from __future__ import annotations

import torch

from search_space.op import Backward, Op
from search_space.problem import Inputs, Problem, Shape, Tolerance
from search_space.template import Knob, KnobTemplate

NAME = ENTRY = "grouped_gemm"


def reference(
    x: torch.Tensor, group_offsets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain PyTorch: one matrix product per group, in fp32 (fp64 for fp64), cast once."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.empty((x.shape[0], weight.shape[2]), dtype=acc, device=x.device)
    bounds = group_offsets.tolist()
    for g in range(weight.shape[0]):
        rows = slice(bounds[g], bounds[g + 1])
        out[rows] = x[rows].to(acc) @ weight[g].to(acc)
        if bias is not None:
            out[rows] += bias[g].to(acc)
    return out.to(x.dtype)


def per_group_loop(x, group_offsets, weight, bias=None):
    """What eager code writes: a loop of addmm (or mm) over the groups, in the inputs' dtype."""
    bounds = group_offsets.tolist()
    parts = []
    for g in range(weight.shape[0]):
        rows = x[bounds[g] : bounds[g + 1]]
        parts.append(rows @ weight[g] if bias is None else torch.addmm(bias[g], rows, weight[g]))
    return torch.cat(parts) if parts else x.new_empty((0, weight.shape[2]))


def group_counts(shape: Shape, seed: int) -> list[int]:
    """Rows per group: given, or drawn from the seed: `balanced` (uniform routing) or `skewed`
    (a hot group, a power law over the rest, the last group empty: what top-k routing leaves)."""
    p = shape.params
    if "counts" in p:
        return list(p["counts"])
    groups, rows = p["groups"], p["rows"]
    gen = torch.Generator().manual_seed(seed)
    if p.get("split", "balanced") == "balanced":
        probs = torch.ones(groups)
    else:
        probs = torch.arange(1, groups + 1, dtype=torch.float64).pow(-1.5)
        probs = probs[torch.randperm(groups, generator=gen)]
        probs[-1] = 0.0
    draws = torch.multinomial(probs / probs.sum(), rows, replacement=True, generator=gen)
    return torch.bincount(draws, minlength=groups).tolist()


def offsets_of(counts: list[int], seed: int, device: torch.device) -> torch.Tensor:
    """Group offsets, int64 on even seeds and int32 on odd ones (both index dtypes get checked)."""
    dtype = torch.int32 if seed % 2 else torch.int64
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0, out=offsets[1:])
    return offsets.to(device=device, dtype=dtype)


def _randn(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: torch.device, scale: float
):
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    p, dtype = shape.params, shape.torch_dtype
    counts = group_counts(shape, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)  # on the device: a set a timed call
    k, m = p["k"], p["m"]
    x = _randn((sum(counts), k), dtype, gen, device, 1.0)
    weight = _randn((len(counts), k, m), dtype, gen, device, k**-0.5)
    bias = _randn((len(counts), m), dtype, gen, device, 0.1) if p.get("bias", True) else None
    return Inputs(args=(x, offsets_of(counts, seed, device), weight, bias))


def rows_of(shape: Shape) -> int:
    p = shape.params
    return sum(p["counts"]) if "counts" in p else p["rows"]


def groups_of(shape: Shape) -> int:
    p = shape.params
    return len(p["counts"]) if "counts" in p else p["groups"]


def flops(shape: Shape) -> float:
    return 2.0 * rows_of(shape) * shape.params["k"] * shape.params["m"]


def bytes_moved(shape: Shape) -> float:
    """x read once, every group's matrix read once, the output written once (bias and offsets)."""
    p, elem = shape.params, shape.torch_dtype.itemsize
    rows, groups = rows_of(shape), groups_of(shape)
    moved = (rows * p["k"] + groups * p["k"] * p["m"] + rows * p["m"]) * elem + 8 * (groups + 1)
    return moved + (groups * p["m"] * elem if p.get("bias", True) else 0)


def _width(n: int) -> str:
    return "<=128" if n <= 128 else "<=1024" if n <= 1024 else ">1024"


def bucket_of(rows: int, groups: int, k: int, m: int) -> str:
    """K and M regimes, and whether groups hold few rows (under one 64-row tile on average) or many."""
    per_group = "few-rows" if rows < 64 * max(groups, 1) else "many-rows"
    return f"k{_width(k)}-m{_width(m)}-{per_group}"


def shape_bucket(shape: Shape) -> str:
    return bucket_of(rows_of(shape), groups_of(shape), shape.params["k"], shape.params["m"])


_s = Shape.of


# Edge cases: empty groups (first, middle and last), a group of one row, row counts, K and M
# that are no multiple of any tile, a single group, no bias.
CHECK_SHAPES = tuple(
    _s(name, dtype, **params)
    for dtype in ("fp32", "bf16")
    for name, params in (
        ("uneven", {"counts": [0, 37, 1, 0, 70, 5], "k": 48, "m": 40}),
        ("one-group", {"counts": [29], "k": 100, "m": 24, "bias": False}),
        ("skewed", {"groups": 8, "rows": 150, "split": "skewed", "k": 32, "m": 72}),
    )
)

# A mixture of experts after top-2 routing of 8192 candidates: the experts' first layer over the
# flattened interaction output (K 4096) and their second (512 to 512), balanced and skewed, and
# sixteen experts of 1024.
TIMING_SHAPES = (
    _s("moe8-up-balanced", "bf16", groups=8, rows=16_384, k=4096, m=512),
    _s("moe8-down-skewed", "bf16", groups=8, rows=16_384, k=512, m=512, split="skewed"),
    _s("moe16-1024-skewed", "bf16", groups=16, rows=16_384, k=1024, m=1024, split="skewed"),
    _s("moe8-down-fp32", "fp32", groups=8, rows=16_384, k=512, m=512),
)
INTERPRETED_TIMING_SHAPES = (_s("interp-g4", "fp32", groups=4, rows=64, k=32, m=32),)

# Each output element is a dot product of K terms, accumulated in fp32 by kernel and reference
# alike (the order differs: a few ulps of fp32 of the terms' magnitude, about 1e-6 of the RMS
# at K 4096) and rounded once to the output dtype: half an ulp, 2^-9 of itself in bf16. A row's
# error norm is then at most that fraction of its own norm; the row bound allows four times it
# (2^-7 bf16) with a floor far below (2^-12 of the output's RMS times the root of the width).
# fp32 rounds nothing (products in full fp32, not TF32): 2^-13 of a row's norm is a hundred
# times the accumulation's error. A zeroed row, a wrong group's matrix or a missing bias fail.
TOLERANCES = {
    "fp32": Tolerance(atol=1e-4, rtol=1e-4, norm_rtol=1e-5, row_rtol=2**-13, row_atol=2**-20),
    "bf16": Tolerance(atol=1.6e-2, rtol=1.6e-2, norm_rtol=8e-3, row_rtol=2**-7, row_atol=2**-12),
}

FORBIDDEN_OPS = (
    "mm", "matmul", "bmm", "addmm", "baddbmm", "addbmm", "einsum", "linear", "tensordot", "dot",
    "inner", "outer", "mv", "chain_matmul", "_grouped_mm",
)  # fmt: skip

TEMPLATE = KnobTemplate(
    problem=NAME,
    source_module="kernels.grouped_gemm",
    entry=ENTRY,
    knobs=(
        Knob("BLOCK_R", (16, 32, 64, 128), default=64, help="rows per program"),
        Knob("BLOCK_M", (32, 64, 128, 256), default=64, help="output columns per program"),
        Knob("BLOCK_K", (16, 32, 64, 128), default=32, help="depth per step"),
        Knob("num_warps", (2, 4, 8), default=4),
        Knob("num_stages", (2, 3, 4, 5), default=3),
    ),
    constraint=lambda knobs: (
        "a tile of more than 32768 elements" if knobs["BLOCK_R"] * knobs["BLOCK_M"] > 32768 else None
    ),
)

PROBLEM = Problem(
    name=NAME,
    op_family="gemm",
    entry=ENTRY,
    signature=(
        "grouped_gemm(x: Tensor[N, K], group_offsets: int32|int64 Tensor[G + 1], weight: Tensor[G, K, M], "
        "bias: Tensor[G, M] | None = None) -> Tensor[N, M]"
    ),
    description=__doc__,
    check_shapes=CHECK_SHAPES,
    timing_shapes=TIMING_SHAPES,
    interpreted_timing_shapes=INTERPRETED_TIMING_SHAPES,
    tolerances=TOLERANCES,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.mm loop": per_group_loop},
    flops=flops,
    bytes=bytes_moved,
    bucket=shape_bucket,
    template=NAME,
    forbidden_ops=FORBIDDEN_OPS,
)


def _check(x, group_offsets, weight, bias=None) -> None:
    if x.dim() != 2 or weight.dim() != 3:
        raise ValueError(
            f"x must be [N, K] and weight [G, K, M], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"x's K ({x.shape[1]}) and weight's ({weight.shape[1]}) differ")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}")
    if group_offsets.dim() != 1 or group_offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError("group_offsets must be an int32 or int64 [G + 1] tensor")
    if group_offsets.shape[0] != weight.shape[0] + 1:
        raise ValueError(f"group_offsets holds {group_offsets.shape[0]} offsets for {weight.shape[0]} groups")
    if bias is not None and tuple(bias.shape) != (weight.shape[0], weight.shape[2]):
        raise ValueError(
            f"bias must be [G, M] = {(weight.shape[0], weight.shape[2])}, got {tuple(bias.shape)}"
        )
    if not (x.device == weight.device == group_offsets.device):
        raise ValueError("x, group_offsets and weight must be on one device")


def call_cost(x, group_offsets, weight, bias=None) -> tuple[float, float]:
    rows, k = x.shape
    groups, _, m = weight.shape
    elem = x.element_size()
    moved = (rows * k + groups * k * m + rows * m + (groups * m if bias is not None else 0)) * elem
    return 2.0 * rows * k * m, float(moved + group_offsets.numel() * group_offsets.element_size())


def _save(ctx, inputs: dict, output) -> None:
    ctx.save_for_backward(inputs["x"], inputs["group_offsets"], inputs["weight"])
    ctx.has_bias = inputs["bias"] is not None


def _grads(ctx, grad_out: torch.Tensor) -> dict:
    from kernels.opdef import public  # the gradients' kernels are dispatched too

    x, offsets, weight = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grads = {}
    if ctx.needs_grad["x"]:
        grads["x"] = public(NAME)(grad_out, offsets, weight.transpose(1, 2))
    if ctx.needs_grad["weight"]:
        grads["weight"] = public("grouped_gemm_weight_grad")(x, grad_out, offsets)
    if ctx.has_bias and ctx.needs_grad["bias"]:
        groups = weight.shape[0]
        group_of_row = torch.repeat_interleave(
            torch.arange(groups, device=x.device), offsets[1:] - offsets[:-1], output_size=x.shape[0]
        )
        summed = torch.zeros(groups, grad_out.shape[1], dtype=torch.float32, device=x.device)
        grads["bias"] = summed.index_add_(0, group_of_row, grad_out.float()).to(grad_out.dtype)
    return grads


OP = Op(
    name=NAME,
    problem=PROBLEM,
    default="kernels.grouped_gemm:grouped_gemm",
    check=_check,
    fake=lambda x, group_offsets, weight, bias=None: x.new_empty((x.shape[0], weight.shape[2])),
    bucket=lambda x, group_offsets, weight, bias=None: bucket_of(
        x.shape[0], weight.shape[0], x.shape[1], weight.shape[2]
    ),
    cost=call_cost,
    backward=Backward(save=_save, grads=_grads, uses=("grouped_gemm_weight_grad",)),
    doc="""Rows sorted by group, each times its group's matrix (a mixture of experts in one call).

    x [N, K], group_offsets [G + 1] (int32/int64; group g's rows are offsets[g]:offsets[g + 1]),
    weight [G, K, M], bias [G, M] or None -> [N, M]. Differentiable in x, weight and bias.
    The offsets must run from 0 to N without decreasing; that is not checked (it would read them
    back from the device), and offsets past N make the kernel read and write past x and the output.
    """,
)
