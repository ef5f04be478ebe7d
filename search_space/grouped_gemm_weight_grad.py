"""grouped_gemm_weight_grad: the weight gradient of grouped_gemm,

    out[g] = x[rows of g]^T @ grad_out[rows of g]      (zeros for a group without rows),

x [N, K] and grad_out [N, M] with rows sorted by group, group_offsets [G + 1] -> [G, K, M].
Each group's product reduces over its rows, as many as routing gave it: the skew a mixture of
experts' backward must absorb. Shapes, buckets and tolerances are grouped_gemm's.
"""

from __future__ import annotations

import torch

from search_space import grouped_gemm as forward
from search_space.op import Op
from search_space.problem import Inputs, Problem, Shape
from search_space.template import Knob, KnobTemplate

NAME = ENTRY = "grouped_gemm_weight_grad"


def reference(x: torch.Tensor, grad_out: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: one product per group, in fp32 (fp64 for fp64), cast once."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    groups = group_offsets.shape[0] - 1
    out = torch.zeros((groups, x.shape[1], grad_out.shape[1]), dtype=acc, device=x.device)
    bounds = group_offsets.tolist()
    for g in range(groups):
        rows = slice(bounds[g], bounds[g + 1])
        out[g] = x[rows].to(acc).T @ grad_out[rows].to(acc)
    return out.to(x.dtype)


def per_group_loop(x, grad_out, group_offsets):
    """What eager code writes: a loop of matrix products over the groups, in the inputs' dtype."""
    bounds = group_offsets.tolist()
    return torch.stack(
        [x[bounds[g] : bounds[g + 1]].T @ grad_out[bounds[g] : bounds[g + 1]] for g in range(len(bounds) - 1)]
    )


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    """grouped_gemm's x and offsets, and a grad_out of its output's shape."""
    x, offsets, _, _ = forward.make_inputs(shape, seed, device).args
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    grad_out = torch.randn((x.shape[0], shape.params["m"]), generator=gen, device=device).to(x.dtype)
    return Inputs(args=(x, grad_out, offsets))


def bytes_moved(shape: Shape) -> float:
    """x and grad_out read once, every group's gradient written once."""
    p, elem = shape.params, shape.torch_dtype.itemsize
    rows, groups = forward.rows_of(shape), forward.groups_of(shape)
    return (rows * p["k"] + rows * p["m"] + groups * p["k"] * p["m"]) * elem + 8 * (groups + 1)


def _check(x, grad_out, group_offsets) -> None:
    if x.dim() != 2 or grad_out.dim() != 2 or x.shape[0] != grad_out.shape[0]:
        raise ValueError(
            f"x [N, K] and grad_out [N, M] must share N, got {tuple(x.shape)} and {tuple(grad_out.shape)}"
        )
    if x.dtype != grad_out.dtype:
        raise ValueError(f"x and grad_out must share a dtype, got {x.dtype} and {grad_out.dtype}")
    if (
        group_offsets.dim() != 1
        or group_offsets.numel() < 1
        or group_offsets.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError("group_offsets must be an int32 or int64 [G + 1] tensor")


def call_cost(x, grad_out, group_offsets) -> tuple[float, float]:
    rows, k = x.shape
    m, groups, elem = grad_out.shape[1], group_offsets.shape[0] - 1, x.element_size()
    return 2.0 * rows * k * m, float((rows * k + rows * m + groups * k * m) * elem)


TEMPLATE = KnobTemplate(
    problem=NAME,
    source_module="kernels.grouped_gemm_weight_grad",
    entry=ENTRY,
    knobs=(
        Knob("BLOCK_R", (16, 32, 64), default=32, help="rows per step"),
        Knob("BLOCK_K", (32, 64, 128), default=64, help="gradient rows per program"),
        Knob("BLOCK_M", (32, 64, 128), default=64, help="gradient columns per program"),
        Knob("num_warps", (2, 4, 8), default=4),
        Knob("num_stages", (2, 3, 4), default=3),
    ),
    constraint=lambda knobs: (
        "a tile of more than 16384 elements" if knobs["BLOCK_K"] * knobs["BLOCK_M"] > 16384 else None
    ),
)

PROBLEM = Problem(
    name=NAME,
    op_family="gemm",
    entry=ENTRY,
    signature=(
        "grouped_gemm_weight_grad(x: Tensor[N, K], grad_out: Tensor[N, M], group_offsets: int32|int64 "
        "Tensor[G + 1]) -> Tensor[G, K, M]"
    ),
    description=__doc__,
    check_shapes=forward.CHECK_SHAPES,
    timing_shapes=forward.TIMING_SHAPES,
    interpreted_timing_shapes=forward.INTERPRETED_TIMING_SHAPES,
    # Each element is a dot product over a group's rows (up to the whole batch in a skewed
    # group), accumulated in fp32 and rounded once: grouped_gemm's bounds, per group's row of
    # the gradient.
    tolerances=forward.TOLERANCES,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.mm loop": per_group_loop},
    flops=forward.flops,
    bytes=bytes_moved,
    bucket=forward.shape_bucket,
    template=NAME,
    forbidden_ops=forward.FORBIDDEN_OPS,
)

OP = Op(
    name=NAME,
    problem=PROBLEM,
    default="kernels.grouped_gemm_weight_grad:grouped_gemm_weight_grad",
    check=_check,
    fake=lambda x, grad_out, group_offsets: x.new_empty(
        (group_offsets.shape[0] - 1, x.shape[1], grad_out.shape[1])
    ),
    bucket=lambda x, grad_out, group_offsets: forward.bucket_of(
        x.shape[0], group_offsets.shape[0] - 1, x.shape[1], grad_out.shape[1]
    ),
    cost=call_cost,
    doc="""The weight gradient of grouped_gemm: x [N, K] and grad_out [N, M] (rows sorted by group),
    group_offsets [G + 1] -> [G, K, M], per group its rows of x transposed times its rows of
    grad_out (zeros for an empty group).""",
)
