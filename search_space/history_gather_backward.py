"""The history gather's training update: the gradients of search_space.history_gather,

    grad_table[r, :]        = sum_{t : ids[t] = r} grad_out[t, :]      (dense, [num_rows, D])
    grad_bucket_table[k, :] = sum_{t : bucket(t) = k} grad_out[t, :]   ([num_buckets, D])

in grad_out's dtype, accumulated in fp32, with bucket(t) as the forward has it (bucket_ids[t],
or positional where bucket_ids is None; num_buckets 0: no bucket add). `order` lists the events
with equal ids together (the forward's dedup, or torch.argsort(ids) where the forward had none):
each id's events are one run in it, so its row is one sum, written once, with no atomics on the
table gradient. Ids repeat (popular items), so a kernel must add, never overwrite.
"""

from __future__ import annotations

import dataclasses

import torch

from search_space import embedding_bag
from search_space import history_gather as forward
from search_space.embedding_bag import dim_bucket
from search_space.jagged_transforms import mean_total, num_seqs, random_rows
from search_space.op import Op
from search_space.problem import Inputs, Shape, Tolerance
from search_space.template import Knob, KnobTemplate

NAME = "history_gather_backward"


def reference(
    grad_out: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor,
    num_rows: int,
    *,
    bucket_ids: torch.Tensor | None = None,
    num_buckets: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of search_space.history_gather.reference, written out: each event's
    upstream row added to its id's row and its bucket's, in fp32 (fp64 if given fp64). (No
    autograd: dispatch runs this inside a custom op, where autograd is switched off.)"""
    acc = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
    rows = grad_out.to(acc)
    dim = grad_out.shape[1]
    grad_table = torch.zeros(num_rows, dim, dtype=acc, device=grad_out.device).index_add_(0, ids, rows)
    grad_buckets = torch.zeros(num_buckets, dim, dtype=acc, device=grad_out.device)
    if num_buckets:
        grad_buckets.index_add_(0, forward.bucket_index(ids.shape[0], offsets, bucket_ids, num_buckets), rows)
    return grad_table.to(grad_out.dtype), grad_buckets.to(grad_out.dtype)


def torch_index_add(grad_out, ids, offsets, order, num_rows, *, bucket_ids=None, num_buckets=0):
    """What autograd of the eager gather runs: index_add into zeros, in grad_out's dtype."""
    dim = grad_out.shape[1]
    grad_table = grad_out.new_zeros((num_rows, dim)).index_add_(0, ids, grad_out)
    grad_buckets = grad_out.new_zeros((num_buckets, dim))
    if num_buckets:
        grad_buckets.index_add_(
            0, forward.bucket_index(ids.shape[0], offsets, bucket_ids, num_buckets), grad_out
        )
    return grad_table, grad_buckets


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    """The forward's index tensors (its order, or the ids sorted where it had none) and an
    upstream gradient."""
    index = forward.make_indices(shape, seed, device)
    ids = index["ids"]
    order = index["order"] if index["order"] is not None else torch.argsort(ids, stable=True).to(ids.dtype)
    grad_out = random_rows(ids.shape[0], shape.params["dim"], shape.torch_dtype, seed ^ 0x5EED, device)
    kwargs = {"bucket_ids": index["bucket_ids"], "num_buckets": shape.params.get("buckets", 0)}
    return Inputs(args=(grad_out, ids, index["offsets"], order, shape.params["num_rows"]), kwargs=kwargs)


def flops(shape: Shape) -> float:
    """One add per element of every event's row, into its id's row and its bucket's."""
    per_event = 2 if shape.params.get("buckets", 0) else 1
    return mean_total(shape) * shape.params["dim"] * per_event


def bytes_moved(shape: Shape) -> float:
    """grad_out read once, the indices read (order always), the dense table gradient and the
    bucket rows written once: at realistic sizes the [num_rows, D] gradient is most of it."""
    p, elem, index = shape.params, shape.torch_dtype.itemsize, 4 if shape.params.get("int32") else 8
    total = mean_total(shape)
    moved = total * p["dim"] * elem + 2 * total * index + (num_seqs(shape) + 1) * index
    moved += (p["num_rows"] + p.get("buckets", 0)) * p["dim"] * elem
    if p.get("buckets", 0) and not p.get("positional"):
        moved += total * index
    return moved


# Each gradient row is a sum over the events of one id (or bucket), accumulated in fp32 and
# rounded once, as embedding_bag's pooled sums are: its bf16 and fp16 bounds, derived there.
# fp32 sums over more rows: a popular item or the last positional bucket collects up to about
# 4e5 events of a training batch, and fp32 sums in any order drift by about 2^-24 sqrt(n) of the
# sum, 4e-5 at that n.
TOLERANCES = {
    **embedding_bag.TOLERANCES,
    "fp32": Tolerance(atol=1e-5, rtol=1e-4, norm_rtol=1e-4, row_rtol=1e-4, row_atol=1e-6),
}


def error_scale(inputs: Inputs) -> float | None:
    """For fp32, the magnitude of the largest sum: grad_out's RMS times the most events of one id
    (or one bucket, or the whole batch for positional buckets). A hot id's gradient sums that
    many rows, and sums in another order differ by about 2^-24 of it per term: where the sum
    cancels to nearly zero, that is a correct kernel's error, far above a bound relative to the
    element (a hot id of a production batch on the H200). bf16 and fp16 round coarser: their
    bounds stand."""
    grad_out, ids = inputs.args[0], inputs.args[1]
    if grad_out.dtype != torch.float32 or ids.numel() == 0:
        return None
    most = int(torch.unique(ids, return_counts=True)[1].max())
    if inputs.kwargs.get("num_buckets"):
        bucket_ids = inputs.kwargs.get("bucket_ids")
        most = max(
            most,
            int(torch.unique(bucket_ids, return_counts=True)[1].max())
            if bucket_ids is not None
            else ids.numel(),
        )
    return grad_out.pow(2).mean().sqrt().item() * most


# The knobs of the default kernels (kernels/history_gather.py, whose KNOBS dict holds them beside
# the forward's): None keeps the launch heuristic for that knob at each call's dim.
KNOBS = (
    Knob(
        "GRAD_BLOCK_J",
        (None, 16, 32, 64),
        default=None,
        help="events (in id order) per program: longer tiles leave fewer runs to finish in a second pass",
    ),
    Knob("GRAD_BLOCK_D", (None, 32, 64, 128), default=None, help="gradient columns per program"),
    Knob("GRAD_num_warps", (None, 2, 4, 8), default=None, help="warps per program"),
)


def _knob_constraints(knobs: dict) -> str | None:
    if knobs["GRAD_BLOCK_J"] is None or knobs["GRAD_BLOCK_D"] is None:
        return None
    tile = knobs["GRAD_BLOCK_J"] * knobs["GRAD_BLOCK_D"]
    if tile > 4096:
        return f"GRAD_BLOCK_J * GRAD_BLOCK_D = {tile} > 4096: its fp64 prefix sums spill registers"
    return None


TEMPLATE = KnobTemplate(
    problem=NAME,
    source_module="kernels.history_gather",
    entry=NAME,
    knobs=KNOBS,
    constraint=_knob_constraints,
)


def bucket(shape: Shape) -> str:
    return dim_bucket(shape.params["dim"])


PROBLEM = dataclasses.replace(
    forward.PROBLEM,
    name=NAME,
    entry=NAME,
    signature=(
        "history_gather_backward(grad_out: Tensor[T, D], ids: int32|int64 Tensor[T], offsets: int32|int64 "
        "Tensor[B + 1], order: int32|int64 Tensor[T] (equal ids listed together), num_rows: int, *, "
        "bucket_ids: int32|int64 Tensor[T] | None = None, num_buckets: int = 0) -> (Tensor[num_rows, D], "
        "Tensor[num_buckets, D]) in grad_out's dtype"
    ),
    description=__doc__,
    tolerances=TOLERANCES,
    error_scale=error_scale,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.index_add": torch_index_add},
    flops=flops,
    bytes=bytes_moved,
    bucket=bucket,
    template=NAME,
    forbidden_ops=(*forward.FORBIDDEN_OPS, "index_reduce", "index_reduce_", "segment_reduce", "autograd"),
    # Zeros are part of the answer (the rows of ids no event names): the host may fill them.
    host_copies_compute=False,
    optimizes="backward",
)


def check_arguments(
    grad_out: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor,
    num_rows: int,
    *,
    bucket_ids: torch.Tensor | None = None,
    num_buckets: int = 0,
) -> None:
    if grad_out.dim() != 2 or grad_out.dtype not in forward.TABLE_DTYPES or grad_out.shape[0] != ids.shape[0]:
        raise ValueError(
            f"grad_out must be an fp32, bf16 or fp16 [T = {ids.shape[0]}, D] tensor, got {grad_out.dtype} "
            f"of shape {tuple(grad_out.shape)}"
        )
    if num_rows < 0 or num_buckets < 0:
        raise ValueError(f"num_rows and num_buckets must be >= 0, got {num_rows} and {num_buckets}")
    if order is None:
        raise ValueError("order is required: the events with equal ids listed together")
    forward.check_indices(ids, offsets, order, bucket_ids, num_rows, num_buckets, grad_out.device)


def _fake(grad_out, ids, offsets, order, num_rows, *, bucket_ids=None, num_buckets=0):
    dim = grad_out.shape[1]
    return grad_out.new_empty((num_rows, dim)), grad_out.new_empty((num_buckets, dim))


def call_cost(
    grad_out, ids, offsets, order, num_rows, *, bucket_ids=None, num_buckets=0
) -> tuple[float, float]:
    """One call's FLOPs and minimum bytes (bytes_moved's count on the call's own tensors)."""
    total, dim, elem = grad_out.shape[0], grad_out.shape[1], grad_out.element_size()
    moved = (total + num_rows + num_buckets) * dim * elem
    moved += sum(t.numel() * t.element_size() for t in (ids, offsets, order, bucket_ids) if t is not None)
    return float(total * dim * (2 if num_buckets else 1)), float(moved)


OP = Op(
    name=NAME,
    problem=PROBLEM,
    default="kernels.history_gather:history_gather_backward",
    check=check_arguments,
    fake=_fake,
    bucket=lambda grad_out, ids, offsets, order, num_rows, *, bucket_ids=None, num_buckets=0: dim_bucket(
        grad_out.shape[1]
    ),
    cost=call_cost,
    doc="""The history gather's training update: grad_out [T, D], the forward's ids, offsets and
    bucket_ids, order [T] (equal ids listed together) -> (the dense table gradient [num_rows, D],
    the bucket rows' [num_buckets, D]), in grad_out's dtype, summed in fp32.""",
)
