"""What the jagged <-> padded-dense problems share (search_space.jagged_to_padded_dense and
search_space.dense_to_jagged, each the other's gradient): their sequences, shapes and buckets.

A jagged tensor is values [T, D] with offsets [B + 1] (sequence b is values[offsets[b]:
offsets[b + 1]]); its padded-dense form is [B, N, D], row p of sequence b at [b, p], the rest
padding. Timing shapes follow ../shared/WORKLOAD.md: user histories of power-law length (median
max/8, a few empty), batches of 256 to 512 sequences, the model dim of 512 and embedding dims of
64 and 128, and training batches where each history is followed by its 32 candidates.
"""

from __future__ import annotations

import torch

from search_space.problem import Problem, Shape, Tolerance
from search_space.template import Knob, KnobTemplate
from search_space.workload import HSTU_BATCH, HSTU_MAX_LEN, TRAINING_TARGETS, length_at, quantile_lengths

# A copy: a correct kernel is exact, whatever the dtype.
EXACT = {dtype: Tolerance(atol=0.0, rtol=0.0, norm_rtol=0.0) for dtype in ("fp32", "bf16", "fp16")}
# What computes these transforms in torch (its port of FBGEMM's jagged kernels, and the padding
# and nested-tensor paths to them): a candidate may not call them.
FORBIDDEN = (
    "_jagged_to_padded_dense_forward",
    "_padded_dense_to_jagged_forward",
    "to_padded_tensor",
    "pad_sequence",
    "nested_tensor",
    "as_nested_tensor",
    "nested",
    "index_put",
    "index_put_",
    "masked_scatter",
    "masked_scatter_",
    "masked_select",
)


def copy_problem(name: str, **fields) -> Problem:
    """A jagged transform's problem: an exact copy (no FLOPs, zero tolerance), searched by its
    default kernel's knobs (tile_template), never by falling back to torch's own transforms,
    and never by host code copying or filling the data (host_copies_compute)."""
    return Problem(
        name=name,
        op_family="jagged",
        entry=name,
        tolerances=EXACT,
        flops=lambda shape: 0.0,
        template=name,
        forbidden_ops=FORBIDDEN,
        host_copies_compute=True,
        **fields,
    )


# The most elements a tile may hold, and the tile a GPU launch takes for knobs left None (the
# kernels' _tile), which the constraint counts them as.
MAX_TILE = 16384
GPU_ROWS, GPU_BLOCK_D = 32, 128


def tile_template(name: str, rows: str, rows_help: str) -> KnobTemplate:
    """The knobs of a jagged transform's default kernel (kernels/<name>.py, its own template):
    a tile of `rows` x BLOCK_D columns per program, and its warps; None, the default, takes the
    kernel's launch tile (its _tile: 32 x 128 on 4 warps on a GPU)."""

    def constraint(knobs: dict) -> str | None:
        tile_rows, block_d = knobs[rows] or GPU_ROWS, knobs["BLOCK_D"] or GPU_BLOCK_D
        if tile_rows * block_d > MAX_TILE:
            return f"a tile of more than {MAX_TILE} elements: {rows} {tile_rows} x BLOCK_D {block_d}"
        return None

    return KnobTemplate(
        problem=name,
        source_module=f"kernels.{name}",
        entry=name,
        knobs=(
            Knob(rows, (None, 8, 16, 32, 64, 128), default=None, help=rows_help),
            Knob("BLOCK_D", (None, 32, 64, 128, 256), default=None, help="columns per program"),
            Knob("num_warps", (None, 1, 2, 4, 8), default=None),
        ),
        constraint=constraint,
    )


def lengths_of(shape: Shape, seed: int) -> list[int]:
    """The shape's sequence lengths: given, or drawn from its distribution (timing shapes: the
    fixed quantiles, shuffled by the seed), each plus `targets` candidates."""
    p = shape.params
    if "lengths" in p:
        lengths = list(p["lengths"])
    else:
        gen = torch.Generator().manual_seed(seed)
        if p.get("quantiles", False):
            lengths = quantile_lengths(p["num_seqs"], p["dist"], p["max_len"])
            lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=gen).tolist()]
        else:
            draws = torch.rand(p["num_seqs"], generator=gen, dtype=torch.float64).tolist()
            lengths = [length_at(u, p["dist"], p["max_len"]) for u in draws]
    return [n + p.get("targets", 0) for n in lengths]


def random_rows(rows: int, dim: int, dtype: torch.dtype, seed: int, device: torch.device) -> torch.Tensor:
    """Unit-normal rows [rows, dim] drawn on `device` itself: at timing shapes (hundreds of MB) a
    draw on the host and its copy take seconds, and the judge draws fresh inputs for every timed
    call."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(rows, dim, generator=gen, device=device, dtype=dtype)


def offsets_of(lengths: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    offsets = torch.zeros(len(lengths) + 1, dtype=dtype)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=offsets[1:])
    return offsets


def mean_total(shape: Shape) -> float:
    """The expected number of rows T (exact for given lengths and timing quantiles)."""
    p = shape.params
    if "lengths" in p:
        return float(sum(p["lengths"]))
    if p.get("quantiles", False):
        return float(
            sum(quantile_lengths(p["num_seqs"], p["dist"], p["max_len"]))
            + p["num_seqs"] * p.get("targets", 0)
        )
    mean = {"fixed": 1.0, "uniform": 0.95, "power": 0.25}[p["dist"]] * p["max_len"]
    return p["num_seqs"] * (mean + p.get("targets", 0))


def num_seqs(shape: Shape) -> int:
    return len(shape.params["lengths"]) if "lengths" in shape.params else shape.params["num_seqs"]


def padded_len(shape: Shape) -> int:
    """N, the padded form's length: the shape's `padded_len`, else its longest possible sequence."""
    p = shape.params
    if "padded_len" in p:
        return p["padded_len"]
    if "lengths" in p:
        return max(p["lengths"], default=0)
    return p["max_len"] + p.get("targets", 0)


def kept_rows(shape: Shape) -> float:
    """Rows that land in the padded form (a sequence's rows past N are not)."""
    p = shape.params
    n = padded_len(shape)
    if "lengths" in p:
        return float(sum(min(length, n) for length in p["lengths"]))
    return min(mean_total(shape), num_seqs(shape) * n)


def bucket_of(dim: int, num_seqs: int, padded_len: int, total: int) -> str:
    """Regimes that want different kernels: the row width (narrow rows want many rows per
    program) and how full the padded form is (mostly padding: its writes dominate)."""
    width = "d<=64" if dim <= 64 else "d<=256" if dim <= 256 else "d>256"
    cells = max(1, num_seqs * padded_len)
    return f"{width}-{'dense' if total >= cells / 2 else 'sparse'}"


def shape_bucket(shape: Shape) -> str:
    return bucket_of(shape.params["dim"], num_seqs(shape), padded_len(shape), round(mean_total(shape)))


_s = Shape.of


# Break kernels: empty sequences (first and last), one row, lengths on no block's multiple, a
# sequence 100x the median, truncation (sequences longer than N), widths that are no power of
# two, a single sequence, a batch with no rows, no padded positions at all, and padding values
# that are not zero: one that bf16 must round (0.1), and -inf.
CHECK_SHAPES = tuple(
    _s(name, dtype, **params)
    for dtype in ("fp32", "bf16")
    for name, params in (
        ("edges", {"dim": 48, "lengths": [0, 1, 17, 0, 33, 5, 0], "padding_value": -1.5}),
        ("one-long", {"dim": 16, "lengths": [3, 300, 2, 3, 1], "padded_len": 64}),
        ("truncated", {"dim": 100, "num_seqs": 11, "dist": "power", "max_len": 90, "padded_len": 40,
                       "padding_value": 0.1}),
        ("single", {"dim": 4, "lengths": [37], "padding_value": float("-inf")}),
        ("wide", {"dim": 520, "num_seqs": 5, "dist": "uniform", "max_len": 12, "padding_value": 2.0}),
        ("no-rows", {"dim": 8, "lengths": [0, 0, 0]}),
        ("no-positions", {"dim": 8, "lengths": [3, 0, 2], "padded_len": 0}),
    )
)  # fmt: skip


def _batch(name: str, dtype: str, dim: int, num_seqs: int, dist: str, max_len: int, **extra) -> Shape:
    """A timing batch: its lengths are the distribution's quantiles (the same multiset each call)."""
    return _s(name, dtype, dim=dim, num_seqs=num_seqs, dist=dist, max_len=max_len, quantiles=True, **extra)


TIMING_SHAPES = (
    _batch("hist-b512-d128", "bf16", 128, HSTU_BATCH[1], "power", HSTU_MAX_LEN[1]),
    _batch("hist-b256-d512", "bf16", 512, HSTU_BATCH[0], "power", HSTU_MAX_LEN[0]),
    _batch("train-b512-d64", "fp32", 64, HSTU_BATCH[1], "power", HSTU_MAX_LEN[0], targets=TRAINING_TARGETS),
    _batch("full-b256-d128", "fp32", 128, HSTU_BATCH[0], "uniform", HSTU_MAX_LEN[0]),
)
INTERPRETED_TIMING_SHAPES = (
    _s("interp-b8-d32", "fp32", dim=32, num_seqs=8, dist="power", max_len=32, quantiles=True),
)


def check_offsets(offsets: torch.Tensor, num_seqs: int | None, device: torch.device) -> None:
    """ValueError naming what is wrong with a jagged tensor's offsets (shapes only: no sync)."""
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"offsets must be an int32 or int64 [B + 1] tensor, got {offsets.dtype} {tuple(offsets.shape)}"
        )
    if num_seqs is not None and offsets.numel() != num_seqs + 1:
        raise ValueError(f"offsets must have B + 1 = {num_seqs + 1} entries, got {offsets.numel()}")
    if offsets.device != device:
        raise ValueError(f"offsets are on {offsets.device}, the data on {device}")


# --- per-sample concat and split of two jagged tensors (history, then candidates) ------------
#
# Shapes name the first part's lengths as above and the second's as `second` (a list), or
# `second_max` (uniform draws in [0, second_max]), or `targets` of each (a training batch).


def second_lengths(shape: Shape, seed: int) -> list[int]:
    p = shape.params
    if "second" in p:
        return list(p["second"])
    count = num_seqs(shape)
    if "second_max" in p:
        gen = torch.Generator().manual_seed(seed + 7)
        return torch.randint(0, p["second_max"] + 1, (count,), generator=gen).tolist()
    return [p["targets"]] * count


def first_lengths(shape: Shape, seed: int) -> list[int]:
    return lengths_of(Shape(name=shape.name, dtype=shape.dtype, params={**shape.params, "targets": 0}), seed)


def concat_rows(shape: Shape) -> float:
    """Rows of both parts together (expected)."""
    p = shape.params
    second = (
        sum(p["second"])
        if "second" in p
        else num_seqs(shape) * (p["second_max"] / 2 if "second_max" in p else p["targets"])
    )
    return mean_total(Shape(name=shape.name, dtype=shape.dtype, params={**p, "targets": 0})) + second


def concat_bucket_of(dim: int, num_seqs: int, total: int) -> str:
    """Row width, and short or long sequences (rows per sequence: a program's rows span
    sequences when they are short)."""
    width = "d<=64" if dim <= 64 else "d<=256" if dim <= 256 else "d>256"
    return f"{width}-{'short' if total < 64 * max(1, num_seqs) else 'long'}"


def concat_shape_bucket(shape: Shape) -> str:
    return concat_bucket_of(shape.params["dim"], num_seqs(shape), round(concat_rows(shape)))


# Besides the edges above: a part empty in every sequence (either part), and second parts whose
# lengths differ though their total is a multiple of B (a kernel that assumed them equal).
CONCAT_CHECK_SHAPES = tuple(
    _s(name, dtype, **params)
    for dtype in ("fp32", "bf16")
    for name, params in (
        ("edges", {"dim": 48, "lengths": [0, 1, 17, 0, 33, 5, 0], "second": [2, 0, 0, 5, 1, 0, 3]}),
        ("one-long", {"dim": 16, "lengths": [3, 300, 2, 3, 1], "second": [4, 4, 4, 4, 4]}),
        ("drawn", {"dim": 100, "num_seqs": 11, "dist": "power", "max_len": 90, "second_max": 9}),
        ("single", {"dim": 4, "lengths": [37], "second": [70]}),
        ("wide", {"dim": 520, "num_seqs": 5, "dist": "uniform", "max_len": 12, "targets": 3}),
        ("no-first", {"dim": 24, "lengths": [0, 0, 0, 0], "second": [10, 30, 0, 20]}),
        ("no-second", {"dim": 24, "lengths": [9, 0, 14], "second": [0, 0, 0]}),
        ("uneven-second", {"dim": 32, "lengths": [5, 7, 2, 6], "second": [12, 20, 8, 16]}),
    )
)
# Training batches (32 candidates per history), and a serving-like batch whose sequences have
# from 0 to 64 candidates each, drawn per call.
CONCAT_TIMING_SHAPES = (
    _batch("train-b512-d128", "bf16", 128, HSTU_BATCH[1], "power", HSTU_MAX_LEN[1], targets=TRAINING_TARGETS),
    _batch("train-b256-d512", "bf16", 512, HSTU_BATCH[0], "power", HSTU_MAX_LEN[0], targets=TRAINING_TARGETS),
    _batch("train-b512-d64", "fp32", 64, HSTU_BATCH[1], "power", HSTU_MAX_LEN[0], targets=TRAINING_TARGETS),
    _batch("mixed-b512-d128", "bf16", 128, HSTU_BATCH[1], "power", HSTU_MAX_LEN[0], second_max=64),
)
CONCAT_INTERPRETED_TIMING_SHAPES = (
    _s("interp-b8-d32", "fp32", dim=32, num_seqs=8, dist="power", max_len=32, quantiles=True, second_max=8),
)
