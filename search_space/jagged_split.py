"""jagged_split: each sequence of a jagged tensor cut in two, its first n1_b rows and the rest,

    first[first_offsets[b] + p]                        = values[offsets[b] + p]   for p < n1_b
    second[offsets[b] - first_offsets[b] + p - n1_b]   = values[offsets[b] + p]   otherwise,

values [T, D], offsets [B + 1], first_offsets [B + 1] (from 0 to first_total) -> (first
[first_total, D], second [T - first_total, D]); the second part's offsets are offsets -
first_offsets. The encoded history and the candidates of an HSTU output, apart. `first_total`
is an argument so that no call reads it back from the GPU. Its gradient is jagged_concat of
the two parts' gradients. The shared shapes and buckets are in search_space.jagged_transforms.
"""

from __future__ import annotations

import torch

from search_space.jagged_concat import concat_map, make_parts
from search_space.jagged_concat import reference as concat_reference
from search_space.jagged_transforms import (
    CONCAT_CHECK_SHAPES,
    CONCAT_INTERPRETED_TIMING_SHAPES,
    CONCAT_TIMING_SHAPES,
    check_offsets,
    concat_bucket_of,
    concat_rows,
    concat_shape_bucket,
    copy_problem,
    num_seqs,
    tile_template,
)
from search_space.op import Backward, Op
from search_space.problem import Inputs, Shape

NAME = "jagged_split"


def reference(
    values: torch.Tensor, offsets: torch.Tensor, first_offsets: torch.Tensor, *, first_total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: each row scattered to the part it belongs to."""
    second_offsets = offsets.long() - first_offsets.long()
    if int(first_offsets[-1]) != first_total:
        raise ValueError(f"first_total is {first_total}, but first_offsets end at {int(first_offsets[-1])}")
    from_first, row = concat_map(first_offsets, second_offsets)
    first = values.new_empty((first_total, values.shape[1]))
    second = values.new_empty((values.shape[0] - first_total, values.shape[1]))
    first[row[from_first]] = values[from_first]
    second[row[~from_first]] = values[~from_first]
    return first, second


def per_sample_split(values, offsets, first_offsets, *, first_total):
    """What eager code writes without a jagged kernel: 2B slices, two torch.cat."""
    o, f = offsets.tolist(), first_offsets.tolist()
    firsts, seconds = [], []
    for i in range(len(o) - 1):
        cut = o[i] + f[i + 1] - f[i]
        firsts.append(values[o[i] : cut])
        seconds.append(values[cut : o[i + 1]])
    empty = values.new_empty((0, values.shape[1]))
    return (torch.cat(firsts) if firsts else empty), (torch.cat(seconds) if seconds else empty)


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    first, first_offsets, second, second_offsets = make_parts(shape, seed, device)
    values = concat_reference(first, first_offsets, second, second_offsets)
    offsets = first_offsets + second_offsets
    return Inputs(args=(values, offsets, first_offsets), kwargs={"first_total": first.shape[0]})


def bytes_moved(shape: Shape) -> float:
    """Every row read once and written once (two offset arrays beside)."""
    return 2 * concat_rows(shape) * shape.params["dim"] * shape.torch_dtype.itemsize + 16 * num_seqs(shape)


PROBLEM = copy_problem(
    NAME,
    signature=(
        "jagged_split(values: Tensor[T, D], offsets: int32|int64 Tensor[B + 1], first_offsets: "
        "int32|int64 Tensor[B + 1], *, first_total: int) -> (Tensor[first_total, D], "
        "Tensor[T - first_total, D])"
    ),
    description=__doc__,
    check_shapes=CONCAT_CHECK_SHAPES,
    timing_shapes=CONCAT_TIMING_SHAPES,
    interpreted_timing_shapes=CONCAT_INTERPRETED_TIMING_SHAPES,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.cat": per_sample_split},
    bytes=bytes_moved,
    bucket=concat_shape_bucket,
)

TEMPLATE = tile_template(NAME, "BLOCK_T", "input rows per program")


def _check(values, offsets, first_offsets, *, first_total) -> None:
    if values.dim() != 2:
        raise ValueError(f"values must be [T, D], got shape {tuple(values.shape)}")
    check_offsets(offsets, None, values.device)
    check_offsets(first_offsets, offsets.numel() - 1, values.device)
    if not 0 <= first_total <= values.shape[0]:
        raise ValueError(f"first_total must be in [0, T = {values.shape[0]}], got {first_total}")


def _save(ctx, inputs: dict, output) -> None:
    ctx.save_for_backward(inputs["offsets"], inputs["first_offsets"])
    ctx.shape = inputs["values"].shape
    ctx.first_total = inputs["first_total"]


def _grads(ctx, grad_first: torch.Tensor | None, grad_second: torch.Tensor | None) -> dict:
    from kernels.opdef import public  # the gradient's kernel is dispatched too

    offsets, first_offsets = ctx.saved_tensors
    if not ctx.needs_grad["values"]:
        return {}
    total, dim = ctx.shape
    like = grad_first if grad_first is not None else grad_second
    if grad_first is None:  # a part nothing differentiates
        grad_first = like.new_zeros((ctx.first_total, dim))
    if grad_second is None:
        grad_second = like.new_zeros((total - ctx.first_total, dim))
    second_offsets = offsets - first_offsets.to(offsets.dtype)
    return {"values": public("jagged_concat")(grad_first, first_offsets, grad_second, second_offsets)}


def _fake(values, offsets, first_offsets, *, first_total):
    dim = values.shape[1]
    return values.new_empty((first_total, dim)), values.new_empty((values.shape[0] - first_total, dim))


OP = Op(
    name=NAME,
    cost=lambda values, offsets, first_offsets, *, first_total: (
        0.0,
        2.0 * values.numel() * values.element_size(),
    ),
    problem=PROBLEM,
    default="kernels.jagged_split:jagged_split",
    check=_check,
    fake=_fake,
    bucket=lambda values, offsets, first_offsets, *, first_total: concat_bucket_of(
        values.shape[1], offsets.shape[0] - 1, values.shape[0]
    ),
    backward=Backward(save=_save, grads=_grads, uses=("jagged_concat",)),
    doc="""Each sequence of a jagged tensor cut in two: its first rows and the rest.

    values [T, D]; offsets [B + 1]; first_offsets [B + 1] (int32/int64; sequence b's first part
    has first_offsets[b + 1] - first_offsets[b] rows); first_total = first_offsets[-1] ->
    (first [first_total, D], second [T - first_total, D]), the second's offsets being offsets -
    first_offsets. Differentiable in values (jagged_concat).
    """,
)
