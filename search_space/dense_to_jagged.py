"""dense_to_jagged: the jagged rows of a padded-dense tensor,

    out[offsets[b] + p, :] = dense[b, p, :]   for p < N
    out[offsets[b] + p, :] = 0                for N <= p < length_b,

dense [B, N, D], offsets [B + 1] (from 0 to total) -> [total, D]. The number of rows, `total`
(offsets[-1]), is an argument, so the op never reads it back from the GPU: a model knows it
(the jagged tensor it came from) and a CUDA graph can capture the call. The inverse of
jagged_to_padded_dense, and its gradient; its own gradient is jagged_to_padded_dense of grad_out
with zero padding. The shared shapes and buckets are in search_space.jagged_transforms.
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
    mean_total,
    num_seqs,
    offsets_of,
    padded_len,
    random_rows,
    shape_bucket,
    tile_template,
)
from search_space.op import Backward, Op
from search_space.problem import Inputs, Shape

NAME = "dense_to_jagged"


def reference(dense: torch.Tensor, offsets: torch.Tensor, *, total: int) -> torch.Tensor:
    """Plain PyTorch: gather the rows that exist in the padded form, zeros for the rest."""
    num, padded, dim = dense.shape
    offsets = offsets.long()
    if int(offsets[-1]) != total:
        raise ValueError(f"total is {total}, but offsets end at {int(offsets[-1])}")
    seq = torch.repeat_interleave(torch.arange(num, device=dense.device), offsets[1:] - offsets[:-1])
    positions = torch.arange(total, device=dense.device) - offsets[:-1][seq]
    kept = positions < padded
    out = dense.new_zeros((total, dim))
    out[kept] = dense[seq[kept], positions[kept]]
    return out


def torch_dense_to_jagged(dense, offsets, *, total):
    """torch's own kernel (its port of FBGEMM's), which takes int64 offsets and refuses a
    sequence longer than N (no timing shape has one)."""
    return torch.ops.aten._padded_dense_to_jagged_forward(dense, [offsets.long()], total)


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    lengths = lengths_of(shape, seed)
    offsets = offsets_of(lengths, torch.int32 if seed % 2 else torch.int64)
    rows, dim = len(lengths) * padded_len(shape), shape.params["dim"]
    dense = random_rows(rows, dim, shape.torch_dtype, seed + 1, device).view(
        len(lengths), padded_len(shape), dim
    )
    kwargs = {"total": int(offsets[-1])}
    return Inputs(args=(dense, offsets.to(device)), kwargs=kwargs)


def bytes_moved(shape: Shape) -> float:
    """The rows kept read once, every output row written once (offsets beside)."""
    return (kept_rows(shape) + mean_total(shape)) * shape.params["dim"] * shape.torch_dtype.itemsize + (
        8 * num_seqs(shape)
    )


PROBLEM = copy_problem(
    NAME,
    signature=(
        "dense_to_jagged(dense: Tensor[B, N, D], offsets: int32|int64 Tensor[B + 1], *, total: int) "
        "-> Tensor[total, D]"
    ),
    description=__doc__,
    check_shapes=CHECK_SHAPES,
    timing_shapes=TIMING_SHAPES,
    interpreted_timing_shapes=INTERPRETED_TIMING_SHAPES,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.dense_to_jagged": torch_dense_to_jagged},
    bytes=bytes_moved,
    bucket=shape_bucket,
)

TEMPLATE = tile_template(NAME, "BLOCK_T", "jagged rows per program")


def _check(dense, offsets, *, total) -> None:
    if dense.dim() != 3:
        raise ValueError(f"dense must be [B, N, D], got shape {tuple(dense.shape)}")
    check_offsets(offsets, dense.shape[0], dense.device)
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")


def _save(ctx, inputs: dict, output) -> None:
    ctx.save_for_backward(inputs["offsets"])
    ctx.padded_len = inputs["dense"].shape[1]


def _grads(ctx, grad_out: torch.Tensor) -> dict:
    from kernels.opdef import public  # the gradient's kernel is dispatched too

    (offsets,) = ctx.saved_tensors
    if not ctx.needs_grad["dense"]:
        return {}
    return {"dense": public("jagged_to_padded_dense")(grad_out, offsets, max_len=ctx.padded_len)}


OP = Op(
    name=NAME,
    cost=lambda dense, offsets, *, total: (0.0, 2.0 * total * dense.shape[2] * dense.element_size()),
    problem=PROBLEM,
    default="kernels.dense_to_jagged:dense_to_jagged",
    check=_check,
    fake=lambda dense, offsets, *, total: dense.new_empty((total, dense.shape[2])),
    bucket=lambda dense, offsets, *, total: bucket_of(dense.shape[2], dense.shape[0], dense.shape[1], total),
    backward=Backward(save=_save, grads=_grads, uses=("jagged_to_padded_dense",)),
    doc="""The jagged rows of a padded-dense tensor (the inverse of jagged_to_padded_dense).

    dense [B, N, D]; offsets [B + 1] int32/int64 from 0 to total; total = offsets[-1] (given,
    so that no call syncs the host) -> [total, D]: row p of sequence b is dense[b, p] for
    p < N, zeros past N. Differentiable in dense.
    """,
)
