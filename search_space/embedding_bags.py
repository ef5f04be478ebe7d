"""Table-batched pooled embedding lookup: every sparse feature of a batch in one call.

F features look up tables of different row counts and dims, all in one flat buffer (the layout
of search_space.packed_tables). For sample b and feature f, with W_f feature f's table,

    out[b, dim_offsets[f] : dim_offsets[f + 1]] =
        reduce_{i in [offsets[f * B + b], offsets[f * B + b + 1])} psw[i] * W_f[indices[i], :]

with reduce = sum or mean (mean of an empty bag is 0; per-sample weights only with sum, as
torch.nn.functional.embedding_bag). The output [B, total_dim] holds each sample's pooled
vectors in feature order. Accumulated in fp32, rounded once to the tables' dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from search_space import embedding_bag as single
from search_space.op import Backward, Op
from search_space.packed_tables import Layout, draw_bags, feature_table, mean_bag_length, metadata_lists
from search_space.problem import Inputs, Problem, Shape, Tolerance
from search_space.template import Knob, KnobTemplate

NAME = ENTRY = "embedding_bags"
INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}


def num_samples(num_features: int, offsets: torch.Tensor) -> int:
    """B, from offsets [F * B + 1]."""
    return (offsets.shape[0] - 1) // num_features


def feature_bounds(offsets: torch.Tensor, num_features: int) -> list[int]:
    """Where each feature's ids start in `indices`, and the end ([F + 1], on the host: a sync
    where offsets lie on a GPU)."""
    batch = num_samples(num_features, offsets)
    if batch == 0:
        return [0] * (num_features + 1)
    return offsets[::batch].tolist()


def per_feature(
    weight_offsets: torch.Tensor,
    dim_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
) -> Iterator[tuple[int, slice, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Each feature's single-table lookup: (where its table starts in weights, its output
    columns, its ids, its bags' offsets from 0, its per-sample weights). Reads the metadata and
    the features' bounds back to the host (a sync where they lie on a GPU)."""
    num_features = weight_offsets.shape[0]
    batch = num_samples(num_features, offsets)
    starts, _, cols = metadata_lists(weight_offsets, None, dim_offsets)
    bounds = feature_bounds(offsets, num_features)
    for f in range(num_features):
        lo, hi = bounds[f : f + 2]
        psw = None if per_sample_weights is None else per_sample_weights[lo:hi]
        bag_offsets = offsets[f * batch : (f + 1) * batch + 1] - lo
        yield starts[f], slice(cols[f], cols[f + 1]), indices[lo:hi], bag_offsets, psw


def reference(
    weights: torch.Tensor,
    weight_offsets: torch.Tensor,
    dim_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    *,
    total_dim: int,
    max_dim: int,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch: the single-table reference on each feature's table (a view of weights),
    concatenated; fp32 accumulation (fp64 for fp64), each element rounded once."""
    pooled = []
    features = per_feature(weight_offsets, dim_offsets, indices, offsets, per_sample_weights)
    for start, cols, ids, bag_offsets, psw in features:
        table = feature_table(weights, start, cols.stop - cols.start)
        pooled.append(single.reference(table, ids, bag_offsets, mode=mode, per_sample_weights=psw))
    return torch.cat(pooled, dim=1)


def torch_embedding_bag_per_feature(
    weights,
    weight_offsets,
    dim_offsets,
    indices,
    offsets,
    *,
    total_dim,
    max_dim,
    mode="sum",
    per_sample_weights=None,
):
    """What eager code writes without a batched kernel: one torch.nn.functional.embedding_bag per
    feature, concatenated (reading the F-entry metadata back, which such code holds on the host)."""
    pooled = []
    features = per_feature(weight_offsets, dim_offsets, indices, offsets, per_sample_weights)
    for start, cols, ids, bag_offsets, psw in features:
        table = feature_table(weights, start, cols.stop - cols.start)
        pooled.append(F.embedding_bag(ids, table, bag_offsets[:-1], mode=mode, per_sample_weights=psw))
    return torch.cat(pooled, dim=1)


# --- inputs -----------------------------------------------------------------------------------
#
# Shape params: tables [[rows, dim], ...]; features [table of each feature] (default: one per
# table); batch (B); max_lens [per feature] (power-law lengths, 0: empty bags) or lengths (F * B,
# feature-major); optional weighted, mode, hot_rows (every id among its table's last rows),
# index_dtype ("int32" or "int64", the default) of ids and offsets.


def layout_of(shape: Shape) -> Layout:
    p = shape.params
    return Layout.of(p["tables"], p.get("features", range(len(p["tables"]))))


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    p, layout = shape.params, layout_of(shape)
    # Generated on the target device, in the tables' dtype: the timing shapes' tables hold up to
    # 825e6 elements (seconds of CPU time, and twice the memory if drawn in fp32 first).
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = torch.randn(layout.num_elements, generator=gen, device=device, dtype=shape.torch_dtype)
    bags = draw_bags(
        layout,
        p["batch"],
        gen,
        device,
        max_lens=p.get("max_lens"),
        lengths=p.get("lengths"),
        hot_rows=p.get("hot_rows", 0),
        weighted=p.get("weighted", False),
        index_dtype=INDEX_DTYPES[p.get("index_dtype", "int64")],
        weight_dtype=shape.torch_dtype,
    )
    weight_offsets, _, dim_offsets = layout.metadata(device)
    kwargs = {
        "total_dim": layout.total_dim,
        "max_dim": layout.max_dim,
        "mode": p.get("mode", "sum"),
        "per_sample_weights": bags.per_sample_weights,
    }
    return Inputs(args=(weights, weight_offsets, dim_offsets, bags.indices, bags.offsets), kwargs=kwargs)


def feature_ids(shape: Shape) -> list[float]:
    """Ids per feature over the batch: exact for given lengths, expected for power-law ones."""
    p = shape.params
    num_features, batch = layout_of(shape).num_features, p["batch"]
    if "lengths" in p:
        return [float(sum(p["lengths"][f * batch : (f + 1) * batch])) for f in range(num_features)]
    return [batch * mean_bag_length(m) for m in p["max_lens"]]


def flops(shape: Shape) -> float:
    """One add per gathered element (plus one multiply when weighted)."""
    gathered = sum(n * d for n, d in zip(feature_ids(shape), layout_of(shape).dims(), strict=True))
    return gathered * (2 if shape.params.get("weighted") else 1)


def bytes_moved(shape: Shape) -> float:
    """Minimum traffic: every gathered row read once per occurrence, ids and offsets, per-sample
    weights, the per-feature metadata, the output written once."""
    layout, elem = layout_of(shape), shape.torch_dtype.itemsize
    index = INDEX_DTYPES[shape.params.get("index_dtype", "int64")].itemsize
    ids, batch = feature_ids(shape), shape.params["batch"]
    nnz = sum(ids)
    moved = sum(n * d for n, d in zip(ids, layout.dims(), strict=True)) * elem
    moved += nnz * index + (layout.num_features * batch + 1) * index + (2 * layout.num_features + 1) * 8
    if shape.params.get("weighted"):
        moved += nnz * elem
    return moved + batch * layout.total_dim * elem


# Most features hold one to three ids per sample (1.65 on average at most), a few pool up to 120
# (about 19 on average): over all of a call's bags, a batch of short features alone stays under
# this mean, and a few pooled features among them lift it over. A short batch is row copies,
# bound by latency; a pooled one streams ids of its long bags too.
SHORT_MEAN_IDS = 2.0


def bucket_of(max_dim: int, mean_ids_per_bag: float) -> str:
    """The shape bucket of a call (one function for problem, dispatch and report): the largest
    dim rounded up to a power of two, then the regime, e.g. "d256-short" or "d128-pooled"."""
    regime = "short" if mean_ids_per_bag <= SHORT_MEAN_IDS else "pooled"
    return f"{single.dim_bucket(max_dim)}-{regime}"


def bucket(shape: Shape) -> str:
    num_bags = layout_of(shape).num_features * shape.params["batch"]
    return bucket_of(layout_of(shape).max_dim, sum(feature_ids(shape)) / max(num_bags, 1))


def call_bucket(max_dim: int, indices: torch.Tensor, offsets: torch.Tensor) -> str:
    """bucket_of for a call, from its max_dim and tensor sizes alone (no device sync)."""
    return bucket_of(max_dim, indices.shape[0] / max(offsets.shape[0] - 1, 1))


# --- shapes -----------------------------------------------------------------------------------


_s = Shape.of


# Every dim the workload has, and some that are no power of two, in one call.
MIXED_DIM_TABLES = [[97, 4], [300, 16], [150, 48], [64, 100], [120, 128], [33, 200], [50, 256]]


# (name, params) of the check shapes, each in every dtype. The first has given lengths: its
# bucket is the same for every seed (a dispatch benchmark times it).
CHECKS = (
    ("empty-bags-mean", dict(tables=[[40, 16], [30, 100]], batch=4, lengths=[3, 0, 1, 0, 0, 5, 0, 2],
                             mode="mean")),
    ("mixed-dims", dict(tables=MIXED_DIM_TABLES, batch=5, max_lens=[3, 1, 9, 2, 20, 3, 5],
                        index_dtype="int32")),
    ("all-empty", dict(tables=[[10, 16], [10, 48]], batch=3, lengths=[0] * 6)),
    ("no-samples", dict(tables=[[10, 16], [10, 48]], batch=0, lengths=[])),
    ("one-row-table", dict(tables=[[1, 48], [20, 16]], batch=6, max_lens=[4, 2])),
    # Ids only among each table's last two rows: the same rows in many bags, the last row read.
    ("hot-rows", dict(tables=[[500, 64], [80, 128], [9, 4]], batch=24, max_lens=[6, 3, 2], hot_rows=2)),
    # Every id of the call in one bag.
    ("one-bag-holds-all", dict(tables=[[200, 32], [60, 128]], batch=4, lengths=[0, 0, 37, 0, 0, 0, 0, 0])),
    # Features 0 and 2 share table 0, features 1 and 4 table 1.
    ("shared-weighted", dict(tables=[[70, 64], [40, 16], [90, 200]], features=[0, 1, 0, 2, 1], batch=6,
                             max_lens=[5, 1, 12, 3, 2], weighted=True, index_dtype="int32")),
    # Dims of no multiple of 4 (rows and columns an element at a time) among 8-byte ones.
    ("odd-dims", dict(tables=[[40, 6], [30, 4], [50, 3], [20, 16]], batch=5, max_lens=[3, 2, 4, 1])),
    # A feature of 4 columns first: in 2-byte dtypes the later features' output columns, and odd
    # samples' rows, start 8 bytes off 16; their tables' rows do not.
    ("dim-4-first", dict(tables=[[30, 4], [40, 16], [50, 32]], batch=5, max_lens=[2, 3, 1])),
)  # fmt: skip


CHECK_SHAPES = (
    # fp16 has a tolerance, so it is part of the domain a kernel is checked on.
    *(_s(name, dtype, **params) for dtype in ("fp32", "bf16", "fp16") for name, params in CHECKS),
    # A bag longer than a cap of 1024 ids a kernel might keep (in fp32 only: it checks a length,
    # not a dtype).
    _s("bag-1100", "fp32", tables=[[3000, 32], [20, 16]], batch=3, lengths=[1100, 3, 0, 1, 0, 2]),
)

# The timing shapes' tables (rows, dim): a few of millions of rows, a tail of small ones, dims
# mixed (mostly 64 and 128): 825e6 elements, 1.6 GB in bf16 (fp32 shapes halve the rows). The
# sandbox keeps several input sets on the GPU, so the tables stay at a few GB, not a model's
# hundreds.
TIMING_TABLES = (
    (4_000_000, 64), (2_000_000, 128), (1_000_000, 128), (1_000_000, 32), (500_000, 256),
    (200_000, 64), (100_000, 16), (50_000, 128), (20_000, 32), (10_000, 256), (10_000, 64),
    (10_000, 16),
)  # fmt: skip
# Short features' max_len in turn: half of them hold exactly one id per sample.
SHORT_MAX_LENS = (1, 1, 2, 3)


def _timing(name: str, dtype: str, *, batch: int, num_features: int, pooled: tuple[int, ...] = (), **params):
    """Feature f looks up table f mod 12; the first features pool bags of up to `pooled[f]`
    ids (on the largest tables), the others are short."""
    scale = 2 if dtype == "fp32" else 1
    short = [SHORT_MAX_LENS[f % len(SHORT_MAX_LENS)] for f in range(len(pooled), num_features)]
    return _s(
        name,
        dtype,
        tables=[[rows // scale, dim] for rows, dim in TIMING_TABLES],
        features=[f % len(TIMING_TABLES) for f in range(num_features)],
        batch=batch,
        max_lens=[*pooled, *short],
        **params,
    )


def with_narrow_feature(shape: Shape, name: str) -> Shape:
    """`shape` with one more short feature (one to three ids) of 4 columns, on a table of its own
    of 10,000 rows. WORKLOAD.md's dims start at 4: in bf16 and fp16 such a row is 8 bytes, and it
    puts every later feature's columns, and the rows of odd samples, off 16-byte boundaries."""
    p = dict(shape.params)
    p["tables"] = [*p["tables"], [10_000, 4]]
    p["features"] = [*p["features"], len(p["tables"]) - 1]
    p["max_lens"] = [*p["max_lens"], 3]
    return _s(name, shape.dtype, **p)


TIMING_SHAPES = (
    _timing("b64k-f26-short", "bf16", batch=65_536, num_features=26),
    with_narrow_feature(
        _timing("b64k-f26-short", "bf16", batch=65_536, num_features=26), "b64k-f27-short-d4"
    ),
    _timing("b256k-f20-short", "bf16", batch=262_144, num_features=20),
    _timing("b128k-f32-mixed", "bf16", batch=131_072, num_features=32, pooled=(120, 80, 40, 20)),
    _timing(
        "b256k-f20-mixed-weighted", "bf16", batch=262_144, num_features=20, pooled=(120, 60), weighted=True
    ),
    _timing("b128k-f20-short", "fp32", batch=131_072, num_features=20, index_dtype="int32"),
    _timing("b64k-f40-mixed", "fp32", batch=65_536, num_features=40, pooled=(120, 120, 80, 40, 20, 10)),
)

# Interpreted Triton on a CPU: timings there only show that the timing path works.
INTERPRETED_TIMING_SHAPES = (
    _s("interp-b32-f4", "fp32", tables=[[2000, 64], [500, 16], [300, 128]], features=[0, 1, 2, 0], batch=32,
       max_lens=[3, 1, 24, 2]),
)  # fmt: skip

# Element and norm bounds, then per row of the output: one sample's pooled vectors of every
# feature. A correct kernel accumulates in fp32 and rounds each output element once: off by at
# most half a unit in its last place, 2^-9 of itself in bf16 and 2^-11 in fp16 (fp32 sums of up
# to ~1000 rows add about 1e-6), so a row's error norm is at most that fraction of the row's own
# norm. The row bound allows four times that (row_rtol: 2^-7 bf16, 2^-9 fp16) plus a floor far
# below it (row_atol, times the output's RMS and the root of the row's width) for rows that
# cancel to nearly zero. One feature's bag zeroed in a sample fails: even a dim-4 bag beside
# features of 256 columns is a few percent of its row's norm. So does an output rounded to a grid
# as coarse as the element tolerance, though each element lies inside its own bound
# (search_space.embedding_bag derives the same figures for one table).
TOLERANCES = {
    "fp32": Tolerance(atol=1e-5, rtol=1e-5, norm_rtol=1e-5, row_rtol=1e-5, row_atol=1e-7),
    "bf16": Tolerance(atol=1.6e-2, rtol=1.6e-2, norm_rtol=8e-3, row_rtol=2**-7, row_atol=2**-12),
    "fp16": Tolerance(atol=2e-3, rtol=2e-3, norm_rtol=1e-3, row_rtol=2**-9, row_atol=2**-14),
}


# FLAT's product holds a [BLOCK_B, CHUNK] and a [CHUNK, BLOCK_D] operand in fp32 (CHUNK =
# BLOCK_B x BLOCK_L ids), at most this many elements each (32 KB of shared memory); a size left
# to the heuristic counts at the largest it launches (64 bags, 2 ids, 64 columns).
FLAT_OPERAND_LIMIT = 8192


def _knob_constraints(knobs: dict) -> str | None:
    """The single-table kernel's tile bounds; with FLAT, the tensor-core product's: 16 bags or
    more, operands within FLAT_OPERAND_LIMIT, and neither ACC_3D nor pipelining (the step loop's
    alone: with FLAT they would only repeat a point of the search), and no BAGS_MAJOR with
    SLICES_TOGETHER (which orders the blocks itself)."""
    if knobs.get("SLICES_TOGETHER") and knobs.get("BAGS_MAJOR") is not None:
        return "SLICES_TOGETHER orders the blocks itself: BAGS_MAJOR takes None with it"
    if knobs.get("FLAT"):
        bags, ids, cols = knobs["BLOCK_B"] or 64, knobs["BLOCK_L"] or 2, knobs["BLOCK_D"] or 64
        if bags < 16:
            return f"FLAT takes BLOCK_B >= 16 (the tensor-core product's rows), not {bags}"
        if max(bags * bags * ids, bags * ids * cols) > FLAT_OPERAND_LIMIT:
            return (
                f"FLAT's operands [{bags}, {bags * ids}] and [{bags * ids}, {cols}] exceed "
                f"{FLAT_OPERAND_LIMIT} elements"
            )
        if knobs["ACC_3D"] or knobs["num_stages"] != 1:
            return "FLAT takes neither ACC_3D nor num_stages > 1 (the step loop's)"
        if knobs["BLOCK_L"] is None and cols < 32:
            # Short batches take one id a step, where a 2-byte block of 8-byte rows takes half
            # its columns (kernels/embedding_bags.py, _pool_block): fewer than the product's 16.
            return f"FLAT takes BLOCK_D >= 32 unless BLOCK_L is set, not {cols}"
    return single.TEMPLATE.constraint(knobs)


# Each program runs the single-table kernel's loop on one feature's bags: the same knobs, with
# the same tile bounds (kernels/embedding_bags.py, whose KNOBS dict they are), and the launch's
# own: a persistent grid (132 SMs on an H100 or H200 times 8, 16 or 32 programs).
TEMPLATE = KnobTemplate(
    problem=NAME,
    source_module="kernels.embedding_bags",
    entry="embedding_bags_forward",
    knobs=(
        *single.KNOBS,
        Knob(
            "PROGRAMS",
            (None, 132 * 8, 132 * 16, 132 * 32, 2**31 - 1),
            default=None,
            help="programs in a persistent grid, each looping over blocks, capped at one a block "
            "(2**31 - 1: a program a block; None: the launch heuristic's)",
        ),
        Knob(
            "FLAT",
            (None, False, True),
            default=None,
            help="a block's ids in chunks of BLOCK_B x BLOCK_L whatever their bags (no lane waits on a "
            "long bag), summed into bags by a tensor-core product",
        ),
        Knob(
            "SLICES_TOGETHER",
            (None, False, True),
            default=None,
            help="the column slices of a block's rows read by neighbouring programs, at about the "
            "same time (else num_bag_blocks programs apart)",
        ),
        Knob(
            "BAGS_MAJOR",
            (None, False, True),
            default=None,
            help="blocks numbered bag block by bag block, each one's features in turn (else feature "
            "by feature; None: in 16-bit types where the output's rows start off 32-byte sectors); "
            "SLICES_TOGETHER takes precedence",
        ),
        Knob(
            "maxnreg",
            (None, 64, 96, 128, 160, 255),
            default=None,
            help="most registers a thread holds (more programs an SM; the rest spill); 255: no cap in "
            "effect; None: the launch heuristic's (128 for the pooled 16-bit tile under Triton 3.6, "
            "else none)",
        ),
    ),
    constraint=_knob_constraints,
)

PROBLEM = Problem(
    name=NAME,
    op_family="embedding",
    entry=ENTRY,
    signature=(
        "embedding_bags(weights: Tensor[N] (fp32, bf16 or fp16; every table's rows, flat), "
        "weight_offsets: int64 Tensor[F], dim_offsets: int64 Tensor[F + 1], "
        "indices: int32|int64 Tensor[nnz], offsets: int32|int64 Tensor[F * B + 1], *, total_dim: int, "
        "max_dim: int, mode: 'sum' | 'mean' = 'sum', per_sample_weights: Tensor[nnz] | None = None"
        ") -> Tensor[B, total_dim]; every tensor contiguous"
    ),
    description=__doc__,
    check_shapes=CHECK_SHAPES,
    timing_shapes=TIMING_SHAPES,
    interpreted_timing_shapes=INTERPRETED_TIMING_SHAPES,
    tolerances=TOLERANCES,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.embedding_bag_per_feature": torch_embedding_bag_per_feature},
    flops=flops,
    bytes=bytes_moved,
    bucket=bucket,
    template=NAME,
    forbidden_ops=single.PROBLEM.forbidden_ops,
)


# --- the op -----------------------------------------------------------------------------------

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INDICES = (torch.int32, torch.int64)


def check_arguments(
    weights,
    weight_offsets,
    dim_offsets,
    indices,
    offsets,
    *,
    total_dim,
    max_dim,
    mode="sum",
    per_sample_weights=None,
) -> None:
    """ValueError naming what is wrong: shapes, dtypes and sizes always; the metadata, offsets
    and ids themselves only where they lie on the CPU (reading them from a GPU would sync it)."""
    if weights.dim() != 1 or weights.dtype not in FLOATS:
        raise ValueError(
            f"weights must be an fp32, bf16 or fp16 [N] tensor, got {weights.dtype} {tuple(weights.shape)}"
        )
    for name, t in (("weight_offsets", weight_offsets), ("dim_offsets", dim_offsets)):
        if t.dim() != 1 or t.dtype != torch.int64:
            raise ValueError(f"{name} must be an int64 vector, got {t.dtype} {tuple(t.shape)}")
    num_features = weight_offsets.shape[0]
    if num_features < 1:
        raise ValueError("weight_offsets must name at least one feature ([F], F >= 1)")
    if dim_offsets.shape[0] != num_features + 1:
        raise ValueError(
            f"dim_offsets must have F + 1 = {num_features + 1} entries, got {dim_offsets.shape[0]}"
        )
    if (
        indices.dim() != 1
        or offsets.dim() != 1
        or indices.dtype not in INDICES
        or offsets.dtype not in INDICES
    ):
        raise ValueError(
            f"indices must be [nnz] and offsets [F * B + 1], int32 or int64, got {indices.dtype} "
            f"{tuple(indices.shape)} and {offsets.dtype} {tuple(offsets.shape)}"
        )
    if offsets.shape[0] < 1 or (offsets.shape[0] - 1) % num_features:
        raise ValueError(
            f"offsets must have F * B + 1 entries with F = {num_features}, got {offsets.shape[0]}"
        )
    if mode not in ("sum", "mean"):
        raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
    if per_sample_weights is not None:
        if mode != "sum":
            raise ValueError("per_sample_weights is only supported with mode='sum'")
        if per_sample_weights.shape != indices.shape or per_sample_weights.dtype not in FLOATS:
            raise ValueError(
                "per_sample_weights must be a floating-point tensor of indices' shape "
                f"{tuple(indices.shape)}, "
                f"got {per_sample_weights.dtype} {tuple(per_sample_weights.shape)}"
            )
    if total_dim < 1 or max_dim < 1:
        raise ValueError(f"total_dim and max_dim must be positive, got {total_dim} and {max_dim}")
    tensors = [weights, weight_offsets, dim_offsets, indices, offsets]
    tensors += [] if per_sample_weights is None else [per_sample_weights]
    if any(t.device != weights.device for t in tensors):
        raise ValueError(f"every tensor must be on weights' device ({weights.device})")
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("every tensor must be contiguous (call .contiguous())")
    if weights.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_values(weights, weight_offsets, dim_offsets, indices, offsets, total_dim, max_dim)


def _check_values(weights, weight_offsets, dim_offsets, indices, offsets, total_dim, max_dim) -> None:
    """What the arguments' values must be (CPU tensors): a kernel trusts them for its addresses."""
    starts, _, cols = metadata_lists(weight_offsets, None, dim_offsets)
    dims = [b - a for a, b in zip(cols, cols[1:], strict=False)]
    if cols[0] != 0 or min(dims) < 1:
        raise ValueError(f"dim_offsets must start at 0 and increase, got {cols}")
    if cols[-1] != total_dim or max(dims) != max_dim:
        raise ValueError(
            f"total_dim and max_dim must be dim_offsets[F] = {cols[-1]} and the largest dim {max(dims)}, "
            f"got {total_dim} and {max_dim}"
        )
    if min(starts) < 0:
        raise ValueError(f"weight_offsets must not be negative, got {starts}")
    lengths = offsets.diff()
    if int(offsets[0]) != 0 or int(offsets[-1]) != indices.shape[0] or bool((lengths < 0).any()):
        raise ValueError(f"offsets must rise from 0 to nnz = {indices.shape[0]}")
    if indices.numel() == 0:
        return
    per_feature = torch.tensor(feature_bounds(offsets, len(starts))).diff()
    feature = torch.repeat_interleave(torch.arange(len(starts)), per_feature)
    dim = torch.tensor(dims)[feature]
    ends = torch.tensor(starts)[feature] + (indices.long() + 1) * dim
    if bool((indices < 0).any()) or int(ends.max()) > weights.shape[0]:
        raise ValueError(f"ids must be rows of their feature's table, inside weights [{weights.shape[0]}]")


def _fake(
    weights,
    weight_offsets,
    dim_offsets,
    indices,
    offsets,
    *,
    total_dim,
    max_dim,
    mode="sum",
    per_sample_weights=None,
):
    return weights.new_empty((num_samples(weight_offsets.shape[0], offsets), total_dim))


def _call_bucket(
    weights,
    weight_offsets,
    dim_offsets,
    indices,
    offsets,
    *,
    total_dim,
    max_dim,
    mode="sum",
    per_sample_weights=None,
) -> str:
    return call_bucket(max_dim, indices, offsets)


def gathered_elements(dim_offsets: torch.Tensor, offsets: torch.Tensor) -> int:
    """Elements of every gathered row, summed over the call's ids (read from the data: a sync)."""
    num_features = dim_offsets.shape[0] - 1
    per_feature = torch.tensor(feature_bounds(offsets, num_features)).diff()
    return int((per_feature * dim_offsets.cpu().diff()).sum())


def call_cost(
    weights,
    weight_offsets,
    dim_offsets,
    indices,
    offsets,
    *,
    total_dim,
    max_dim,
    mode="sum",
    per_sample_weights=None,
) -> tuple[float, float]:
    """One call's FLOPs and minimum bytes (bytes_moved's count, on the call's own sizes)."""
    gathered, elem = gathered_elements(dim_offsets, offsets), weights.element_size()
    num_features, nnz = weight_offsets.shape[0], indices.shape[0]
    moved = gathered * elem + nnz * indices.element_size() + offsets.shape[0] * offsets.element_size()
    moved += (2 * num_features + 1) * 8 + num_samples(num_features, offsets) * total_dim * elem
    if per_sample_weights is not None:
        moved += nnz * per_sample_weights.element_size()
    return float(gathered * (1 if per_sample_weights is None else 2)), float(moved)


def _save(ctx, inputs: dict, output) -> None:
    kept = ("weights", "weight_offsets", "dim_offsets", "indices", "offsets", "per_sample_weights")
    ctx.save_for_backward(*(inputs[name] for name in kept))
    ctx.options = {name: inputs[name] for name in ("total_dim", "max_dim", "mode")}


def per_sample_weights_grad(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    weight_offsets: torch.Tensor,
    dim_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    max_dim: int,
) -> torch.Tensor:
    """grad_psw[i] = <grad_out[b, cols_f], W_f[indices[i], :]> for id i of bag (f, b), in fp32.
    Without a sync (the ids' bags by repeat_interleave of a known size), over [nnz, max_dim]
    tiles: sized for the dense training path's tables, like the weights' gradient."""
    if indices.shape[0] == 0:
        return grad_out.new_zeros(0, dtype=torch.float32)
    batch = num_samples(weight_offsets.shape[0], offsets)
    bag = torch.repeat_interleave(
        torch.arange(offsets.shape[0] - 1, device=offsets.device),
        offsets.diff(),
        output_size=indices.shape[0],
    )
    feature, sample = bag // batch, bag % batch
    dim = dim_offsets.diff()[feature][:, None]
    cols = torch.arange(max_dim, device=offsets.device)
    inside = cols < dim  # [nnz, max_dim]
    row_at = weight_offsets[feature][:, None] + indices.long()[:, None] * dim + cols
    grad_at = sample[:, None] * grad_out.shape[1] + dim_offsets[feature][:, None] + cols
    rows = weights[row_at.where(inside, 0)].float()  # gathered, then widened: never the whole table
    upstream = grad_out.reshape(-1)[grad_at.where(inside, 0)].float()
    return (rows * upstream * inside).sum(-1)


def _grads(ctx, grad_out: torch.Tensor) -> dict:
    from kernels.opdef import public  # the backward's kernels are dispatched too

    weights, weight_offsets, dim_offsets, indices, offsets, psw = ctx.saved_tensors
    grads = {}
    if ctx.needs_grad["weights"]:
        grads["weights"] = public("embedding_bags_backward")(
            grad_out,
            weight_offsets,
            dim_offsets,
            indices,
            offsets,
            weights.shape[0],
            **ctx.options,
            per_sample_weights=psw,
        )
    if psw is not None and ctx.needs_grad["per_sample_weights"]:
        grad = per_sample_weights_grad(
            grad_out, weights, weight_offsets, dim_offsets, indices, offsets, ctx.options["max_dim"]
        )
        grads["per_sample_weights"] = grad.to(psw.dtype)
    return grads


OP = Op(
    name=NAME,
    problem=PROBLEM,
    default="kernels.embedding_bags:embedding_bags_forward",
    check=check_arguments,
    fake=_fake,
    bucket=_call_bucket,
    bounds=("total_dim", "max_dim"),
    cost=call_cost,
    backward=Backward(save=_save, grads=_grads, uses=("embedding_bags_backward",)),
    doc="""Table-batched pooled embedding lookup: every feature's bags in one call.

    weights [N] (every table's rows, flat; search_space.packed_tables), weight_offsets [F] and
    dim_offsets [F + 1] (int64), indices [nnz] and offsets [F * B + 1] (int32/int64; bag (f, b)
    is indices[offsets[f * B + b]:offsets[f * B + b + 1]], rows of f's table), total_dim
    (= dim_offsets[F]) and max_dim (the largest feature dim) as host ints, so that the call
    never syncs; per_sample_weights [nnz] (mode 'sum' only) -> [B, total_dim], each sample's
    pooled vectors in feature order. Differentiable in weights (a dense gradient: for small
    tables) and per_sample_weights. The metadata, offsets and ids are checked where they lie
    on the CPU only.
    """,
)
