"""The embedding-bag training update: the gradient of the pooled lookup for its table.

    grad_weight[r, :] = sum_{i : indices[i] = r} psw[i] * grad_out[bag(i), :]  (/ len(bag(i)) for mean)

Ids repeat within and across bags, so a kernel must add, never overwrite. The gradient is the
dense [num_rows, D] table gradient, in grad_out's dtype; the reference is the autograd of the
forward reference (search_space.embedding_bag), in fp32.
"""

from __future__ import annotations

import dataclasses

import torch

from search_space import embedding_bag as forward
from search_space.op import Op
from search_space.problem import Inputs, Shape

ENTRY = "embedding_bag_backward"


def reference(
    grad_out: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    num_rows: int,
    *,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of search_space.embedding_bag.reference for its table, written out: each
    id's row gets its bag's upstream gradient, scaled, accumulated in fp32 (fp64 if given fp64).
    (No autograd: dispatch runs this inside a custom op, where autograd is switched off.)"""
    acc = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
    lengths = offsets[1:] - offsets[:-1]
    bag_of_index = torch.repeat_interleave(torch.arange(lengths.numel(), device=grad_out.device), lengths)
    rows = grad_out.to(acc)[bag_of_index]
    if mode == "mean":
        rows = rows / lengths.clamp(min=1).to(acc)[bag_of_index, None]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.to(acc)[:, None]
    grad = torch.zeros(num_rows, grad_out.shape[1], dtype=acc, device=grad_out.device)
    return grad.index_add_(0, indices, rows).to(grad_out.dtype)


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    """The forward's inputs (ids, offsets, weights) and an upstream gradient from the same seed."""
    fwd = forward.make_inputs(shape, seed, device)
    weight, indices, offsets = fwd.args
    gen = torch.Generator(device=device).manual_seed(seed ^ 0x5EED)
    grad_out = torch.randn(offsets.numel() - 1, weight.shape[1], generator=gen, device=device)
    return Inputs(args=(grad_out.to(shape.torch_dtype), indices, offsets, weight.shape[0]), kwargs=fwd.kwargs)


def bytes_moved(shape: Shape) -> float:
    """The forward's traffic (each gathered row becomes a scattered row update), plus the dense
    gradient written once: a [num_rows, D] table is most of the bytes at realistic sizes."""
    elem = torch.empty((), dtype=shape.torch_dtype).element_size()
    return forward.bytes_moved(shape) + shape.params["num_rows"] * shape.params["dim"] * elem


PROBLEM = dataclasses.replace(
    forward.PROBLEM,
    name="embedding_bag_backward",
    entry=ENTRY,
    signature=(
        "embedding_bag_backward(grad_out: Tensor[B, D], indices: int64 Tensor[nnz], "
        "offsets: int64 Tensor[B + 1], num_rows: int, *, mode: 'sum' | 'mean' = 'sum', "
        "per_sample_weights: Tensor[nnz] | None = None) -> Tensor[num_rows, D]"
    ),
    description=__doc__,
    make_inputs=make_inputs,
    reference=reference,
    baselines={},
    bytes=bytes_moved,
    template=None,
    forbidden_ops=(*forward.PROBLEM.forbidden_ops, "index_put", "index_put_", "put_", "autograd"),
    optimizes="backward",
)


def _fake(grad_out, indices, offsets, num_rows, *, mode="sum", per_sample_weights=None):
    return grad_out.new_empty((num_rows, grad_out.shape[1]))


def _call_bucket(grad_out, indices, offsets, num_rows, *, mode="sum", per_sample_weights=None) -> str:
    return forward.call_bucket(grad_out.shape[1], indices, offsets)


def _cost(
    grad_out, indices, offsets, num_rows, *, mode="sum", per_sample_weights=None
) -> tuple[float, float]:
    """grad_out read, each id's row of the gradient accumulated once, the dense gradient written."""
    nnz, dim, elem = indices.shape[0], grad_out.shape[1], grad_out.element_size()
    moved = (
        grad_out.numel() * elem
        + nnz * (dim * elem + indices.element_size())
        + offsets.numel() * offsets.element_size()
    )
    return nnz * dim, moved + num_rows * dim * elem


OP = Op(
    name="embedding_bag_backward",
    cost=_cost,
    problem=PROBLEM,
    default="kernels.embedding_bag:embedding_bag_backward",
    fake=_fake,
    bucket=_call_bucket,
    doc="""The embedding-bag training update: grad_out [B, D] -> the dense table gradient
    [num_rows, D] in grad_out's dtype (ids repeat, so rows accumulate).""",
)
