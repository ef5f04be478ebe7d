"""The table-batched embedding lookup's gradient for its tables, as one dense flat gradient:

    grad[weight_offsets[f] + indices[i] * dim_f + c] +=
        psw[i] * grad_out[b, dim_offsets[f] + c]  (/ len(bag) for mean)

for every id i of bag (f, b) and column c < dim_f. Ids repeat within and across bags, and
features may share a table, so a kernel must add, never overwrite. The gradient has every
table's elements, [N], in grad_out's dtype: the path of a dense gradient and an optimizer's
step (model.embeddings unfused, for comparison); a model's tables are trained by the fused
optimizer op (embedding_bags_update), which never forms it. The reference is the
single-table gradient (search_space.embedding_bag_backward) on each feature, in fp32.
"""

from __future__ import annotations

import dataclasses

import torch

from search_space import embedding_bag_backward as single
from search_space import embedding_bags as forward
from search_space.op import Op
from search_space.problem import Inputs, Shape, Tolerance
from search_space.template import Knob, KnobTemplate

NAME = ENTRY = "embedding_bags_backward"


def reference(
    grad_out: torch.Tensor,
    weight_offsets: torch.Tensor,
    dim_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    num_elements: int,
    *,
    total_dim: int,
    max_dim: int,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each feature's table gradient (over the rows its ids reach), added into the flat one in
    fp32 (fp64 if given fp64), rounded once. (No autograd: dispatch runs this inside a custom
    op, where autograd is switched off.)"""
    acc = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
    grad = torch.zeros(num_elements, dtype=acc, device=grad_out.device)
    features = forward.per_feature(weight_offsets, dim_offsets, indices, offsets, per_sample_weights)
    for start, cols, ids, bag_offsets, psw in features:
        rows = int(ids.max()) + 1 if ids.numel() else 0
        table = single.reference(
            grad_out[:, cols].to(acc), ids, bag_offsets, rows, mode=mode, per_sample_weights=psw
        )
        grad[start : start + table.numel()] += table.flatten()
    return grad.to(grad_out.dtype)


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    """The forward's inputs (ids, offsets, metadata) and an upstream gradient from the same seed."""
    fwd = forward.make_inputs(shape, seed, device)
    weights, weight_offsets, dim_offsets, indices, offsets = fwd.args
    gen = torch.Generator(device=device).manual_seed(seed ^ 0x5EED)
    batch = forward.num_samples(weight_offsets.shape[0], offsets)
    grad_out = torch.randn(
        batch, fwd.kwargs["total_dim"], generator=gen, device=device, dtype=shape.torch_dtype
    )
    args = (grad_out, weight_offsets, dim_offsets, indices, offsets, weights.shape[0])
    return Inputs(args=args, kwargs=fwd.kwargs)


def bytes_moved(shape: Shape) -> float:
    """The forward's traffic (each gathered row becomes a row update, grad_out is read where the
    output was written), plus the dense gradient written once: most of the bytes at realistic
    sizes."""
    return forward.bytes_moved(shape) + forward.layout_of(shape).num_elements * shape.torch_dtype.itemsize


# The forward's element and norm bounds. The gradient is flat, so each row of the comparison is
# one element: its row bound is an element bound with a tighter floor. A bf16 or fp16 element is
# rounded once from fp32 (half a unit in its last place, 2^-9 or 2^-11 of itself; a unit where the
# interpreter truncates), so the row bound allows 2^-7 and 2^-9 of the element plus a floor of
# 2^-12 and 2^-14 of the gradient's RMS, far above the fp32 sums' error: an element rounded to a
# grid as coarse as the element tolerance fails unless it is large. In fp32 the sums' order (any,
# with atomics) decides: a hot row's element that cancels to nearly zero is off by about 1e-6 of
# the RMS, so the floor is the element tolerance's.
TOLERANCES = {
    "fp32": Tolerance(atol=1e-5, rtol=1e-5, norm_rtol=1e-5, row_rtol=1e-5, row_atol=1e-5),
    "bf16": Tolerance(atol=1.6e-2, rtol=1.6e-2, norm_rtol=8e-3, row_rtol=2**-7, row_atol=2**-12),
    "fp16": Tolerance(atol=2e-3, rtol=2e-3, norm_rtol=1e-3, row_rtol=2**-9, row_atol=2**-14),
}

# The knobs of kernels/embedding_bags_backward.py (its KNOBS dict).
KNOBS = (
    Knob("BLOCK_L", (None, 4, 8, 16, 32, 64), default=None, help="ids of a bag scattered per step"),
    Knob(
        "BLOCK_D",
        (None, 16, 32, 64, 128, 256),
        default=None,
        help="gradient columns per program; a program covers ceil(D / BLOCK_D) of a row",
    ),
    Knob("num_warps", (None, 1, 2, 4, 8), default=None, help="warps per program"),
)


def _knob_constraints(knobs: dict) -> str | None:
    """Bounds of the update tile, where it is fixed (a knob left to the heuristic takes its value
    per call)."""
    if knobs["BLOCK_L"] is None or knobs["BLOCK_D"] is None:
        return None
    tile, warps = knobs["BLOCK_L"] * knobs["BLOCK_D"], knobs["num_warps"] or 4
    if tile > 8192:
        return f"BLOCK_L * BLOCK_D = {tile} > 8192 elements: the update tile spills registers"
    if tile < 32 * warps:
        return f"BLOCK_L * BLOCK_D = {tile} is smaller than {warps} warps of 32 lanes"
    return None


TEMPLATE = KnobTemplate(
    problem=NAME,
    source_module="kernels.embedding_bags_backward",
    entry=ENTRY,
    knobs=KNOBS,
    constraint=_knob_constraints,
)

PROBLEM = dataclasses.replace(
    forward.PROBLEM,
    name=NAME,
    entry=ENTRY,
    signature=(
        "embedding_bags_backward(grad_out: Tensor[B, total_dim], weight_offsets: int64 Tensor[F], "
        "dim_offsets: int64 Tensor[F + 1], indices: int32|int64 Tensor[nnz], "
        "offsets: int32|int64 Tensor[F * B + 1], num_elements: int, *, total_dim: int, max_dim: int, "
        "mode: 'sum' | 'mean' = 'sum', per_sample_weights: Tensor[nnz] | None = None) -> Tensor[num_elements]"
    ),
    description=__doc__,
    make_inputs=make_inputs,
    reference=reference,
    tolerances=TOLERANCES,
    baselines={},
    bytes=bytes_moved,
    template=NAME,
    forbidden_ops=(*forward.PROBLEM.forbidden_ops, "index_put", "index_put_", "put_", "autograd"),
    optimizes="backward",
)


def _fake(
    grad_out, weight_offsets, dim_offsets, indices, offsets, num_elements, *, total_dim, max_dim, mode="sum",
    per_sample_weights=None,
):  # fmt: skip
    return grad_out.new_empty((num_elements,))


def _call_bucket(
    grad_out, weight_offsets, dim_offsets, indices, offsets, num_elements, *, total_dim, max_dim, mode="sum",
    per_sample_weights=None,
) -> str:  # fmt: skip
    return forward.call_bucket(max_dim, indices, offsets)


def _cost(
    grad_out, weight_offsets, dim_offsets, indices, offsets, num_elements, *, total_dim, max_dim, mode="sum",
    per_sample_weights=None,
) -> tuple[float, float]:  # fmt: skip
    """grad_out read, each id's row of the gradient accumulated once, the dense gradient written."""
    gathered, elem = forward.gathered_elements(dim_offsets, offsets), grad_out.element_size()
    moved = (grad_out.numel() + gathered + num_elements) * elem
    moved += indices.numel() * indices.element_size() + offsets.numel() * offsets.element_size()
    if per_sample_weights is not None:
        moved += indices.numel() * per_sample_weights.element_size()
    return float(gathered), float(moved)


OP = Op(
    name=NAME,
    problem=PROBLEM,
    default="kernels.embedding_bags_backward:embedding_bags_backward",
    fake=_fake,
    bucket=_call_bucket,
    bounds=("total_dim", "max_dim"),
    cost=_cost,
    doc="""The table-batched lookup's gradient for its tables: grad_out [B, total_dim] -> the dense
    flat gradient [num_elements] of every table, in grad_out's dtype (ids repeat and features
    share tables, so rows accumulate). For small tables: it writes every table's elements.""",
)
