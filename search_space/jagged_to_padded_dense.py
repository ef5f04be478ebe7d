"""jagged_to_padded_dense: a jagged tensor in padded-dense form,

    out[b, p, :] = values[offsets[b] + p, :]   for p < min(length_b, max_len)
    out[b, p, :] = padding_value               otherwise,

values [T, D], offsets [B + 1] (from 0 to T) -> [B, max_len, D]; a sequence's rows past max_len
are dropped. What a model runs where a dense layer (or padded attention) needs a user history
in a [B, N, D] block. Its gradient is dense_to_jagged of grad_out (zeros for dropped rows).
The shared shapes and buckets are in search_space.jagged_transforms.
"""

from __future__ import annotations

import torch

from search_space.jagged_transforms import (
    CHECK_SHAPES,
    INTERPRETED_TIMING_SHAPES,
    TIMING_SHAPES,
    bucket_of,
    check_offsets,
    copy_problem,
    kept_rows,
    lengths_of,
    num_seqs,
    offsets_of,
    padded_len,
    random_rows,
    shape_bucket,
    tile_template,
)
from search_space.op import Backward, Op
from search_space.problem import Inputs, Shape

NAME = "jagged_to_padded_dense"


def reference(
    values: torch.Tensor, offsets: torch.Tensor, *, max_len: int, padding_value: float = 0.0
) -> torch.Tensor:
    """Plain PyTorch: scatter the kept rows into a tensor filled with padding_value."""
    num = offsets.numel() - 1
    out = values.new_full((num, max_len, values.shape[1]), padding_value)
    offsets = offsets.long()
    total = int(offsets[-1])
    seq = torch.repeat_interleave(torch.arange(num, device=values.device), offsets[1:] - offsets[:-1])
    positions = torch.arange(total, device=values.device) - offsets[:-1][seq]
    kept = positions < max_len
    out[seq[kept], positions[kept]] = values[:total][kept]
    return out


def torch_jagged_to_padded_dense(values, offsets, *, max_len, padding_value=0.0):
    """torch's own kernel (its port of FBGEMM's), which takes int64 offsets."""
    return torch.ops.aten._jagged_to_padded_dense_forward(values, [offsets.long()], [max_len], padding_value)


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    p = shape.params
    lengths = lengths_of(shape, seed)
    offsets = offsets_of(lengths, torch.int32 if seed % 2 else torch.int64)
    values = random_rows(int(offsets[-1]), p["dim"], shape.torch_dtype, seed + 1, device)
    kwargs = {"max_len": padded_len(shape), "padding_value": float(p.get("padding_value", 0.0))}
    return Inputs(args=(values, offsets.to(device)), kwargs=kwargs)


def bytes_moved(shape: Shape) -> float:
    """The kept rows read once and the padded form written once (offsets beside)."""
    cells = num_seqs(shape) * padded_len(shape)
    return (kept_rows(shape) + cells) * shape.params["dim"] * shape.torch_dtype.itemsize + 8 * num_seqs(shape)


PROBLEM = copy_problem(
    NAME,
    signature=(
        "jagged_to_padded_dense(values: Tensor[T, D], offsets: int32|int64 Tensor[B + 1], *, "
        "max_len: int, padding_value: float = 0.0) -> Tensor[B, max_len, D]"
    ),
    description=__doc__,
    check_shapes=CHECK_SHAPES,
    timing_shapes=TIMING_SHAPES,
    interpreted_timing_shapes=INTERPRETED_TIMING_SHAPES,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.jagged_to_padded_dense": torch_jagged_to_padded_dense},
    bytes=bytes_moved,
    bucket=shape_bucket,
)

TEMPLATE = tile_template(NAME, "BLOCK_L", "padded positions per program")


def _check(values, offsets, *, max_len, padding_value=0.0) -> None:
    if values.dim() != 2:
        raise ValueError(f"values must be [T, D], got shape {tuple(values.shape)}")
    check_offsets(offsets, None, values.device)
    if max_len < 0:
        raise ValueError(f"max_len must be >= 0, got {max_len}")


def _save(ctx, inputs: dict, output) -> None:
    ctx.save_for_backward(inputs["offsets"])
    ctx.total = inputs["values"].shape[0]


def _grads(ctx, grad_out: torch.Tensor) -> dict:
    from kernels.opdef import public  # the gradient's kernel is dispatched too

    (offsets,) = ctx.saved_tensors
    if not ctx.needs_grad["values"]:
        return {}
    return {"values": public("dense_to_jagged")(grad_out, offsets, total=ctx.total)}


OP = Op(
    name=NAME,
    cost=lambda values, offsets, *, max_len, padding_value=0.0: (
        0.0,
        float(values.numel() + (offsets.shape[0] - 1) * max_len * values.shape[1]) * values.element_size(),
    ),
    problem=PROBLEM,
    default="kernels.jagged_to_padded_dense:jagged_to_padded_dense",
    check=_check,
    fake=lambda values, offsets, *, max_len, padding_value=0.0: values.new_empty(
        (offsets.shape[0] - 1, max_len, values.shape[1])
    ),
    bucket=lambda values, offsets, *, max_len, padding_value=0.0: bucket_of(
        values.shape[1], offsets.shape[0] - 1, max_len, values.shape[0]
    ),
    backward=Backward(save=_save, grads=_grads, uses=("dense_to_jagged",)),
    doc="""A jagged tensor in padded-dense form.

    values [T, D]; offsets [B + 1] int32/int64 from 0 to T; max_len N -> [B, N, D], row p of
    sequence b at [b, p] for p < N (rows past N dropped), padding_value elsewhere.
    Differentiable in values (its gradient is dense_to_jagged of grad_out).
    """,
)
