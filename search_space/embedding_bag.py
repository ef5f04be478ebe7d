"""Pooled embedding-bag lookup: the first and most common op of every ads model.

    out[b, :] = reduce_{i in [offsets[b], offsets[b+1])} psw[i] * weight[indices[i], :]

with reduce = sum or mean (mean of an empty bag is 0, like torch.nn.functional.embedding_bag;
per-sample weights only with sum, also like torch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from search_space import workload
from search_space.op import Backward, Op
from search_space.problem import Inputs, Problem, Shape, Tolerance
from search_space.template import Knob, KnobTemplate

ENTRY = "embedding_bag"
INDEX_BYTES = 8  # int64 indices and offsets


def reference(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    *,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch, accumulated in fp32 (fp64 if given fp64), returned in weight's dtype."""
    acc_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    num_bags = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    bag_of_index = torch.repeat_interleave(torch.arange(num_bags, device=weight.device), lengths)
    rows = weight.index_select(0, indices).to(acc_dtype)  # [nnz, D]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.to(acc_dtype)[:, None]
    out = torch.zeros(num_bags, weight.shape[1], dtype=acc_dtype, device=weight.device)
    out.index_add_(0, bag_of_index, rows)
    if mode == "mean":
        out = out / lengths.clamp(min=1).to(acc_dtype)[:, None]
    return out.to(weight.dtype)


def torch_embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    """torch.nn.functional.embedding_bag with our offsets convention (B+1 entries)."""
    return F.embedding_bag(
        indices,
        weight,
        offsets[:-1],
        mode=mode,
        per_sample_weights=per_sample_weights,
        include_last_offset=False,
    )


def bag_lengths(
    num_bags: int, max_len: int, alpha: float, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Truncated power-law lengths in [1, max_len]: P(L) proportional to L^-alpha."""
    probs = torch.arange(1, max_len + 1, dtype=torch.float32, device=device).pow(-alpha)
    return torch.multinomial(probs / probs.sum(), num_bags, replacement=True, generator=generator) + 1


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    """Inputs for one call. Params: num_rows, dim, num_bags, and either `lengths` (explicit
    list) or `max_len` (power law); optional mode, weighted, duplicates."""
    p = shape.params
    # Generated on the target device: a 4e6-row table is a second of CPU time per input set.
    gen = torch.Generator(device=device).manual_seed(seed)
    if "lengths" in p:
        lengths = torch.tensor(p["lengths"], dtype=torch.int64, device=device)
    else:
        lengths = bag_lengths(p["num_bags"], p["max_len"], workload.BAG_LENGTH_ALPHA, gen, device)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    nnz = int(offsets[-1])
    # Few distinct ids make bags repeat rows: a backward must add, not overwrite.
    id_range = min(4, p["num_rows"]) if p.get("duplicates") else p["num_rows"]
    indices = torch.randint(0, id_range, (nnz,), generator=gen, device=device)
    weight = torch.randn(p["num_rows"], p["dim"], generator=gen, device=device).to(shape.torch_dtype)
    kwargs: dict = {"mode": p.get("mode", "sum"), "per_sample_weights": None}
    if p.get("weighted"):
        psw = torch.rand(nnz, generator=gen, device=device)
        kwargs["per_sample_weights"] = psw.to(shape.torch_dtype)
    moved = (weight, indices, offsets)
    return Inputs(args=tuple(moved), kwargs=kwargs)


def _mean_bag_length(shape: Shape) -> float:
    p = shape.params
    if "lengths" in p:
        return sum(p["lengths"]) / max(len(p["lengths"]), 1)
    support = range(1, p["max_len"] + 1)
    norm = sum(n**-workload.BAG_LENGTH_ALPHA for n in support)
    return sum(n ** (1 - workload.BAG_LENGTH_ALPHA) for n in support) / norm


def _num_bags(shape: Shape) -> int:
    p = shape.params
    return len(p["lengths"]) if "lengths" in p else p["num_bags"]


def flops(shape: Shape) -> float:
    """One add per gathered element (plus one multiply when weighted)."""
    nnz = _num_bags(shape) * _mean_bag_length(shape)
    per_elem = 2 if shape.params.get("weighted") else 1
    return nnz * shape.params["dim"] * per_elem


def bytes_moved(shape: Shape) -> float:
    """Minimum traffic: every gathered row read once per occurrence, indices and offsets read,
    per-sample weights read, output written once. Rows are 256 to 512 B, so the gather has no
    sector waste to count."""
    elem = torch.empty((), dtype=shape.torch_dtype).element_size()
    num_bags = _num_bags(shape)
    nnz = num_bags * _mean_bag_length(shape)
    dim = shape.params["dim"]
    total = nnz * dim * elem + nnz * INDEX_BYTES + (num_bags + 1) * INDEX_BYTES
    if shape.params.get("weighted"):
        total += nnz * elem
    return total + num_bags * dim * elem


# Bags of at most this many ids on average are "short": most of a model's features hold one to
# three ids, so a bag is a row copy or two and launch and row-fetch latency decide, where long
# (pooled) bags stream ids and are bound by bandwidth. Kernels for the two differ.
SHORT_BAG_MEAN_IDS = 4.0


def bucket_of(dim: int, mean_ids_per_bag: float) -> str:
    """The shape bucket of an embedding-bag call (one function for problem, dispatch and
    report): the embedding dim rounded up to a power of two, then the bag-length regime, e.g.
    "d64-short" or "d128-long"."""
    regime = "short" if mean_ids_per_bag <= SHORT_BAG_MEAN_IDS else "long"
    return f"{dim_bucket(dim)}-{regime}"


def bucket(shape: Shape) -> str:
    return bucket_of(shape.params["dim"], _mean_bag_length(shape))


def call_bucket(dim: int, indices: torch.Tensor, offsets: torch.Tensor) -> str:
    """bucket_of for a call, from tensor sizes alone (no device sync)."""
    return bucket_of(dim, indices.numel() / max(offsets.numel() - 1, 1))


def dim_bucket(dim: int) -> str:
    """The embedding dim rounded up to a power of two (at least 16): the first part of a bucket."""
    return f"d{max(16, 1 << math.ceil(math.log2(max(dim, 1))))}"


_s = Shape.of


CHECK_SHAPES = (
    tuple(
        shape
        for dtype in ("fp32", "bf16")
        for shape in (
            _s("mixed-empty", dtype, num_rows=1000, dim=64, lengths=[3, 0, 1, 7, 0, 0, 12, 5, 1, 0, 2]),
            _s("single-bag", dtype, num_rows=50, dim=32, lengths=[9]),
            _s("all-empty", dtype, num_rows=10, dim=16, lengths=[0, 0, 0, 0, 0]),
            _s("no-bags", dtype, num_rows=10, dim=16, lengths=[]),
            _s("dim-48", dtype, num_rows=300, dim=48, num_bags=29, max_len=40),
            _s("dim-100-mean", dtype, num_rows=300, dim=100, num_bags=17, max_len=30, mode="mean"),
            # One long bag (301 ids, over many steps of any id tile) beside empty and short ones.
            _s("long-bag", dtype, num_rows=5000, dim=64, lengths=[1, 301, 0, 4, 257]),
            _s("weighted", dtype, num_rows=700, dim=128, num_bags=23, max_len=60, weighted=True),
            _s("duplicates", dtype, num_rows=100, dim=64, lengths=[6, 9, 1, 33], duplicates=True),
            _s("dim-200", dtype, num_rows=64, dim=200, num_bags=5, max_len=120),
            # Wider than any tile of 256 columns: a second column block.
            _s("dim-300", dtype, num_rows=40, dim=300, num_bags=6, max_len=20),
        )
    )
    + (
        # Wider than a tile of 512 columns; a bag longer than a cap of 1024 ids a kernel might keep
        # (fp32 only: the interpreter takes a second per call for such a bag).
        _s("dim-600", "fp32", num_rows=30, dim=600, num_bags=4, max_len=10),
        _s("bag-1100", "fp32", num_rows=3000, dim=32, lengths=[1100, 3, 0]),
    )
    + tuple(
        # fp16 has a tolerance, so it is part of the domain a kernel is checked on.
        _s(name, "fp16", **params)
        for name, params in (
            ("mixed-empty", dict(num_rows=1000, dim=64, lengths=[3, 0, 1, 7, 0, 0, 12, 5, 1, 0, 2])),
            ("dim-100-mean", dict(num_rows=300, dim=100, num_bags=17, max_len=30, mode="mean")),
            ("weighted", dict(num_rows=700, dim=128, num_bags=23, max_len=60, weighted=True)),
        )
    )
)

TIMING_SHAPES = (
    _s("b64k-d128-1m", "fp32", num_rows=1_000_000, dim=128, num_bags=65_536, max_len=120),
    _s("b64k-d128-1m", "bf16", num_rows=1_000_000, dim=128, num_bags=65_536, max_len=120),
    _s("b256k-d64-4m", "bf16", num_rows=4_000_000, dim=64, num_bags=262_144, max_len=120),
    _s(
        "b256k-d64-4m-weighted",
        "bf16",
        num_rows=4_000_000,
        dim=64,
        num_bags=262_144,
        max_len=120,
        weighted=True,
    ),
    # Short bags (one to three ids, P(1) = 0.57), the workload's most common features: a bucket
    # of their own, so they get kernels of their own.
    _s("b256k-d64-4m-short", "bf16", num_rows=4_000_000, dim=64, num_bags=262_144, max_len=3),
    _s("b64k-d16-1m-short", "fp32", num_rows=1_000_000, dim=16, num_bags=65_536, max_len=3),
)

# Interpreted Triton on a CPU runs a few thousand elements per second: timings there only
# show that the timing path works and are labelled as interpreted.
INTERPRETED_TIMING_SHAPES = (_s("interp-b32-d64", "fp32", num_rows=2000, dim=64, num_bags=32, max_len=24),)

# Element and norm bounds, then per bag (a row of the output). A correct kernel accumulates in
# fp32 and rounds each output once: every element is off by at most half a unit in its last
# place, 2^-9 of itself in bf16 and 2^-11 in fp16 (fp32 sums of up to ~1000 rows add about
# 1e-6), so each bag's error norm is at most that fraction of the bag's own norm. The row bound
# allows four times that (row_rtol: 2^-7 bf16, 2^-9 fp16) plus a floor far below it (row_atol,
# times the output's RMS and the root of the row's width) for bags whose sum cancels to nearly
# zero. So one zeroed bag fails (its error is its whole norm), and so does an output rounded to
# a grid as coarse as the element tolerance (steps of 1.6e-2 of the RMS leave an error of about
# 4.6e-3 of the RMS per element: every bag under about half the typical norm fails), though each
# element lies inside its own bound.
TOLERANCES = {
    "fp32": Tolerance(atol=1e-5, rtol=1e-5, norm_rtol=1e-5, row_rtol=1e-5, row_atol=1e-7),
    "bf16": Tolerance(atol=1.6e-2, rtol=1.6e-2, norm_rtol=8e-3, row_rtol=2**-7, row_atol=2**-12),
    "fp16": Tolerance(atol=2e-3, rtol=2e-3, norm_rtol=1e-3, row_rtol=2**-9, row_atol=2**-14),
}

# The knobs of the default kernel (kernels/embedding_bag.py, whose KNOBS dict they are): None
# keeps the kernel's launch heuristic for that knob at each call's dim and dtype.
KNOBS = (
    Knob(
        "BLOCK_B",
        (None, 1, 2, 4, 8, 16),
        default=None,
        help="bags a program advances together; more ids in flight, more idle lanes on skew",
    ),
    Knob("BLOCK_L", (None, 4, 8, 16, 32), default=None, help="ids gathered per bag per step"),
    Knob(
        "BLOCK_D",
        (None, 16, 32, 64, 128, 256),
        default=None,
        help="embedding columns per program; a program covers ceil(D / BLOCK_D) of a row",
    ),
    Knob(
        "ACC_3D",
        (None, False, True),
        default=None,
        help="accumulate the whole [B, L, D] tile and reduce once at the end",
    ),
    Knob(
        "EVICT_ROWS",
        ("", "evict_first"),
        default="",
        help="cache policy of the gathered rows (streamed once unless ids repeat)",
    ),
    Knob("num_warps", (None, 1, 2, 4, 8), default=None, help="warps per program"),
    Knob("num_stages", (1, 2, 3), default=1, help="software pipelining depth of the id loop"),
)


def _knob_constraints(knobs: dict) -> str | None:
    """Tile bounds, where the tile is fixed (a knob left to the heuristic takes its value per
    call, within the bounds the heuristic keeps)."""
    sizes = [knobs["BLOCK_B"], knobs["BLOCK_L"], knobs["BLOCK_D"]]
    if None in sizes:
        return None
    from kernels.embedding_bag import tile_limit

    tile = sizes[0] * sizes[1] * sizes[2]
    limit = tile_limit(knobs["ACC_3D"])
    if tile > limit:
        return f"BLOCK_B * BLOCK_L * BLOCK_D = {tile} > {limit} elements: the tile spills registers"
    warps = knobs["num_warps"] or 1
    if tile < 32 * warps:
        return f"BLOCK_B * BLOCK_L * BLOCK_D = {tile} is smaller than {warps} warps of 32 lanes"
    return None


# One source: the template is the default kernel's module, its knobs written into its KNOBS.
TEMPLATE = KnobTemplate(
    problem="embedding_bag",
    source_module="kernels.embedding_bag",
    entry="embedding_bag_forward",
    knobs=KNOBS,
    constraint=_knob_constraints,
)

PROBLEM = Problem(
    name="embedding_bag",
    op_family="embedding",
    entry=ENTRY,
    signature=(
        "embedding_bag(weight: Tensor[num_rows, D] (fp32, bf16 or fp16), indices: int64 Tensor[nnz], "
        "offsets: int64 Tensor[B + 1], *, mode: 'sum' | 'mean' = 'sum', "
        "per_sample_weights: Tensor[nnz] | None = None) -> Tensor[B, D]; every tensor contiguous"
    ),
    description=__doc__,
    check_shapes=CHECK_SHAPES,
    timing_shapes=TIMING_SHAPES,
    interpreted_timing_shapes=INTERPRETED_TIMING_SHAPES,
    tolerances=TOLERANCES,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.embedding_bag": torch_embedding_bag},
    flops=flops,
    bytes=bytes_moved,
    bucket=bucket,
    template="embedding_bag",
    forbidden_ops=(
        "embedding_bag",
        "embedding",
        "index_add",
        "index_add_",
        "index_select",
        "index_reduce",
        "index_reduce_",
        "scatter_add",
        "scatter_add_",
        "scatter_reduce",
        "scatter_reduce_",
        "segment_reduce",
        "repeat_interleave",
        "gather",
        "take",
        "bincount",
        "matmul",
        "mm",
        "bmm",
        "einsum",
        "sparse_coo_tensor",
        "sparse_csr_tensor",
    ),
)


# --- the op ------------------------------------------------------------------------------------


def _fake(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    return weight.new_empty((offsets.shape[0] - 1, weight.shape[1]))


def _call_bucket(weight, indices, offsets, *, mode="sum", per_sample_weights=None) -> str:
    return call_bucket(weight.shape[1], indices, offsets)


def _save(ctx, inputs: dict, output) -> None:
    kept = ("weight", "indices", "offsets", "per_sample_weights")
    ctx.save_for_backward(*(inputs[name] for name in kept))
    ctx.mode = inputs["mode"]


def _grads(ctx, grad_out: torch.Tensor) -> dict:
    from kernels.opdef import public  # the backward's kernels are dispatched too

    weight, indices, offsets, psw = ctx.saved_tensors
    grads = {}
    if ctx.needs_grad["weight"]:
        grads["weight"] = public("embedding_bag_backward")(
            grad_out, indices, offsets, weight.shape[0], mode=ctx.mode, per_sample_weights=psw
        )
    if ctx.needs_grad["per_sample_weights"]:
        lengths = offsets[1:] - offsets[:-1]
        bag_of_index = torch.repeat_interleave(torch.arange(lengths.numel(), device=weight.device), lengths)
        grad_psw = (grad_out.float()[bag_of_index] * weight.float()[indices]).sum(-1)
        grads["per_sample_weights"] = grad_psw.to(psw.dtype)
    return grads


def call_cost(weight, indices, offsets, *, mode="sum", per_sample_weights=None) -> tuple[float, float]:
    """One call's FLOPs and minimum bytes (bytes_moved's count, on the call's own sizes)."""
    nnz, num_bags, dim, elem = indices.shape[0], offsets.shape[0] - 1, weight.shape[1], weight.element_size()
    weighted = per_sample_weights is not None
    moved = nnz * dim * elem + nnz * indices.element_size() + (num_bags + 1) * offsets.element_size()
    moved += nnz * per_sample_weights.element_size() if weighted else 0
    return nnz * dim * (2 if weighted else 1), moved + num_bags * dim * elem


OP = Op(
    name="embedding_bag",
    cost=call_cost,
    problem=PROBLEM,
    default="kernels.embedding_bag:embedding_bag_forward",
    check="kernels.embedding_bag:check_arguments",
    fake=_fake,
    bucket=_call_bucket,
    backward=Backward(save=_save, grads=_grads, uses=("embedding_bag_backward",)),
    doc="""Pooled embedding-bag lookup.

    weight [num_rows, D]; indices [nnz] int32/int64; offsets [B + 1] (bag b is
    indices[offsets[b]:offsets[b+1]]); per_sample_weights [nnz] (mode 'sum' only) -> [B, D].
    Differentiable in weight and per_sample_weights.
    """,
)
