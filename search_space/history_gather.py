"""history_gather: the item embeddings of user histories, one row per event,

    out[t, :] = table[ids[t], :]  (+ bucket_table[bucket(t), :])

table [num_rows, D], ids [T] (the events of B sequences, offsets [B + 1] from 0 to T) -> [T, D],
a jagged tensor with the histories' offsets. The optional add is a time-bucket embedding
(bucket(t) = bucket_ids[t]) or, with bucket_table alone, a positional one: bucket(t) is t's
distance from its sequence's last event (the newest event 0), clamped to num_buckets - 1, so
that recent events keep their own rows however long the history and the oldest share the last.
The add is done in fp32 and rounded once. Its gradients: the dense table gradient (each id's
row sums the upstream rows of its events) and the bucket rows' (history_gather_backward).

Deduplication. Popular items repeat within a request's history and across a batch's: each
distinct row need be read from HBM once, and its gradient is one sum. The caller says which
events share an id with `order`, a permutation of [0, T) that lists equal ids together
(torch.argsort(ids, stable=True)), computed once per batch, where the batch is built (the data
loader, on the host, off the GPU's critical path), and reused by the forward and the backward.
Given it, the forward reads the events in that order, so an id's repeats fall in one tile and
its row is fetched once per tile it spans; the backward sums each id's run of events in one
pass and writes its row once, with no atomics on the table gradient and the same result every
run. Unique ids and an inverse index would serve the forward as well, but the backward would
still need the events grouped by id, which `order` is; and a kernel that deduplicated by itself
would sort the ids on every call. Nothing here syncs the host: `order` is an input, not a size
read back. Without it the forward reads rows in event order (repeats hit the caches if they
are close), and the backward sorts the ids on the device first.
"""

from __future__ import annotations

import functools
import math

import torch

from search_space.embedding_bag import dim_bucket
from search_space.jagged_transforms import lengths_of, mean_total, num_seqs, offsets_of, random_rows
from search_space.op import Backward, Op
from search_space.problem import Inputs, Problem, Shape, Tolerance
from search_space.template import Knob, KnobTemplate
from search_space.workload import (
    EMBEDDING_DIMS,
    HSTU_BATCH,
    HSTU_MAX_LEN,
    SERVING_LONG_HISTORY,
    SERVING_REQUESTS,
    TABLE_ROWS_TIMING,
)

NAME = "history_gather"
INDEX_DTYPES = (torch.int32, torch.int64)
TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The model's age buckets (model.config's history.time_buckets), and positional rows that cover
# the recent part of a history of the median length.
TIME_BUCKETS = 64
POSITION_BUCKETS = 512
# Multiplying popularity ranks by this prime (coprime with every table size) and reducing
# modulo the table scatters the popular items over the table, as a real id space does.
SCATTER = 2_654_435_761


def bucket_index(
    total: int, offsets: torch.Tensor, bucket_ids: torch.Tensor | None, num_buckets: int
) -> torch.Tensor:
    """Each event's bucket row [T] (int64): bucket_ids, or its distance from its sequence's last
    event, clamped to num_buckets - 1 (positional)."""
    if bucket_ids is not None:
        return bucket_ids.long()
    offsets = offsets.long()
    ends = torch.repeat_interleave(offsets[1:], offsets[1:] - offsets[:-1], output_size=total)
    return (ends - 1 - torch.arange(total, device=offsets.device)).clamp(max=num_buckets - 1)


def reference(
    table: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    *,
    order: torch.Tensor | None = None,
    bucket_ids: torch.Tensor | None = None,
    bucket_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch: the rows by index, the bucket rows added in fp32 (fp64 if given fp64) and
    rounded once. `order` says how a kernel may read the rows, not what they are: unused here."""
    rows = table.index_select(0, ids)
    if bucket_table is None:
        return rows
    acc = torch.float64 if table.dtype == torch.float64 else torch.float32
    index = bucket_index(ids.shape[0], offsets, bucket_ids, bucket_table.shape[0])
    return (rows.to(acc) + bucket_table.index_select(0, index).to(acc)).to(table.dtype)


def torch_history_gather(table, ids, offsets, *, order=None, bucket_ids=None, bucket_table=None):
    """What eager model code runs: index_select, and the bucket rows added in the table's dtype
    (torch adds 16-bit floats in fp32 and rounds once, as the reference does)."""
    rows = table.index_select(0, ids)
    if bucket_table is None:
        return rows
    index = bucket_index(ids.shape[0], offsets, bucket_ids, bucket_table.shape[0])
    return rows + bucket_table.index_select(0, index)


# --- inputs ----------------------------------------------------------------------------------
#
# Shape params: num_rows, dim; the sequences as search_space.jagged_transforms draws them
# (`lengths`, or num_seqs, dist, max_len and `quantiles`); `ids`: "uniform", "zipf" (popular
# items) or "few" (three distinct ids: every request repeats them); `last_row`: some events name
# the table's last row; `dedup`: the call passes `order`; `buckets`: rows of bucket_table (0:
# no add), `positional` or bucket_ids drawn at random, or as chronological `ages`; `int32`:
# every index tensor int32.


def draw_ids(
    kind: str, count: int, num_rows: int, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    if kind == "few":
        return torch.randint(0, min(3, num_rows), (count,), generator=gen, device=device)
    if kind == "uniform":
        return torch.randint(0, num_rows, (count,), generator=gen, device=device)
    # Log-uniform popularity ranks, P(rank k) ~ 1 / k (model.data's item ids), scattered.
    u = torch.rand(count, generator=gen, dtype=torch.float64, device=device)
    ranks = ((u * math.log(num_rows + 1)).exp().floor().long() - 1).clamp_(0, num_rows - 1)
    return ranks * SCATTER % num_rows


def age_buckets(offsets: torch.Tensor, total: int, num_buckets: int, gen: torch.Generator) -> torch.Tensor:
    """Time buckets of chronological events: an event's age adds up exponential gaps back from
    its sequence's newest event, on a log scale (8 buckets per doubling), so a sequence's
    buckets rise in runs from its newest event to its oldest."""
    gaps = torch.empty(total, dtype=torch.float64, device=offsets.device).exponential_(generator=gen)
    after = gaps.new_zeros(total + 1)
    after[:total] = gaps.flip(0).cumsum(0).flip(0)  # after[t]: the gaps of events t.. of the batch
    ends = torch.repeat_interleave(offsets[1:], offsets[1:] - offsets[:-1], output_size=total)
    age = after[1:] - after[ends]
    return (8 * torch.log2(1 + age)).long().clamp_(max=num_buckets - 1)


def make_indices(shape: Shape, seed: int, device: torch.device) -> dict[str, torch.Tensor | None]:
    """The call's index tensors: ids, offsets, order (None without dedup), bucket_ids (None
    without buckets or positional), drawn on `device` (a training batch holds half a million
    events)."""
    p = shape.params
    offsets = offsets_of(lengths_of(shape, seed))
    total = int(offsets[-1])
    offsets = offsets.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = draw_ids(p.get("ids", "uniform"), total, p["num_rows"], gen, device)
    if p.get("last_row") and total:
        ids[total // 2] = ids[-1] = p["num_rows"] - 1
    bucket_ids = None
    if p.get("buckets", 0) and not p.get("positional"):
        if p.get("ages"):
            bucket_ids = age_buckets(offsets, total, p["buckets"], gen)
        else:
            bucket_ids = torch.randint(0, p["buckets"], (total,), generator=gen, device=device)
    order = torch.argsort(ids, stable=True) if p.get("dedup") else None
    dtype = torch.int32 if p.get("int32") else torch.int64
    found = {"ids": ids, "offsets": offsets, "order": order, "bucket_ids": bucket_ids}
    return {k: None if v is None else v.to(dtype) for k, v in found.items()}


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    p = shape.params
    index = make_indices(shape, seed, device)
    table = random_rows(p["num_rows"], p["dim"], shape.torch_dtype, seed + 1, device)
    buckets = p.get("buckets", 0)
    bucket_table = random_rows(buckets, p["dim"], shape.torch_dtype, seed + 2, device) if buckets else None
    kwargs = {"order": index["order"], "bucket_ids": index["bucket_ids"], "bucket_table": bucket_table}
    return Inputs(args=(table, index["ids"], index["offsets"]), kwargs=kwargs)


# --- roofline --------------------------------------------------------------------------------


@functools.cache
def expected_unique(kind: str, count: int, num_rows: int) -> float:
    """The expected number of distinct ids among `count` drawn as draw_ids(kind) draws them."""
    if kind == "few":
        num_rows = min(3, num_rows)
    if kind != "zipf":
        return num_rows * (1.0 - (1.0 - 1.0 / num_rows) ** count)
    rank = torch.arange(num_rows, dtype=torch.float64)
    prob = torch.log1p(1.0 / (rank + 1)) / math.log(num_rows + 1)
    return float((1.0 - torch.exp(count * torch.log1p(-prob))).sum())


def _index_bytes(shape: Shape) -> int:
    return 4 if shape.params.get("int32") else 8


def flops(shape: Shape) -> float:
    """One add per element where bucket rows are added."""
    return mean_total(shape) * shape.params["dim"] if shape.params.get("buckets", 0) else 0.0


def bytes_moved(shape: Shape) -> float:
    """Minimum traffic: each distinct row read once, the output written once, the indices the
    call passes (ids, offsets, order, bucket ids) and the bucket rows read once."""
    p, elem, index = shape.params, shape.torch_dtype.itemsize, _index_bytes(shape)
    total = mean_total(shape)
    unique = expected_unique(p.get("ids", "uniform"), round(total), p["num_rows"])
    moved = (unique + total) * p["dim"] * elem + total * index + (num_seqs(shape) + 1) * index
    if p.get("dedup"):
        moved += total * index
    if p.get("buckets", 0):
        moved += p["buckets"] * p["dim"] * elem + (0 if p.get("positional") else total * index)
    return moved


def bucket_of(dim: int, dedup: bool) -> str:
    """The row width (dim_bucket) and whether the call reads in id order: the two gathers differ
    in what they read and where they write."""
    return f"{dim_bucket(dim)}-{'dedup' if dedup else 'plain'}"


def bucket(shape: Shape) -> str:
    return bucket_of(shape.params["dim"], bool(shape.params.get("dedup")))


# --- shapes ----------------------------------------------------------------------------------


_s = Shape.of


# Break kernels: empty sequences (first, last, all of them, none at all), length 1, one
# sequence 100x the median, lengths on no block's multiple, widths that are no power of two or
# wider than a column tile, ids repeated within and across requests (runs longer than a tile,
# a table of one row), ids at the table's last row, int32 indices, each kind of bucket add and
# none, with and without dedup.
_CHECKED = (
    ("edges", dict(num_rows=500, dim=48, lengths=[0, 1, 17, 0, 33, 5, 0], dedup=True, buckets=16)),
    ("one-long", dict(num_rows=3000, dim=64, lengths=[5, 3, 500, 0, 7, 4], buckets=64, positional=True)),
    ("zipf", dict(num_rows=5000, dim=64, num_seqs=13, dist="power", max_len=200, ids="zipf", dedup=True,
                  buckets=32, positional=True)),
    ("repeats", dict(num_rows=200, dim=32, lengths=[40, 29, 61, 150], ids="few", dedup=True)),
    ("repeats-plain", dict(num_rows=200, dim=32, lengths=[40, 29, 61, 150], ids="few", buckets=5)),
    ("last-row-int32", dict(num_rows=97, dim=100, num_seqs=9, dist="power", max_len=60, last_row=True,
                            dedup=True, buckets=7, int32=True)),
    ("int32-positional", dict(num_rows=400, dim=64, lengths=[37, 0, 90, 1], buckets=8, positional=True,
                              int32=True)),
    ("one-row", dict(num_rows=1, dim=16, lengths=[3, 0, 70], dedup=True, buckets=5, positional=True)),
    ("single", dict(num_rows=50, dim=128, lengths=[1])),
    ("wide", dict(num_rows=40, dim=300, lengths=[13, 2, 29], buckets=4)),
    ("no-events", dict(num_rows=10, dim=8, lengths=[0, 0, 0], dedup=True, buckets=3)),
    ("no-sequences", dict(num_rows=10, dim=8, lengths=[], buckets=3, positional=True)),
)  # fmt: skip
# fp16 has a tolerance of its own: the adds that round, both index dtypes, dedup and not.
_FP16 = ("edges", "one-long", "zipf", "last-row-int32")
CHECK_SHAPES = tuple(
    _s(name, dtype, **params) for dtype in ("fp32", "bf16") for name, params in _CHECKED
) + tuple(_s(name, "fp16", **params) for name, params in _CHECKED if name in _FP16)


def _batch(name: str, dtype: str, num_rows: int, dim: int, num_seqs: int, max_len: int, **extra) -> Shape:
    """A batch of power-law histories at the distribution's quantiles, popular items."""
    return _s(
        name, dtype, num_rows=num_rows, dim=dim, num_seqs=num_seqs, dist="power", max_len=max_len,
        quantiles=True, ids="zipf", **extra,
    )  # fmt: skip


# Training batches of 256 and 512 histories (median 512 events, max 4096) and a serving batch of
# 15 requests with histories of up to 16384 events, over tables of 256 to 512 MB.
TIMING_SHAPES = (
    _batch("train-b512-d128-1m-dedup", "bf16", TABLE_ROWS_TIMING[0], EMBEDDING_DIMS[1], HSTU_BATCH[1],
           HSTU_MAX_LEN[1], dedup=True, buckets=TIME_BUCKETS, ages=True),
    _batch("train-b512-d128-1m", "fp32", TABLE_ROWS_TIMING[0], EMBEDDING_DIMS[1], HSTU_BATCH[1],
           HSTU_MAX_LEN[1], buckets=TIME_BUCKETS, ages=True),
    _batch("train-b256-d64-4m-dedup", "bf16", TABLE_ROWS_TIMING[1], EMBEDDING_DIMS[0], HSTU_BATCH[0],
           HSTU_MAX_LEN[1], dedup=True, buckets=POSITION_BUCKETS, positional=True),
    _batch("serve-r15-d64-4m", "bf16", TABLE_ROWS_TIMING[1], EMBEDDING_DIMS[0], SERVING_REQUESTS,
           SERVING_LONG_HISTORY, buckets=TIME_BUCKETS, ages=True),
)  # fmt: skip
# Interpreted Triton on a CPU: timings only show that the timing path works.
INTERPRETED_TIMING_SHAPES = (
    _batch("interp-b8-d32", "fp32", 2000, 32, 8, 32, dedup=True, buckets=16, ages=True),
)

# A gather is exact in its dtype. The bucket add rounds once, from an fp32 sum that holds both
# addends exactly, to the output's dtype: half a unit in the last place on a GPU, under a whole
# unit where the cast truncates (the Triton interpreter's bf16 cast does), which is at most
# 2^-7 of the element in bf16, 2^-10 in fp16 and 2^-23 in fp32. Every element within that
# fraction of itself keeps its row and the whole output within it, so row_rtol and norm_rtol
# are the same fraction; atol and row_atol (times the output's RMS) are a floor far below it,
# for fp16's subnormals where an add cancels. So a zeroed row fails (its error is its norm), and
# so does an add left out or taken from the wrong bucket (bucket rows are as large as items').
TOLERANCES = {
    "fp32": Tolerance(atol=2**-26, rtol=2**-23, norm_rtol=2**-23, row_rtol=2**-23, row_atol=2**-26),
    "bf16": Tolerance(atol=2**-12, rtol=2**-7, norm_rtol=2**-7, row_rtol=2**-7, row_atol=2**-12),
    "fp16": Tolerance(atol=2**-14, rtol=2**-10, norm_rtol=2**-10, row_rtol=2**-10, row_atol=2**-14),
}

# The knobs of the default kernel (kernels/history_gather.py, whose KNOBS dict they are): None
# keeps the kernel's launch heuristic for that knob at each call's dim and dtype.
KNOBS = (
    Knob("BLOCK_T", (None, 16, 32, 64, 128), default=None, help="events per program: row loads in flight"),
    Knob(
        "BLOCK_D",
        (None, 32, 64, 128, 256),
        default=None,
        help="columns per program; a program covers ceil(D / BLOCK_D) of a row",
    ),
    Knob(
        "EVICT_ROWS",
        ("", "evict_first", "evict_last"),
        default="",
        help="cache policy of the gathered rows: evict_last keeps popular items in L2",
    ),
    Knob("num_warps", (None, 1, 2, 4, 8), default=None, help="warps per program"),
)


def _knob_constraints(knobs: dict) -> str | None:
    """Tile bounds, where the tile is fixed (a knob left to the heuristic takes its value per
    call, within the bounds the heuristic keeps)."""
    if knobs["BLOCK_T"] is None or knobs["BLOCK_D"] is None:
        return None
    tile = knobs["BLOCK_T"] * knobs["BLOCK_D"]
    if tile > 16384:
        return f"BLOCK_T * BLOCK_D = {tile} > 16384 elements: the tile spills registers"
    warps = knobs["num_warps"] or 4
    if tile < 32 * warps:
        return f"BLOCK_T * BLOCK_D = {tile} is smaller than {warps} warps of 32 lanes"
    return None


TEMPLATE = KnobTemplate(
    problem=NAME,
    source_module="kernels.history_gather",
    entry="history_gather",
    knobs=KNOBS,
    constraint=_knob_constraints,
)

# torch functions that gather rows or scatter them: a candidate may not fall back to them.
FORBIDDEN_OPS = (
    "index_select", "embedding", "embedding_bag", "gather", "take", "take_along_dim",
    "index_add", "index_add_", "index_copy", "index_copy_", "index_put", "index_put_",
    "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
    "put", "put_", "masked_scatter", "masked_scatter_", "repeat_interleave", "one_hot",
    "matmul", "mm", "bmm", "einsum", "sparse_coo_tensor", "sparse_csr_tensor",
)  # fmt: skip

PROBLEM = Problem(
    name=NAME,
    op_family="embedding",
    entry=NAME,
    signature=(
        "history_gather(table: Tensor[num_rows, D] (fp32, bf16 or fp16), ids: int32|int64 Tensor[T], "
        "offsets: int32|int64 Tensor[B + 1], *, order: int32|int64 Tensor[T] | None = None (equal ids "
        "listed together), bucket_ids: int32|int64 Tensor[T] | None = None, bucket_table: "
        "Tensor[num_buckets, D] | None = None (without bucket_ids: positional, from each sequence's end)) "
        "-> Tensor[T, D]; table and bucket_table with unit stride along D"
    ),
    description=__doc__,
    check_shapes=CHECK_SHAPES,
    timing_shapes=TIMING_SHAPES,
    interpreted_timing_shapes=INTERPRETED_TIMING_SHAPES,
    tolerances=TOLERANCES,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.index_select": torch_history_gather},
    flops=flops,
    bytes=bytes_moved,
    bucket=bucket,
    template=NAME,
    forbidden_ops=FORBIDDEN_OPS,
    # A copy with a layout: host code that copies or fills the rows is computing the op.
    host_copies_compute=True,
)


# --- the op ------------------------------------------------------------------------------------


def _index_vector(name: str, tensor: torch.Tensor, length: int | None = None) -> None:
    if tensor.dim() != 1 or tensor.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"{name} must be an int32 or int64 vector, got {tensor.dtype} of shape {tuple(tensor.shape)}"
        )
    if length is not None and tensor.shape[0] != length:
        raise ValueError(f"{name} must have one entry per id (T = {length}), got {tensor.shape[0]}")


def _readable(*tensors: torch.Tensor | None) -> bool:
    """Whether the data can be checked without syncing a GPU or breaking a trace: plain CPU
    tensors, outside torch.compile."""
    return not torch.compiler.is_compiling() and all(
        t is None or (type(t) is torch.Tensor and t.device.type == "cpu") for t in tensors
    )


def _in_range(name: str, values: torch.Tensor, bound: int, bound_name: str) -> None:
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= bound):
        low, high = int(values.min()), int(values.max())
        raise ValueError(f"{name} must lie in [0, {bound_name} = {bound}), got values in [{low}, {high}]")


def check_indices(
    ids: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor | None,
    bucket_ids: torch.Tensor | None,
    num_rows: int,
    num_buckets: int,
    device: torch.device,
) -> None:
    """ValueError naming what is wrong with a call's index tensors: their shapes and dtypes, and
    on CPU tensors their values (on a GPU that would sync the host)."""
    _index_vector("ids", ids)
    total = ids.shape[0]
    _index_vector("offsets", offsets)
    if offsets.shape[0] < 1:
        raise ValueError("offsets must have B + 1 >= 1 entries, got none")
    if order is not None:
        _index_vector("order", order, total)
    if bucket_ids is not None:
        if num_buckets == 0:
            raise ValueError("bucket_ids name rows of a bucket table, but the call has none")
        _index_vector("bucket_ids", bucket_ids, total)
    for name, tensor in (("ids", ids), ("offsets", offsets), ("order", order), ("bucket_ids", bucket_ids)):
        if tensor is not None and tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, the rows on {device}")
    if not _readable(ids, offsets, order, bucket_ids):
        return
    starts, ends = offsets[:-1].long(), offsets[1:].long()
    if int(offsets[0]) != 0 or int(offsets[-1]) != total or bool((ends < starts).any()):
        raise ValueError(f"offsets must rise from 0 to T = {total}, got {offsets.tolist()[:8]}...")
    _in_range("ids", ids, num_rows, "num_rows")
    if bucket_ids is not None:
        _in_range("bucket_ids", bucket_ids, num_buckets, "num_buckets")
    if order is not None:
        if not torch.equal(torch.sort(order.long()).values, torch.arange(total)):
            raise ValueError("order must be a permutation of [0, T)")
        grouped = ids[order.long()]
        runs = int((grouped[1:] != grouped[:-1]).sum()) + 1 if total else 0
        if runs != torch.unique(ids).numel():
            raise ValueError("order must list equal ids together, e.g. torch.argsort(ids, stable=True)")


def check_arguments(
    table: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    *,
    order: torch.Tensor | None = None,
    bucket_ids: torch.Tensor | None = None,
    bucket_table: torch.Tensor | None = None,
) -> None:
    if table.dim() != 2 or table.dtype not in TABLE_DTYPES:
        raise ValueError(
            f"table must be an fp32, bf16 or fp16 [num_rows, D] tensor, got {table.dtype} of shape "
            f"{tuple(table.shape)}"
        )
    if table.stride(1) != 1:
        raise ValueError("table must have unit stride along D (call .contiguous())")
    num_buckets = 0
    if bucket_table is not None:
        dim = table.shape[1]
        if bucket_table.dim() != 2 or bucket_table.shape[0] < 1 or bucket_table.shape[1] != dim:
            raise ValueError(
                f"bucket_table must be [num_buckets >= 1, D = {dim}], got {tuple(bucket_table.shape)}"
            )
        if bucket_table.dtype != table.dtype or bucket_table.device != table.device:
            raise ValueError(
                f"bucket_table must be {table.dtype} on {table.device} as table is, got "
                f"{bucket_table.dtype} on {bucket_table.device}"
            )
        if bucket_table.stride(1) != 1:
            raise ValueError("bucket_table must have unit stride along D (call .contiguous())")
        num_buckets = bucket_table.shape[0]
    check_indices(ids, offsets, order, bucket_ids, table.shape[0], num_buckets, table.device)


def _fake(table, ids, offsets, *, order=None, bucket_ids=None, bucket_table=None):
    return table.new_empty((ids.shape[0], table.shape[1]))


def _call_bucket(table, ids, offsets, *, order=None, bucket_ids=None, bucket_table=None) -> str:
    return bucket_of(table.shape[1], order is not None)


def call_cost(table, ids, offsets, *, order=None, bucket_ids=None, bucket_table=None) -> tuple[float, float]:
    """One call's FLOPs and minimum bytes (bytes_moved's count on the call's own tensors; the
    distinct ids are counted, which a profile may sync for)."""
    total, dim, elem = ids.shape[0], table.shape[1], table.element_size()
    moved = (torch.unique(ids).numel() + total) * dim * elem
    moved += sum(t.numel() * t.element_size() for t in (ids, offsets, order, bucket_ids) if t is not None)
    if bucket_table is None:
        return 0.0, float(moved)
    return float(total * dim), float(moved + bucket_table.numel() * elem)


def _save(ctx, inputs: dict, output) -> None:
    ctx.save_for_backward(inputs["ids"], inputs["offsets"], inputs["order"], inputs["bucket_ids"])
    ctx.num_rows = inputs["table"].shape[0]
    ctx.num_buckets = 0 if inputs["bucket_table"] is None else inputs["bucket_table"].shape[0]


def _grads(ctx, grad_out: torch.Tensor) -> dict:
    from kernels.opdef import public  # the gradient's kernels are dispatched too

    ids, offsets, order, bucket_ids = ctx.saved_tensors
    wants_buckets = ctx.num_buckets > 0 and ctx.needs_grad["bucket_table"]
    grads = {}
    if ctx.needs_grad["table"]:
        if order is None:  # sorted on the device: no sync, unlike a dedup by torch.unique
            order = torch.argsort(ids, stable=True)
        grads["table"], grad_buckets = public("history_gather_backward")(
            grad_out,
            ids,
            offsets,
            order,
            ctx.num_rows,
            bucket_ids=bucket_ids if wants_buckets else None,
            num_buckets=ctx.num_buckets if wants_buckets else 0,
        )
        if wants_buckets:
            grads["bucket_table"] = grad_buckets
    elif wants_buckets:
        # A frozen table (a pretrained one, fine-tuned positions): no dense table gradient.
        index = bucket_index(ids.shape[0], offsets, bucket_ids, ctx.num_buckets)
        summed = grad_out.new_zeros((ctx.num_buckets, grad_out.shape[1]), dtype=torch.float32)
        grads["bucket_table"] = summed.index_add_(0, index, grad_out.float()).to(grad_out.dtype)
    return grads


OP = Op(
    name=NAME,
    problem=PROBLEM,
    default="kernels.history_gather:history_gather",
    check=check_arguments,
    fake=_fake,
    bucket=_call_bucket,
    cost=call_cost,
    backward=Backward(save=_save, grads=_grads, uses=("history_gather_backward",)),
    doc="""The item embeddings of user histories, one row per event, with an optional bucket add.

    table [num_rows, D] (fp32, bf16, fp16); ids [T] and offsets [B + 1] (int32/int64, the
    histories' events); order [T] or None: the events with equal ids listed together
    (torch.argsort(ids, stable=True), once per batch), which makes each distinct row read once
    and the table's gradient free of atomics; bucket_table [num_buckets, D] or None, its rows
    named by bucket_ids [T], or without them by each event's distance from its sequence's end
    (clamped to num_buckets - 1) -> [T, D], table[ids[t]] (+ the bucket row, added in fp32).
    Differentiable in table (a dense gradient) and bucket_table. Never syncs the host; the
    index values are checked on CPU tensors only.
    """,
)
