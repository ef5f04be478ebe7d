"""The training update of table-batched embeddings, fused into their backward: the optimizer
step applied in place to the rows the batch looked up, with no dense gradient ever made.

Layout as search_space.packed_tables says (flat `weights`, row-wise fp32 `state`, per-feature
offsets, feature-major bags). For every row r of a table that some bag looked up, its gradient
sums the pooled outputs' gradients of the bags that hold it, over every feature on that table:

    g_r = sum_{i : id i is row r} s_i * grad_out[b(i), dim_offsets[f(i)] : dim_offsets[f(i)] + dim]

with s_i = per_sample_weights[i] (sum pooling), 1 / len(bag(i)) (mean) or 1. Then, once per
row, in fp32:

    sgd:      w_r -= lr * g_r
    adagrad:  state_r += mean(g_r^2);  w_r -= lr * g_r / (sqrt(state_r) + eps)   (row-wise)

and w_r is rounded once to the weights' dtype: to nearest, or with `stochastic_rounding` (bf16
and fp16 weights) up or down at random, with the probability that makes the rounding unbiased,
from the counter-based generator seeded by `seed`. Rows no bag looked up stay as they are, their
state too. The op returns None; what it computes is `weights` and `state` after the call. The
reference rounds to nearest: a stochastic rounding is within one unit in the last place of it,
which the tolerance admits.

The forward's pooling is `pooling`, not `mode` as in embedding_bag: torch.compile's handling
of ops that update their arguments takes a `mode` argument of its own.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from search_space import embedding_bag, packed_tables
from search_space import embedding_bags as forward
from search_space.op import Op
from search_space.problem import Inputs, Problem, Shape
from search_space.template import Knob, KnobTemplate

ENTRY = "embedding_bags_update"
OPTIMIZERS = ("sgd", "adagrad")
INDEX_DTYPES = forward.INDEX_DTYPES


def _bags_of(offsets: torch.Tensor, num_features: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(B, the bag of each id, each bag's length), from feature-major offsets."""
    off = offsets.long()
    lengths = off[1:] - off[:-1]
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)
    return (offsets.numel() - 1) // num_features, bag, lengths


def reference(
    weights: torch.Tensor,
    state: torch.Tensor,
    grad_out: torch.Tensor,
    weight_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    dim_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    *,
    max_dim: int,
    optimizer: str = "adagrad",
    lr: float = 0.01,
    eps: float = 1e-8,
    pooling: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> None:
    """Plain PyTorch: each table's rows' gradients summed in fp32 (fp64 for fp64 weights), then
    the step, rounded to nearest."""
    acc = torch.float64 if weights.dtype == torch.float64 else torch.float32
    w_offs, r_offs, d_offs = packed_tables.metadata_lists(weight_offsets, row_offsets, dim_offsets)
    num_features = len(w_offs)
    batch, bag, lengths = _bags_of(offsets, num_features)
    feature = bag // max(batch, 1)
    sample = bag - feature * batch
    ids = indices.long()
    tables: dict[int, tuple[int, int, list, list]] = {}  # by row offset: w_off, dim, ids, grads
    for f in range(num_features):
        chosen = feature == f
        dim = d_offs[f + 1] - d_offs[f]
        grad = grad_out[sample[chosen], d_offs[f] : d_offs[f] + dim].to(acc)
        if pooling == "mean":
            grad = grad / lengths[bag[chosen]].clamp(min=1).to(acc)[:, None]
        if per_sample_weights is not None:
            grad = grad * per_sample_weights[chosen].to(acc)[:, None]
        entry = tables.setdefault(r_offs[f], (w_offs[f], dim, [], []))
        entry[2].append(ids[chosen])
        entry[3].append(grad)
    for r_off, (w_off, dim, table_ids, grads) in tables.items():
        rows, inverse = torch.unique(torch.cat(table_ids), return_inverse=True)
        if rows.numel() == 0:
            continue
        grad = torch.zeros(rows.numel(), dim, dtype=acc, device=weights.device)
        grad.index_add_(0, inverse, torch.cat(grads))
        elements = w_off + rows[:, None] * dim + torch.arange(dim, device=weights.device)
        w = weights[elements].to(acc)
        if optimizer == "sgd":
            w = w - lr * grad
        else:
            total = state[r_off + rows].to(acc) + grad.pow(2).mean(1)
            state[r_off + rows] = total.to(state.dtype)
            w = w - lr * grad / (total.sqrt() + eps)[:, None]
        weights[elements] = w.to(weights.dtype)


def torch_sparse_update(
    weights,
    state,
    grad_out,
    weight_offsets,
    row_offsets,
    dim_offsets,
    indices,
    offsets,
    *,
    max_dim,
    optimizer="adagrad",
    lr=0.01,
    eps=1e-8,
    pooling="sum",
    per_sample_weights=None,
    stochastic_rounding=False,
    seed=0,
):
    """What training does without the fused op: torch's embedding_bag backward per feature with
    sparse gradients (autograd through F.embedding_bag(sparse=True)), then a sparse row-wise step
    per table (coalesce the rows, then update them), as model.optim.RowWiseAdagrad does."""
    w_offs, r_offs, d_offs = packed_tables.metadata_lists(weight_offsets, row_offsets, dim_offsets)
    num_features = len(w_offs)
    batch = forward.num_samples(num_features, offsets)
    bounds = forward.feature_bounds(offsets, num_features)
    extents = packed_tables.table_rows(
        w_offs, [d_offs[f + 1] - d_offs[f] for f in range(num_features)], weights.numel()
    )
    leaves: dict[int, torch.Tensor] = {}
    outputs, grads = [], []
    for f in range(num_features):
        dim = d_offs[f + 1] - d_offs[f]
        if w_offs[f] not in leaves:
            rows = extents[w_offs[f]]
            view = weights[w_offs[f] : w_offs[f] + rows * dim].view(rows, dim)
            leaves[w_offs[f]] = view.detach().requires_grad_()
        lo, hi = bounds[f], bounds[f + 1]
        psw = per_sample_weights[lo:hi] if per_sample_weights is not None else None
        local = offsets[f * batch : (f + 1) * batch] - lo
        with torch.enable_grad():
            outputs.append(
                F.embedding_bag(
                    indices[lo:hi],
                    leaves[w_offs[f]],
                    local,
                    mode=pooling,
                    per_sample_weights=psw,
                    sparse=True,
                )
            )
        grads.append(grad_out[:, d_offs[f] : d_offs[f] + dim])
    torch.autograd.backward(outputs, grads)
    with torch.no_grad():
        for w_off, leaf in leaves.items():
            if leaf.grad is None:
                continue
            grad = leaf.grad.coalesce()
            rows, values = grad.indices()[0], grad.values().float()
            table = weights[w_off : w_off + leaf.numel()].view(leaf.shape)
            if optimizer == "sgd":
                table.index_add_(0, rows, (-lr * values).to(table.dtype))
                continue
            r_off = r_offs[w_offs.index(w_off)]
            sums = state[r_off : r_off + leaf.shape[0]]
            sums.index_add_(0, rows, values.pow(2).mean(1))
            step = values * (lr / (sums[rows].sqrt() + eps))[:, None]
            table.index_add_(0, rows, (-step).to(table.dtype))


def make_inputs(shape: Shape, seed: int, device: torch.device) -> Inputs:
    """Tables of small weights (0.01 scale) and states of a few steps' sums, so that one step
    (about lr in size) moves every looked-up row far beyond the dtype's rounding: an update
    left out fails. Params: tables, features, batch, max_lens or lengths, and optional
    optimizer, pooling, weighted, hot_rows, index_dtype, stochastic_rounding."""
    p = shape.params
    gen = torch.Generator(device=device).manual_seed(seed)
    layout = forward.layout_of(shape)
    dtype = shape.torch_dtype
    bags = packed_tables.draw_bags(
        layout,
        p["batch"],
        gen,
        device,
        max_lens=p.get("max_lens"),
        lengths=p.get("lengths"),
        hot_rows=p.get("hot_rows", 0),
        weighted=p.get("weighted", False),
        index_dtype=INDEX_DTYPES[p.get("index_dtype", "int64")],
        weight_dtype=dtype,
    )
    weights = (torch.randn(layout.num_elements, generator=gen, device=device) * 0.01).to(dtype)
    optimizer = p.get("optimizer", "adagrad")
    if optimizer == "adagrad":
        state = torch.rand(layout.num_rows, generator=gen, device=device) * 2.0
    else:
        state = torch.zeros(0, device=device)
    grad_out = torch.randn(p["batch"], layout.total_dim, generator=gen, device=device).to(dtype)
    weight_offsets, row_offsets, dim_offsets = layout.metadata(device)
    kwargs = {
        "max_dim": layout.max_dim,
        "optimizer": optimizer,
        "lr": 0.05,
        "eps": 1e-8,
        "pooling": p.get("pooling", "sum"),
        "per_sample_weights": bags.per_sample_weights,
        "stochastic_rounding": bool(p.get("stochastic_rounding", False)),
        "seed": seed & 0x7FFFFFFF,
    }
    args = (weights, state, grad_out, weight_offsets, row_offsets, dim_offsets, bags.indices, bags.offsets)
    return Inputs(args=args, kwargs=kwargs)


def _ids_and_columns(shape: Shape) -> tuple[float, float]:
    """(ids in the batch, their gathered columns: sum over ids of their feature's dim)."""
    per_feature = forward.feature_ids(shape)
    dims = forward.layout_of(shape).dims()
    return sum(per_feature), sum(n * d for n, d in zip(per_feature, dims, strict=True))


def flops(shape: Shape) -> float:
    """A multiply-add per gathered gradient element and about four operations per updated one
    (an upper bound: every id its own row)."""
    _, columns = _ids_and_columns(shape)
    return 6 * columns


def bytes_moved(shape: Shape) -> float:
    """Minimum traffic: grad_out read once, ids and offsets read, each looked-up row read and
    written once (counted here as once per id: an upper bound where ids repeat), its state read
    and written."""
    elem = shape.torch_dtype.itemsize
    p, layout = shape.params, forward.layout_of(shape)
    ids, columns = _ids_and_columns(shape)
    index = INDEX_DTYPES[p.get("index_dtype", "int64")].itemsize
    total = (
        p["batch"] * layout.total_dim * elem + ids * index + (layout.num_features * p["batch"] + 1) * index
    )
    total += 2 * columns * elem
    if p.get("optimizer", "adagrad") == "adagrad":
        total += 2 * ids * 4
    if p.get("weighted"):
        total += ids * elem
    return total


def bucket_of(max_dim: int, mean_ids_per_bag: float, optimizer: str) -> str:
    """The forward's bucket of the call (its widest feature, its bag regime), then the optimizer:
    "d128-short-adagrad"."""
    return f"{forward.bucket_of(max_dim, mean_ids_per_bag)}-{optimizer}"


def bucket(shape: Shape) -> str:
    return f"{forward.bucket(shape)}-{shape.params.get('optimizer', 'adagrad')}"


_s = Shape.of


# Tables for the check shapes: dims 4 to 256, a table of one row, features sharing tables.
_MIXED = dict(tables=[[50, 4], [200, 48], [1, 16], [300, 128]], features=[0, 1, 2, 3, 1])
_WIDE = dict(tables=[[40, 256], [60, 100]], features=[0, 1])


def _check_shapes(dtype: str, optimizer: str) -> tuple[Shape, ...]:
    o = dict(optimizer=optimizer)
    # The first has given lengths: the bucket of every draw of it is the shape's (dispatch tests).
    shapes = [
        _s(
            f"empty-bags-{optimizer}",
            dtype,
            **_MIXED,
            **o,
            batch=3,
            lengths=[0, 2, 0, 1, 0, 0, 0, 0, 3, 0, 0, 0, 1, 0, 0],
        ),
        _s(f"mixed-{optimizer}", dtype, **_MIXED, **o, batch=7, max_lens=[3, 1, 2, 40, 5]),
        # Every id one of the last two rows: rows held by many bags (split across programs).
        _s(f"hot-rows-{optimizer}", dtype, **_MIXED, **o, batch=40, max_lens=[2, 8, 1, 30, 3], hot_rows=2),
        _s(f"mean-{optimizer}", dtype, **_WIDE, **o, batch=5, max_lens=[6, 9], pooling="mean"),
        # Dims of no multiple of 4 (rows an element at a time) among 8-byte ones.
        _s(
            f"odd-dims-{optimizer}",
            dtype,
            tables=[[40, 6], [30, 4], [50, 3]],
            **o,
            batch=6,
            max_lens=[3, 2, 4],
        ),
        _s(
            f"weighted-int32-{optimizer}",
            dtype,
            **_MIXED,
            **o,
            batch=6,
            max_lens=[3, 4, 1, 12, 2],
            weighted=True,
            index_dtype="int32",
        ),
    ]
    if dtype != "fp32":
        shapes.append(
            _s(
                f"stochastic-{optimizer}",
                dtype,
                **_MIXED,
                **o,
                batch=6,
                max_lens=[3, 4, 1, 12, 2],
                stochastic_rounding=True,
            )
        )
    return tuple(shapes)


def _in(dtype: str, optimizer: str, *names: str) -> tuple[Shape, ...]:
    """The check shapes of `names` (their prefix before the optimizer) in dtype and optimizer."""
    return tuple(s for s in _check_shapes(dtype, optimizer) if s.name.rsplit("-", 1)[0] in names)


# Every case in fp32 (exact sums) and in bf16 with adagrad; the rest where a dtype or an
# optimizer changes something: rounding (stochastic or not) and the state's row norm.
CHECK_SHAPES = (
    _check_shapes("fp32", "sgd")
    + _check_shapes("fp32", "adagrad")
    + _check_shapes("bf16", "adagrad")
    + _in("bf16", "sgd", "stochastic", "hot-rows")
    + _in("fp16", "adagrad", "mixed", "weighted-int32", "stochastic")
    + _in("fp16", "sgd", "stochastic")
) + (
    _s("no-ids", "fp32", tables=[[10, 16]], features=[0], batch=4, lengths=[0, 0, 0, 0]),
    _s("no-bags", "fp32", tables=[[10, 16]], features=[0, 0], batch=0, lengths=[]),
    # Every id in one bag, of one row: a segment far longer than any chunk of ids.
    _s("one-bag", "fp32", tables=[[3, 32]], features=[0], batch=2, lengths=[700, 0], hot_rows=1),
)

# Realistic batches (WORKLOAD.md: most features one to three ids, a few long bags up to 120;
# dims mostly 64 and 128, mixed from 16 to 256) on tables of about a gigabyte in all: each timed
# call gets its own copy of the tables, and the sandbox places several.
_TIMING_TABLES = [[2_000_000, 64], [1_000_000, 128], [500_000, 256], [4_000_000, 16], [1_000_000, 32]]
_SHORT_FEATURES = [0, 0, 1, 1, 3, 3, 3, 4, 4, 0, 1, 3, 4, 2, 0, 1, 3, 4, 0, 3]
_MIXED_FEATURES = [*_SHORT_FEATURES, 0, 1, 2, 1, 0]

# Most features hold one to three ids (max_len 1 or 3); a mixed batch adds five long features.
_SHORT = dict(tables=_TIMING_TABLES, features=_SHORT_FEATURES, max_lens=[1, 3] * 10)
_MIXED_TIMING = dict(
    tables=_TIMING_TABLES, features=_MIXED_FEATURES, max_lens=[1, 3] * 10 + [120, 40, 60, 20, 120]
)

TIMING_SHAPES = (
    _s("b64k-20f-short-adagrad", "bf16", **_SHORT, batch=65_536),
    forward.with_narrow_feature(
        _s("b64k-20f-short-adagrad", "bf16", **_SHORT, batch=65_536), "b64k-21f-short-d4-adagrad"
    ),
    _s("b64k-25f-mixed-adagrad", "bf16", **_MIXED_TIMING, batch=65_536),
    _s("b64k-25f-mixed-adagrad", "fp32", **_MIXED_TIMING, batch=65_536),
    _s("b128k-20f-short-sgd", "bf16", **_SHORT, batch=131_072, optimizer="sgd", stochastic_rounding=True),
)

INTERPRETED_TIMING_SHAPES = (
    _s(
        "interp-b16-adagrad",
        "fp32",
        tables=[[500, 64], [300, 32]],
        features=[0, 1, 0],
        batch=16,
        max_lens=[2, 6, 1],
    ),
)

# The weights after the step, and the state, compared as the flat buffers they are: each
# element is one fp32 computation rounded once (a row's gradients summed in some order, then the
# step), so embedding_bag's element bounds hold (its comment derives them), and the tables'
# untouched rows are exact. Each "row" of a flat buffer is one element: its row bound is its
# element bound. (A row of hundreds of ids, a hot id, sums hundreds of fp32 terms: the sum's
# rounding, times lr, can exceed a bound relative to the element alone where the step cancels
# the weight; against the buffer's RMS it stays below 1e-5.) The state adds a row's mean square
# of that summed gradient: twice the sum's relative rounding. On a hot row its relative error
# reaches that of the whole buffer (one-bag: 700 ids on 3 rows, where the state's norm is the
# hot row's, came out 1.0006e-5 from the reference once), so the fp32 norm bound is twice the
# elements' rtol.
TOLERANCES = {
    dtype: dataclasses.replace(
        tol,
        row_rtol=tol.rtol,
        row_atol=tol.atol,
        norm_rtol=2 * tol.rtol if dtype == "fp32" else tol.norm_rtol,
    )
    for dtype, tol in embedding_bag.TOLERANCES.items()
}


def error_scale(inputs: Inputs) -> tuple[float | None, None]:
    """(weights, state): for fp32 weights, the magnitude of a row's summed gradient step, lr
    times the gradients' RMS times the most ids of one row. A hot row sums hundreds of terms, and fp32 sums in
    another order differ by about that times 2^-24 per term: where the step cancels the weight
    (a result near zero), that is the error a correct kernel has, far above the result's own
    rounding. (bf16 and fp16 weights round far more coarsely than that: their bounds stand; the
    state's own fp32 bounds stand too.)"""
    weights, _, grad_out, _, row_offsets, _, indices, offsets = inputs.args
    if weights.dtype != torch.float32 or indices.numel() == 0:
        return None, None
    batch, bag, _ = _bags_of(offsets, row_offsets.numel())
    keys = row_offsets[bag // max(batch, 1)] + indices.long()
    most = int(torch.unique(keys, return_counts=True)[1].max())
    return inputs.kwargs["lr"] * grad_out.float().pow(2).mean().sqrt().item() * most, None


def _touched(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks of the weights' elements and the state's rows that the call's ids reach."""
    weights, state, _, weight_offsets, row_offsets, dim_offsets, indices, offsets = inputs.args
    w_offs, r_offs, d_offs = packed_tables.metadata_lists(weight_offsets, row_offsets, dim_offsets)
    batch, bag, _ = _bags_of(offsets, len(w_offs))
    feature = bag // max(batch, 1)
    elements = torch.zeros(weights.numel(), dtype=torch.bool, device=weights.device)
    rows = torch.zeros(state.numel(), dtype=torch.bool, device=weights.device)  # none for sgd
    for f in range(len(w_offs)):
        ids = indices[feature == f].long().unique()
        dim = d_offs[f + 1] - d_offs[f]
        elements[(w_offs[f] + ids[:, None] * dim + torch.arange(dim, device=ids.device)).reshape(-1)] = True
        if state.numel():
            rows[r_offs[f] + ids] = True
    return elements, rows


def _neighbours(exact: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The values of `dtype` just below and just above each fp32 value (both the value itself
    where it is one)."""
    nearest = exact.to(dtype)
    toward = torch.where(exact > nearest.float(), 1, -1)  # where the exact value lies from it
    bits = nearest.view(torch.int16).to(torch.int32)
    magnitude = bits & 0x7FFF
    # Sign and magnitude: a step up the number line grows a positive magnitude, shrinks a negative
    # one; from zero, the smallest subnormal on the exact value's side.
    stepped = torch.where(bits < 0, bits - toward, bits + toward)
    stepped = torch.where(magnitude == 0, torch.where(toward > 0, 1, -32767), stepped)
    other = stepped.to(torch.int16).view(dtype).float()
    other = torch.where(exact == nearest.float(), nearest.float(), other)
    return torch.minimum(nearest.float(), other), torch.maximum(nearest.float(), other)


def _summed_step(inputs: Inputs) -> torch.Tensor:
    """Each weight's step as the reference takes it from the gradients' magnitudes (lr, or
    adagrad's scale, times the sum of |g| over the row's ids), in fp32: the size of the terms
    whose order of summation a kernel chooses."""
    magnitude = inputs.clone()
    weights, state, grad_out, *rest = magnitude.args
    zeros = torch.zeros(weights.shape, dtype=torch.float32, device=weights.device)
    reference(zeros, state, grad_out.abs(), *rest, **magnitude.kwargs)
    return zeros.abs()


def rounding_bounds(
    exact: torch.Tensor, before: torch.Tensor, dtype: torch.dtype, summed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What an honest stochastic rounding of the step from `before` to the fp32 value `exact`
    may give in `dtype`: the lowest and highest values, and the chance that it gives one beyond
    the two values around `exact`. An fp32 step computed in another order differs from this one
    by a few units of fp32 in its terms (the old weight and the step), so the kernel's own fp32
    value lies anywhere within that slack of `exact` and rounds to either value around it. Where
    that crosses a value of `dtype` (`exact` on a value, or just below a power of two and the
    kernel's value just above), the one beyond is honest but rare: at most the slack over the
    gap it rounds across. `summed`: each weight's step from the magnitudes of its gradient terms
    (a row summed over thousands of ids rounds each partial sum in fp32: its order matters that
    much more)."""
    slack = (before.abs() + (before - exact).abs()) * 2**-20
    if summed is not None:
        slack = slack + summed * 2**-22
    low, high = _neighbours(exact, dtype)
    lowest, _ = _neighbours(exact - slack, dtype)
    _, highest = _neighbours(exact + slack, dtype)
    below = torch.where(lowest < low, slack / (low - lowest).clamp(min=1e-38), 0.0)
    above = torch.where(highest > high, slack / (highest - high).clamp(min=1e-38), 0.0)
    return lowest, highest, (below + above).clamp(max=1.0)


# Stochastic rounding, judged over the elements whose exact step falls between two values: a
# rounding that is not stochastic (to nearest, toward zero) rounds up far more or far less often
# than the fractions say in one half of them or the other (a count at least SR_SIGMAS binomial
# deviations off, with at least SR_MIN_ELEMENTS elements in the half).
SR_SIGMAS = 6.0
SR_MIN_ELEMENTS = 64


def verify(inputs: Inputs, got: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """What the tolerance cannot see: rows no id reaches stay bit for bit, weights and state;
    with stochastic_rounding, each looked-up weight is one of the two values of its dtype around
    the exact fp32 step, rounded up about as often as its place between them says."""
    weights, state = got
    elements, rows = _touched(inputs)
    if not torch.equal(weights[~elements], inputs.args[0][~elements]):
        changed = int((weights[~elements] != inputs.args[0][~elements]).sum())
        return f"{changed} weights of rows that no id looks up changed"
    if not torch.equal(state[~rows], inputs.args[1][~rows]):
        return f"{int((state[~rows] != inputs.args[1][~rows]).sum())} state rows that no id looks up changed"
    if not inputs.kwargs.get("stochastic_rounding") or not bool(elements.any()):
        return None
    exact_inputs = inputs.clone()
    exact_weights = exact_inputs.args[0].float()
    reference(exact_weights, *exact_inputs.args[1:], **exact_inputs.kwargs)
    exact, mine = exact_weights[elements], weights[elements].float()
    low, high = _neighbours(exact, weights.dtype)
    spacing = high - low
    before = inputs.args[0][elements].float()
    lowest, highest, chance = rounding_bounds(exact, before, weights.dtype, _summed_step(inputs)[elements])
    outside = (mine < lowest) | (mine > highest)
    if bool(outside.any()):
        far = int(outside.sum())
        return (
            f"{far} stochastically rounded weights lie more than one value of their dtype from the exact step"
        )
    # Beyond the two values around the exact step: honest only as often as the fp32 slack says.
    beyond, expected = int(((mine < low) | (mine > high)).sum()), float(chance.sum())
    if beyond > expected + SR_SIGMAS * expected**0.5 + 1:
        return (
            f"{beyond} stochastically rounded weights lie beyond the two values of their dtype around "
            f"the exact step, where an honest rounding puts about {expected:.1f}"
        )
    between = spacing > 0
    frac = ((exact - low) / spacing.clamp(min=1e-38))[between].clamp(0, 1)
    up = (mine[between] > exact[between]).float()
    for half, name in ((frac < 0.5, "below"), (frac >= 0.5, "above")):
        if int(half.sum()) < SR_MIN_ELEMENTS:
            continue
        expected, counted = float(frac[half].sum()), float(up[half].sum())
        sigma = float((frac[half] * (1 - frac[half])).sum()) ** 0.5
        if abs(counted - expected) > SR_SIGMAS * sigma + 1:
            return (
                f"stochastic rounding is biased: of {int(half.sum())} weights whose exact step lies "
                f"{name} the midpoint of its two values, {counted:.0f} rounded up where about "
                f"{expected:.0f} should"
            )
    return None


KNOBS = (
    Knob(
        "BLOCK_I",
        (None, 1, 2, 4, 8),
        default=None,
        help="rows (segments of sorted ids) a program updates together",
    ),
    Knob("BLOCK_L", (None, 1, 2, 4, 8, 16, 32), default=None, help="ids of a row gathered per step"),
    Knob(
        "BLOCK_D",
        (None, 16, 32, 64, 128, 256),
        default=None,
        help="columns a program takes at a time (rows wider take two passes under adagrad)",
    ),
    Knob(
        "CHUNK",
        (16, 32, 64, 128, 256),
        default=64,
        help="most ids of one row a program sums: longer rows (hot ids) are split across programs",
    ),
    Knob("num_warps", (None, 1, 2, 4, 8), default=None, help="warps per program"),
    Knob(
        "maxnreg",
        (None, 32, 40, 48, 56, 64, 255),
        default=None,
        help="most registers a thread of the rows kernel holds (more programs an SM; the rest spill); "
        "255: no cap in effect; None: the launch heuristic's (48 on a GPU under Triton 3.6, else none)",
    ),
)


def _knob_constraints(knobs: dict) -> str | None:
    if knobs["BLOCK_L"] is not None and knobs["BLOCK_L"] > knobs["CHUNK"]:
        return f"BLOCK_L = {knobs['BLOCK_L']} > CHUNK = {knobs['CHUNK']}: a row's chunk never fills a step"
    return None


TEMPLATE = KnobTemplate(
    problem="embedding_bags_update",
    source_module="kernels.embedding_bags_update",
    entry="embedding_bags_update",
    knobs=KNOBS,
    constraint=_knob_constraints,
)

PROBLEM = Problem(
    name="embedding_bags_update",
    op_family="embedding",
    entry=ENTRY,
    signature=(
        "embedding_bags_update(weights: Tensor[N] (fp32, bf16 or fp16), state: fp32 Tensor[R] (adagrad; [0] "
        "for sgd), grad_out: Tensor[B, total_dim] (weights' dtype), weight_offsets: int64 Tensor[F], "
        "row_offsets: int64 Tensor[F], dim_offsets: int64 Tensor[F + 1], indices: int32|int64 Tensor[nnz], "
        "offsets: Tensor[F * B + 1] (indices' dtype), *, max_dim: int, optimizer: 'sgd' | 'adagrad', "
        "lr: float, eps: float, pooling: 'sum' | 'mean', per_sample_weights: Tensor[nnz] | None, "
        "stochastic_rounding: bool, seed: int) -> None; updates weights and state in place"
    ),
    description=__doc__,
    check_shapes=CHECK_SHAPES,
    timing_shapes=TIMING_SHAPES,
    interpreted_timing_shapes=INTERPRETED_TIMING_SHAPES,
    tolerances=TOLERANCES,
    make_inputs=make_inputs,
    reference=reference,
    baselines={"torch.embedding_bag_sparse+step": torch_sparse_update},
    flops=flops,
    bytes=bytes_moved,
    bucket=bucket,
    error_scale=error_scale,
    verify=verify,
    template="embedding_bags_update",
    optimizes="backward",
    updates=("weights", "state"),
    # Sorting the ids' row keys, and numbering the rows' chunks (the default kernel numbers them
    # in kernels; a candidate may in host code, as it did before): host code on integers (the
    # host-compute watch holds it to the call's own integer inputs and what is made from them).
    screen_extras=("torch.sort", "torch.cumsum", "torch.searchsorted"),
    forbidden_ops=(
        *embedding_bag.PROBLEM.forbidden_ops,
        "index_put",
        "index_put_",
        "put_",
        "autograd",
        "unique",
        "unique_consecutive",
        "sparse_coo_tensor",
    ),
)


# --- the op ------------------------------------------------------------------------------------


def _call_bucket(
    weights,
    state,
    grad_out,
    weight_offsets,
    row_offsets,
    dim_offsets,
    indices,
    offsets,
    *,
    max_dim,
    optimizer="adagrad",
    **_,
) -> str:
    return bucket_of(max_dim, indices.numel() / max(offsets.numel() - 1, 1), optimizer)


def _cost(
    weights,
    state,
    grad_out,
    weight_offsets,
    row_offsets,
    dim_offsets,
    indices,
    offsets,
    *,
    max_dim,
    optimizer="adagrad",
    per_sample_weights=None,
    **_,
) -> tuple[float, float]:
    """grad_out read, each id's gradient row gathered, and its table row read and written (an
    upper bound where ids repeat): the columns per id are the mean feature dim's."""
    nnz, elem = indices.numel(), weights.element_size()
    mean_dim = grad_out.shape[1] / max(weight_offsets.numel(), 1)
    moved = grad_out.numel() * elem + nnz * indices.element_size() + offsets.numel() * offsets.element_size()
    moved += 3 * nnz * mean_dim * elem + (8 * nnz if optimizer == "adagrad" else 0)
    moved += nnz * per_sample_weights.element_size() if per_sample_weights is not None else 0
    return 6 * nnz * mean_dim, moved


# The widest row the op takes: the default kernel's long-rows tile holds a row whole
# (kernels/embedding_bags_update.py).
MAX_DIM = 1024


def check_arguments(
    weights, state, grad_out, weight_offsets, row_offsets, dim_offsets, indices, offsets, *, max_dim,
    optimizer="adagrad", pooling="sum", per_sample_weights=None, stochastic_rounding=False, **_,
) -> None:  # fmt: skip
    """ValueError naming what is wrong; sizes only (never the data: no sync)."""
    if optimizer not in ("sgd", "adagrad"):
        raise ValueError(f"optimizer must be 'sgd' or 'adagrad', got {optimizer!r}")
    if pooling not in ("sum", "mean"):
        raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}")
    if weights.dim() != 1 or not weights.is_contiguous():
        raise ValueError(f"weights must be a contiguous flat buffer [N], got shape {tuple(weights.shape)}")
    if weights.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"weights must be fp32, bf16 or fp16, got {weights.dtype}")
    if optimizer == "adagrad" and (
        state.dtype != torch.float32 or state.dim() != 1 or not state.is_contiguous()
    ):
        raise ValueError(
            f"adagrad's state must be a contiguous fp32 [rows], got {state.dtype} {tuple(state.shape)}"
        )
    num_features = weight_offsets.numel()
    if (
        num_features == 0
        or row_offsets.shape != weight_offsets.shape
        or dim_offsets.shape != (num_features + 1,)
    ):
        raise ValueError(
            f"weight_offsets and row_offsets must be [F] (F >= 1) and dim_offsets [F + 1], got "
            f"{tuple(weight_offsets.shape)}, {tuple(row_offsets.shape)}, {tuple(dim_offsets.shape)}"
        )
    layout = {"weight_offsets": weight_offsets, "row_offsets": row_offsets, "dim_offsets": dim_offsets}
    for name, t in layout.items():
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")
    ids = (torch.int32, torch.int64)
    if indices.dim() != 1 or indices.dtype not in ids or offsets.dtype != indices.dtype:
        raise ValueError(
            f"indices must be [nnz] int32 or int64 and offsets of the same dtype, got "
            f"{indices.dtype} {tuple(indices.shape)} and {offsets.dtype}"
        )
    if offsets.dim() != 1 or (offsets.numel() - 1) % num_features:
        raise ValueError(f"offsets must be [F * B + 1] with F = {num_features}, got {tuple(offsets.shape)}")
    batch = (offsets.numel() - 1) // num_features
    if grad_out.dim() != 2 or grad_out.shape[0] != batch or grad_out.dtype != weights.dtype:
        raise ValueError(
            f"grad_out must be [B = {batch}, total_dim] in the weights' dtype {weights.dtype}, "
            f"got {grad_out.dtype} {tuple(grad_out.shape)}"
        )
    if not 1 <= max_dim <= MAX_DIM:
        raise ValueError(f"max_dim must be in [1, {MAX_DIM}], got {max_dim}")
    named = {"weights": weights, "state": state, "grad_out": grad_out, "weight_offsets": weight_offsets,
             "row_offsets": row_offsets, "dim_offsets": dim_offsets, "indices": indices, "offsets": offsets,
             "per_sample_weights": per_sample_weights}  # fmt: skip
    for name, t in named.items():
        if t is None:
            continue
        if t.device != weights.device:
            raise ValueError(f"{name} is on {t.device}, the weights on {weights.device}: one device for all")
        if name != "grad_out" and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous())")
    if per_sample_weights is not None:
        if not per_sample_weights.is_floating_point():
            raise ValueError(f"per_sample_weights must be floating point, got {per_sample_weights.dtype}")
        if pooling != "sum":
            raise ValueError("per_sample_weights is only supported with pooling='sum'")
        if per_sample_weights.shape != indices.shape:
            raise ValueError(
                f"per_sample_weights must be [nnz = {indices.numel()}], got {tuple(per_sample_weights.shape)}"
            )
    if stochastic_rounding and weights.dtype == torch.float32:
        raise ValueError("stochastic_rounding is for bf16 and fp16 weights; these are fp32")


OP = Op(
    name="embedding_bags_update",
    cost=_cost,
    problem=PROBLEM,
    default="kernels.embedding_bags_update:embedding_bags_update",
    check=check_arguments,
    fake=lambda *args, **kwargs: None,
    bucket=_call_bucket,
    doc="""The optimizer step of table-batched embeddings, fused into their backward.

    Updates `weights` (flat, every table) and `state` (row-wise fp32; adagrad) in place from the
    pooled outputs' gradient grad_out [B, total_dim], for the rows the keyed bags (indices,
    feature-major offsets [F * B + 1]) looked up: each row once, its gradient summed over every
    bag and feature that holds it. optimizer 'sgd' or 'adagrad' (row-wise); pooling 'sum' or
    'mean' (as the forward pooled); per_sample_weights with 'sum'; stochastic_rounding for bf16
    and fp16 weights. Returns None. Layout: search_space.packed_tables.
    """,
)
