"""jagged_concat: two jagged tensors joined sequence by sequence,

    out[offsets[b] + p] = first[first_offsets[b] + p]                 for p < n1_b
    out[offsets[b] + p] = second[second_offsets[b] + p - n1_b]        for n1_b <= p < n1_b + n2_b,

first [T1, D], second [T2, D] with offsets [B + 1] each -> [T1 + T2, D], whose offsets are
first_offsets + second_offsets. A user's history followed by its candidates (HSTU's training
input), or two feature sequences in one. Its gradient is jagged_split of grad_out. The shared
shapes and buckets are in search_space.jagged_transforms.
"""

from __future__ import annotations

import torch

from search_space.jagged_transforms import (
    CONCAT_CHECK_SHAPES,
    CONCAT_INTERPRETED_TIMING_SHAPES,
    CONCAT_TIMING_SHAPES,
    check_offsets,
    concat_bucket_of,
    concat_rows,
    concat_shape_bucket,
    copy_problem,
    first_lengths,
    num_seqs,
    offsets_of,
    random_rows,
    second_lengths,
    tile_template,
)
from search_space.op import Backward, Op
from search_space.problem import Inputs, Shape

NAME = "jagged_concat"


def concat_map(
    first_offsets: torch.Tensor, second_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each output row, whether it comes from the first part, and its row there (plain
    PyTorch index arithmetic, shared by jagged_split's reference)."""
    first_offsets, second_offsets = first_offsets.long(), second_offsets.long()
    offsets = first_offsets + second_offsets
    num, total = offsets.numel() - 1, int(offsets[-1])
    seq = torch.repeat_interleave(torch.arange(num, device=offsets.device), offsets[1:] - offsets[:-1])
    position = torch.arange(total, device=offsets.device) - offsets[:-1][seq]
    first_len = (first_offsets[1:] - first_offsets[:-1])[seq]
    from_first = position < first_len
    row = torch.where(
        from_first, first_offsets[:-1][seq] + position, second_offsets[:-1][seq] + position - first_len
    )
    return from_first, row


def reference(
    first: torch.Tensor, first_offsets: torch.Tensor, second: torch.Tensor, second_offsets: torch.Tensor
) -> torch.Tensor:
    """Plain PyTorch: each output row gathered from the part it comes from."""
    from_first, row = concat_map(first_offsets, second_offsets)
    out = first.new_empty((first.shape[0] + second.shape[0], first.shape[1]))
    out[from_first] = first[row[from_first]]
    out[~from_first] = second[row[~from_first]]
    return out


def per_sample_cat(first, first_offsets, second, second_offsets):
    """What eager code writes without a jagged kernel: one torch.cat of 2B slices."""
    a, b = first_offsets.tolist(), second_offsets.tolist()
    parts = []
    for i in range(len(a) - 1):
        parts += [first[a[i] : a[i + 1]], second[b[i] : b[i + 1]]]
    return torch.cat(parts) if parts else first.new_empty((0, first.shape[1]))


def make_parts(shape: Shape, seed: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(first, first_offsets, second, second_offsets) of a shape: int64 first offsets on even
    seeds, and second offsets of the other dtype on every second pair of seeds."""
    dtype = torch.int32 if seed % 2 else torch.int64
    other = {torch.int32: torch.int64, torch.int64: torch.int32}[dtype] if seed % 4 >= 2 else dtype
    first_offsets = offsets_of(first_lengths(shape, seed), dtype)
    second_offsets = offsets_of(second_lengths(shape, seed), other)
    dim, dtype = shape.params["dim"], shape.torch_dtype
    first = random_rows(int(first_offsets[-1]), dim, dtype, seed + 1, device)
    second = random_rows(int(second_offsets[-1]), dim, dtype, seed + 2, device)
    return first, first_offsets.to(device), second, second_offsets.to(device)


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    return Inputs(args=make_parts(shape, seed, device))


def bytes_moved(shape: Shape) -> float:
    """Every row read once and written once (two offset arrays beside)."""
    return 2 * concat_rows(shape) * shape.params["dim"] * shape.torch_dtype.itemsize + 16 * num_seqs(shape)


PROBLEM = copy_problem(
    NAME,
    signature=(
        "jagged_concat(first: Tensor[T1, D], first_offsets: int32|int64 Tensor[B + 1], "
        "second: Tensor[T2, D], second_offsets: int32|int64 Tensor[B + 1]) -> Tensor[T1 + T2, D]"
    ),
    description=__doc__,
    check_shapes=CONCAT_CHECK_SHAPES,
    timing_shapes=CONCAT_TIMING_SHAPES,
    interpreted_timing_shapes=CONCAT_INTERPRETED_TIMING_SHAPES,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.cat": per_sample_cat},
    bytes=bytes_moved,
    bucket=concat_shape_bucket,
)

TEMPLATE = tile_template(NAME, "BLOCK_T", "output rows per program")


def _check(first, first_offsets, second, second_offsets) -> None:
    for what, t in (("first", first), ("second", second)):
        if t.dim() != 2:
            raise ValueError(f"{what} must be [T, D], got shape {tuple(t.shape)}")
    if first.shape[1] != second.shape[1] or first.dtype != second.dtype:
        raise ValueError(
            f"first and second must share D and dtype, got {tuple(first.shape)} {first.dtype} and "
            f"{tuple(second.shape)} {second.dtype}"
        )
    check_offsets(first_offsets, None, first.device)
    check_offsets(second_offsets, first_offsets.numel() - 1, second.device)


def _save(ctx, inputs: dict, output) -> None:
    ctx.save_for_backward(inputs["first_offsets"], inputs["second_offsets"])
    ctx.first_total = inputs["first"].shape[0]


def _grads(ctx, grad_out: torch.Tensor) -> dict:
    from kernels.opdef import public  # the gradient's kernel is dispatched too

    first_offsets, second_offsets = ctx.saved_tensors
    if not (ctx.needs_grad["first"] or ctx.needs_grad["second"]):
        return {}
    offsets = first_offsets + second_offsets.to(first_offsets.dtype)
    first, second = public("jagged_split")(grad_out, offsets, first_offsets, first_total=ctx.first_total)
    return {"first": first, "second": second}


OP = Op(
    name=NAME,
    cost=lambda first, first_offsets, second, second_offsets: (
        0.0,
        2.0 * (first.numel() + second.numel()) * first.element_size(),
    ),
    problem=PROBLEM,
    default="kernels.jagged_concat:jagged_concat",
    check=_check,
    fake=lambda first, first_offsets, second, second_offsets: first.new_empty(
        (first.shape[0] + second.shape[0], first.shape[1])
    ),
    bucket=lambda first, first_offsets, second, second_offsets: concat_bucket_of(
        first.shape[1], first_offsets.shape[0] - 1, first.shape[0] + second.shape[0]
    ),
    backward=Backward(save=_save, grads=_grads, uses=("jagged_split",)),
    doc="""Two jagged tensors joined sequence by sequence (a history, then its candidates).

    first [T1, D] with first_offsets [B + 1], second [T2, D] with second_offsets [B + 1]
    (int32/int64) -> [T1 + T2, D], sequence b's rows of first then of second; its offsets are
    first_offsets + second_offsets. Differentiable in first and second (jagged_split).
    """,
)
