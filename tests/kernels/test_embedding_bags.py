"""The table-batched embedding lookup `recforge::embedding_bags` and its dense gradient: the
default kernels pass the protocol's check on every check shape (in the interpreter's launch
configuration and in the GPU's, which also compiles for sm_90), kernels one slip away do not,
the forward equals the single-table op feature by feature, the gradients of weights and
per-sample weights equal autograd through the fp64 reference, torch.compile traces the op in
one graph, bad arguments are named, and random layouts agree with the reference."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from cuda_compile import in_subprocess
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels.embedding_bags as module
import kernels.embedding_bags_backward as backward_module
from kernels import ops
from kernels.registry import DISPATCHER
from sandbox.protocol import check_shape, compare
from sandbox.screen import screen_problem
from search_space import embedding_bags, get_problem
from search_space.embedding_bags import CHECK_SHAPES, TEMPLATE, TIMING_SHAPES, reference
from search_space.packed_tables import metadata_lists
from search_space.problem import Shape
from search_space.template import get_template

PROBLEM = get_problem("embedding_bags")
BACKWARD = get_problem("embedding_bags_backward")
# The GPU where there is one, else the DEVICE (the kernels then run interpreted).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _shape(name: str, dtype: str = "fp32") -> Shape:
    return next(s for s in CHECK_SHAPES if s.name == name and s.dtype == dtype)


@pytest.mark.parametrize("problem", [PROBLEM, BACKWARD], ids=lambda p: p.name)
@pytest.mark.slow
def test_the_default_kernel_passes_every_check_shape(problem, device: torch.device, empty_library) -> None:
    fn = ops.op(problem.name)
    for trial, shape in enumerate(problem.check_shapes):
        result = check_shape(problem, fn, shape, trial, device, repeat=True)
        assert result.ok, (shape.name, shape.dtype, result.message)
    assert DISPATCHER.last[problem.name] == "default"


def _explicit(name: str, dtype: str, tables: list, lengths: list[int]) -> Shape:
    """A shape of given bag lengths (so of a known regime, whatever the seed), one feature a table."""
    return Shape(
        name=name, dtype=dtype, params=dict(tables=tables, batch=len(lengths) // len(tables), lengths=lengths)
    )


# Every branch of the GPU's launch heuristics, by the tile it picks (BLOCK_B, BLOCK_L, BLOCK_D,
# ACC_3D): fp32 pooled, short bags (either dtype), and 2-byte rows pooled. Dims 4 and 200 beside:
# several column blocks a feature, and feature dims that are not multiples of the block.
THREE_TABLES = [[50, 64], [30, 200], [9, 4]]
GPU_BRANCHES = [
    (_explicit("pooled", "fp32", THREE_TABLES, [9, 0, 3, 1, 2, 1, 1, 7, 0, 2, 1, 3]), (16, 2, 64, True)),
    (_explicit("short", "fp32", THREE_TABLES, [1, 0, 3, 1, 2, 1, 1, 1, 0, 2, 1, 3]), (64, 1, 64, False)),
    (_explicit("short", "bf16", THREE_TABLES, [1, 0, 3, 1, 2, 1, 1, 1, 0, 2, 1, 3]), (64, 1, 64, False)),
    (_explicit("pooled-wide", "fp16", [[80, 128], [9, 4]], [12, 0, 5, 2, 3, 1]), (32, 2, 64, False)),
]  # fmt: skip


GPU_BRANCH_IDS = [f"{s.name}-{s.dtype}" for s, _ in GPU_BRANCHES]


@pytest.mark.parametrize(("shape", "tile"), GPU_BRANCHES, ids=GPU_BRANCH_IDS)
def test_the_gpu_launch_configuration_passes_too(
    shape: Shape, tile: tuple, monkeypatch, empty_library
) -> None:
    """Interpreted, the kernels launch few wide programs; the tiles a GPU launches are checked
    here too, forward and backward."""
    forward, backward = module._forward_config, backward_module._backward_config
    picked = []

    def gpu_forward_config(dim, size, ids, interpreted):
        picked.append(forward(dim, size, ids))
        return picked[-1]

    monkeypatch.setattr(module, "_forward_config", gpu_forward_config)
    monkeypatch.setattr(backward_module, "_backward_config", lambda dim, interpreted: backward(dim))
    for problem in (PROBLEM, BACKWARD):
        result = check_shape(problem, ops.op(problem.name), shape, 0, DEVICE)
        assert result.ok, (problem.name, result.message)
    assert [(c["BLOCK_B"], c["BLOCK_L"], c["BLOCK_D"], c["ACC_3D"]) for c in picked] == [tile]


# Bags of up to 90 ids: a block (the four bags of a feature) holds more ids than a chunk of
# the GPU's pooled tiles (32 or 64), so bags span chunks.
SPANNING = [
    (_explicit("spanning", dtype, THREE_TABLES, [70, 0, 3, 90, 1, 2, 33, 1, 0, 65, 2, 1]), None)
    for dtype in ("fp32", "bf16")
]


@pytest.mark.parametrize("form", [{}, {"weighted": True}, {"mode": "mean"}], ids=["sum", "weighted", "mean"])
@pytest.mark.parametrize(
    ("shape", "tile"), GPU_BRANCHES + SPANNING, ids=GPU_BRANCH_IDS + ["spanning-fp32", "spanning-bf16"]
)
def test_flat_chunks_pass_at_the_gpu_tiles(
    shape: Shape, tile: tuple, form: dict, monkeypatch, empty_library
) -> None:
    """FLAT (a block's ids in chunks, summed into bags by a product), at each tile a GPU
    launches: chunks hold several bags, bags span chunks (SPANNING), some are empty; plain
    sums, weighted ones (the weights in the product) and means."""
    forward = module._forward_config

    def gpu_forward_config(dim, size, ids, interpreted):
        return forward(dim, size, ids)

    monkeypatch.setattr(module, "_forward_config", gpu_forward_config)
    monkeypatch.setitem(module.KNOBS, "FLAT", True)
    shape = Shape(name=shape.name, dtype=shape.dtype, params={**shape.params, **form})
    result = check_shape(PROBLEM, ops.op(PROBLEM.name), shape, 0, DEVICE)
    assert result.ok, result.message


def test_flat_chunks_pass_every_check_shape(monkeypatch, empty_library) -> None:
    monkeypatch.setitem(module.KNOBS, "FLAT", True)
    for trial, shape in enumerate(CHECK_SHAPES):
        result = check_shape(PROBLEM, ops.op(PROBLEM.name), shape, trial, DEVICE)
        assert result.ok, (shape.name, shape.dtype, result.message)


def test_flat_takes_the_products_bounds() -> None:
    """The template refuses FLAT with fewer than 16 bags a block (the tensor-core product's
    rows), operands past its limit (a size left to the heuristic counts at its largest), the
    step loop's own knobs, and 16 columns at the heuristic's ids a step; it takes the
    heuristic's tile or one within the bounds."""
    flat = {**TEMPLATE.defaults(), "FLAT": True}
    assert TEMPLATE.constraint(flat) is None
    assert TEMPLATE.constraint({**flat, "BLOCK_B": 16, "BLOCK_L": 4, "BLOCK_D": 64}) is None
    assert "BLOCK_B >= 16" in TEMPLATE.constraint({**flat, "BLOCK_B": 8})
    assert "exceed 8192 elements" in TEMPLATE.constraint({**flat, "BLOCK_L": 32})
    wide = {**flat, "BLOCK_B": 16, "BLOCK_L": 8, "BLOCK_D": 128}
    assert "exceed 8192 elements" in TEMPLATE.constraint(wide)
    assert "ACC_3D" in TEMPLATE.constraint({**flat, "ACC_3D": True})
    assert "num_stages" in TEMPLATE.constraint({**flat, "num_stages": 2})
    assert TEMPLATE.constraint({**flat, "FLAT": False, "BLOCK_B": 8, "ACC_3D": True}) is None
    # At one id a step (the heuristic's, for short bags) an 8-byte block's half of 16 columns is
    # below the product's 16; with BLOCK_L set, whole blocks.
    assert "BLOCK_D >= 32" in TEMPLATE.constraint({**flat, "BLOCK_D": 16})
    assert TEMPLATE.constraint({**flat, "BLOCK_B": 16, "BLOCK_L": 4, "BLOCK_D": 16}) is None


def test_one_order_of_blocks_at_a_time() -> None:
    """SLICES_TOGETHER orders the blocks itself, so BAGS_MAJOR beside it would only repeat a
    point of the search: the template takes it with None alone."""
    together = {**TEMPLATE.defaults(), "SLICES_TOGETHER": True}
    assert TEMPLATE.constraint(together) is None
    for bags_major in (False, True):
        assert "BAGS_MAJOR" in TEMPLATE.constraint({**together, "BAGS_MAJOR": bags_major})
        assert TEMPLATE.constraint({**TEMPLATE.defaults(), "BAGS_MAJOR": bags_major}) is None


@pytest.mark.parametrize("programs", [5, 1])
@pytest.mark.parametrize("vectors", [True, False])
@pytest.mark.parametrize("bags_major", [False, True])
def test_a_persistent_launch_covers_every_block(
    programs: int, vectors: bool, bags_major: bool, monkeypatch, empty_library
) -> None:
    """With the grid capped (the PROGRAMS knob), each program loops over blocks p, p + grid, ...:
    every bag and column still comes out right at the GPU's tiles (many blocks a feature), and
    the blocks of the host's bound past the last feature store nothing; rows moved in vectors or
    an element at a time alike, blocks in either order."""
    forward = module._forward_config

    def gpu_forward_config(dim, size, ids, interpreted):
        return forward(dim, size, ids)

    monkeypatch.setattr(module, "_forward_config", gpu_forward_config)
    monkeypatch.setitem(module.KNOBS, "PROGRAMS", programs)
    monkeypatch.setitem(module.KNOBS, "BAGS_MAJOR", bags_major)
    monkeypatch.setattr(module, "VECTORS", vectors)
    for shape, _ in GPU_BRANCHES:
        result = check_shape(PROBLEM, ops.op(PROBLEM.name), shape, 0, DEVICE)
        assert result.ok, (shape.name, result.message)


@pytest.mark.parametrize("programs", [None, 3])
@pytest.mark.parametrize(
    "order", [{"SLICES_TOGETHER": True}, {"BAGS_MAJOR": True}, {"BAGS_MAJOR": False}], ids=str
)
def test_every_order_of_blocks_covers_every_block(order, programs, monkeypatch, empty_library) -> None:
    """SLICES_TOGETHER numbers a feature's blocks column block fastest (a row's slices read by
    neighbouring programs), BAGS_MAJOR bag block by bag block (each one's features in turn),
    and without either feature by feature (the launch picks between the last two by the
    output's alignment: the bf16 batch's dims, 4 among them, would take BAGS_MAJOR): at the
    GPU's tiles (dims of one to four column blocks, a dim that is not a multiple of the block,
    two to five bag blocks a feature) every bag and column still comes out right, in a grid of
    one program a block and in a persistent one, whose host bound runs past the last feature."""
    forward = module._forward_config

    def gpu_forward_config(dim, size, ids, interpreted):
        return forward(dim, size, ids)

    monkeypatch.setattr(module, "_forward_config", gpu_forward_config)
    for knob, value in order.items():
        monkeypatch.setitem(module.KNOBS, knob, value)
    monkeypatch.setitem(module.KNOBS, "PROGRAMS", programs)
    many_blocks = [
        _explicit("short-150", "fp32", THREE_TABLES, [i * 5 % 4 for i in range(3 * 150)]),  # 64 bags a block
        _explicit("pooled-70", "bf16", THREE_TABLES, [i * 7 % 9 for i in range(3 * 70)]),  # 32 bags a block
    ]
    for shape in many_blocks:
        result = check_shape(PROBLEM, ops.op(PROBLEM.name), shape, 0, DEVICE)
        assert result.ok, (shape.name, result.message)


@pytest.mark.parametrize(
    ("total_dim", "element_size", "bags_major"),
    [
        (2560, 2, False),
        (2564, 2, True),
        (2568, 2, True),
        (2572, 2, True),
        (2576, 2, False),
        (2004, 4, False),
        (2000, 4, False),
    ],
)
def test_blocks_go_bag_block_by_bag_block_where_rows_are_off_sectors(
    total_dim: int, element_size: int, bags_major: bool
) -> None:
    """The launch's block order: in 16-bit types, bag block by bag block where the output's rows
    start off 32-byte sectors (a feature of 4 or 8 bf16 columns moves them by 8 or 16 bytes a
    row), else feature by feature; fp32 keeps the features' order (not timed otherwise)."""
    assert module._bags_major(total_dim, element_size) is bags_major


def test_the_launch_regime_is_the_buckets() -> None:
    """The launcher (self-contained, as a candidate is) keeps its own copy of the bucket's
    short-call threshold: a call it launches as short is in a "-short" bucket."""
    assert module.SHORT_MEAN_IDS == embedding_bags.SHORT_MEAN_IDS


@pytest.mark.gpu
@pytest.mark.parametrize("problem", [PROBLEM, BACKWARD], ids=lambda p: p.name)
@pytest.mark.parametrize("shape", TIMING_SHAPES, ids=[f"{s.name}-{s.dtype}" for s in TIMING_SHAPES])
def test_the_kernels_pass_on_production_sizes(problem, shape: Shape, empty_library) -> None:
    """Tables of 4e8 to 8e8 elements and 64k+ samples: fp32 atomics at real contention, the GPU
    heuristics on the shapes they were chosen for."""
    result = check_shape(problem, ops.op(problem.name), shape, 0, torch.device("cuda"))
    assert result.ok, result.message


PAST_2_TO_THE_31 = Shape(
    name="past-2^31",
    dtype="bf16",
    params=dict(tables=[[2**25 + 1, 64], [10, 128]], batch=64, max_lens=[3, 2], hot_rows=2),
)


@pytest.mark.gpu
def test_element_offsets_past_2_to_the_31(empty_library) -> None:
    """A table of 2^31 + 64 elements (4.3 GB in bf16): ids among its last rows and the table
    after it, whose elements an int32 offset cannot reach."""
    result = check_shape(PROBLEM, ops.op(PROBLEM.name), PAST_2_TO_THE_31, 0, torch.device("cuda"))
    assert result.ok, result.message


@pytest.mark.gpu
def test_gradient_offsets_past_2_to_the_31(empty_library) -> None:
    """The backward at the same shape, its 2^31-element gradient compared with the reference's
    a slice at a time (the sandbox's comparison holds it in fp64 several times: 88 GiB, more
    than an H100 has), the table after the first's 2^31 elements touched."""
    inputs = BACKWARD.make_inputs(PAST_2_TO_THE_31, 0, torch.device("cuda"))
    want = BACKWARD.reference(*inputs.args, **inputs.kwargs)
    got = ops.op(BACKWARD.name)(*inputs.args, **inputs.kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert bool(want[-10 * 128 :].ne(0).any())  # the second table's rows, past 2^31 elements
    tol = BACKWARD.tolerance("bf16")
    for lo in range(0, want.numel(), 1 << 28):
        g, w = got[lo : lo + (1 << 28)].float(), want[lo : lo + (1 << 28)].float()
        outside = int(((g - w).abs() > tol.atol + tol.rtol * w.abs()).sum())
        assert outside == 0, f"{outside} elements outside tolerance from element {lo}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["mixed-dims", "shared-weighted", "empty-bags-mean"])
def test_the_forward_is_the_single_table_op_feature_by_feature(name: str, dtype: str, empty_library) -> None:
    inputs = PROBLEM.make_inputs(_shape(name, dtype), 5, DEVICE)
    weights, weight_offsets, dim_offsets, indices, offsets = inputs.args
    psw, mode = inputs.kwargs["per_sample_weights"], inputs.kwargs["mode"]
    starts, _, cols = metadata_lists(weight_offsets, None, dim_offsets)
    batch = (offsets.numel() - 1) // len(starts)
    out = ops.embedding_bags(*inputs.args, **inputs.kwargs)
    for f, start in enumerate(starts):
        lo, hi = int(offsets[f * batch]), int(offsets[(f + 1) * batch])
        dim = cols[f + 1] - cols[f]
        table = weights[start : start + (weights.numel() - start) // dim * dim].view(-1, dim)
        single = ops.embedding_bag(
            table,
            indices[lo:hi],
            offsets[f * batch : (f + 1) * batch + 1] - lo,
            mode=mode,
            per_sample_weights=None if psw is None else psw[lo:hi],
        )
        torch.testing.assert_close(
            out[:, cols[f] : cols[f + 1]], single, msg=lambda m, f=f: f"feature {f}: {m}"
        )


def _upcast(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().double().requires_grad_()


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: str, what: str) -> None:
    """Within the gradient problem's tolerance (for flat outputs) of the fp64 `want` (the
    sandbox's rule), saying where not."""
    ok, details = compare(got.double(), want, BACKWARD.tolerance(dtype))
    assert ok, f"{what}: {details['message']}"


def _load(source: str, tmp_path: Path, name: str):
    """A kernel module from source text (Triton reads a kernel's source through its module)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded
    spec.loader.exec_module(loaded)
    return loaded


# Kernels one slip away from the default: every feature read from the first table, every
# feature's pooled vector written at column 0, mean bags not divided.
SLIPS = {
    "one-table": (
        "table = tl.load(weight_offsets_ptr + tl.minimum(feature, num_features - 1))",
        "table = tl.load(weight_offsets_ptr)",
    ),
    "no-column-offset": ("* stride_out_row + first_col + cols_D", "* stride_out_row + cols_D"),
    "no-mean": ('MODE_MEAN=mode == "mean",\n        FEATURES', "MODE_MEAN=False,\n        FEATURES"),
}


@pytest.mark.parametrize("slip", SLIPS, ids=list(SLIPS))
def test_the_check_shapes_catch_a_slip(slip: str, tmp_path: Path) -> None:
    old, new = SLIPS[slip]
    source = TEMPLATE.render({})
    assert source.count(old) == 1
    slipped = _load(source.replace(old, new), tmp_path, f"slipped_{slip.replace('-', '_')}")
    assert any(
        not check_shape(PROBLEM, slipped.embedding_bags_forward, s, 0, DEVICE).ok for s in CHECK_SHAPES
    )


def test_knobs_a_search_writes_take_effect(tmp_path: Path) -> None:
    """Both templates' knobs, set: narrow column blocks (several per row) and few ids a step."""
    knobs = {"BLOCK_B": 2, "BLOCK_L": 4, "BLOCK_D": 16, "ACC_3D": True}
    forward = _load(TEMPLATE.render(knobs), tmp_path, "searched_forward")
    grad_template = get_template(BACKWARD.name)
    backward = _load(grad_template.render({"BLOCK_L": 8, "BLOCK_D": 16}), tmp_path, "searched_backward")
    shape = _shape("mixed-dims", "bf16")
    assert check_shape(PROBLEM, forward.embedding_bags_forward, shape, 0, DEVICE).ok
    assert check_shape(BACKWARD, backward.embedding_bags_backward, shape, 0, DEVICE).ok


def test_the_kernel_modules_pass_the_screen() -> None:
    """What a campaign starts from: each problem's template at its defaults."""
    assert screen_problem(TEMPLATE.render({}), "embedding_bags_forward", PROBLEM) == []
    grad_source = get_template(BACKWARD.name).render({})
    assert screen_problem(grad_source, "embedding_bags_backward", BACKWARD) == []


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["shared-weighted", "empty-bags-mean", "hot-rows", "one-row-table"])
def test_gradients_match_autograd_through_the_reference(name: str, dtype: str, empty_library) -> None:
    """Weights (shared tables, repeated rows, the mean's 1/len, the one-row table) and per-sample
    weights, each side on its own leaves; the reference's in fp64."""
    inputs = PROBLEM.make_inputs(_shape(name, dtype), 7, DEVICE)
    weights, *layout = inputs.args
    psw = inputs.kwargs["per_sample_weights"]
    options = {k: v for k, v in inputs.kwargs.items() if k != "per_sample_weights"}
    batch = (layout[-1].numel() - 1) // layout[0].numel()
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(batch, options["total_dim"], generator=gen).to(DEVICE, weights.dtype)

    leaves = [weights.clone().requires_grad_(), None if psw is None else psw.clone().requires_grad_()]
    ops.embedding_bags(leaves[0], *layout, **options, per_sample_weights=leaves[1]).backward(grad_out)
    twins = [_upcast(weights), _upcast(psw)]
    reference(twins[0], *layout, **options, per_sample_weights=twins[1]).backward(grad_out.double())

    for what, got, want in zip(("weights", "per_sample_weights"), leaves, twins, strict=True):
        if got is None:
            continue
        assert got.grad.dtype == got.dtype, what
        _assert_close(got.grad, want.grad, dtype, f"gradient of {what} on {name} {dtype}")


def test_without_triton_the_op_falls_back_to_the_references(empty_library, monkeypatch) -> None:
    """CPU tensors without the interpreter: both ops run their references."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inputs = PROBLEM.make_inputs(_shape("shared-weighted"), 3, torch.device("cpu"))
    weights, *layout = inputs.args
    leaf = weights.clone().requires_grad_()
    out = ops.embedding_bags(leaf, *layout, **inputs.kwargs)
    out.sum().backward()
    assert DISPATCHER.last["embedding_bags"] == "reference"
    assert DISPATCHER.last["embedding_bags_backward"] == "reference"
    twin = weights.clone().requires_grad_()
    reference(twin, *layout, **inputs.kwargs).sum().backward()
    torch.testing.assert_close(leaf.grad, twin.grad)


def test_compiled_matches_eager(empty_library) -> None:
    """The custom op's fake implementation and autograd registration let torch.compile trace a
    caller in one graph; forward and gradients equal the eager ones."""
    inputs = PROBLEM.make_inputs(_shape("shared-weighted"), 2, DEVICE)
    weights, *layout = inputs.args
    psw = inputs.kwargs["per_sample_weights"]
    options = {k: v for k, v in inputs.kwargs.items() if k != "per_sample_weights"}

    def pooled_loss(weights, psw):
        pooled = ops.embedding_bags(weights, *layout, **options, per_sample_weights=psw)
        return pooled, (pooled * pooled).sum()

    results = {}
    for name, fn in [
        ("eager", pooled_loss),
        ("compiled", torch.compile(pooled_loss, backend="aot_eager", fullgraph=True)),
    ]:
        leaves = [weights.clone().requires_grad_(), psw.clone().requires_grad_()]
        pooled, loss = fn(*leaves)
        loss.backward()
        results[name] = [pooled.detach(), *(t.grad for t in leaves)]
    for eager, compiled in zip(results["eager"], results["compiled"], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def _small() -> tuple[tuple, dict]:
    """Two features (dims 4 and 8) over two samples: bags {1}, {}, {0, 2}, {3}."""
    args = (
        torch.randn(40),
        torch.tensor([0, 8]),
        torch.tensor([0, 4, 12]),
        torch.tensor([1, 0, 2, 3]),
        torch.tensor([0, 1, 1, 3, 4]),
    )
    return args, {"total_dim": 12, "max_dim": 8}


def _with(index: int, value) -> tuple:
    args, kwargs = _small()
    return (*args[:index], value, *args[index + 1 :]), kwargs


def _kw(**changes) -> tuple:
    args, kwargs = _small()
    return args, {**kwargs, **changes}


BAD_CALLS = {
    "weights-2d": (lambda: _with(0, torch.randn(5, 8)), r"weights must be an fp32, bf16 or fp16 \[N\]"),
    "weights-strided": (lambda: _with(0, torch.randn(80)[::2]), "every tensor must be contiguous"),
    "weights-int": (lambda: _with(0, torch.arange(40)), "weights must be"),
    "weight-offsets-int32": (
        lambda: _with(1, torch.tensor([0, 8], dtype=torch.int32)),
        "weight_offsets must be an int64",
    ),
    "no-features": (lambda: _with(1, torch.zeros(0, dtype=torch.int64)), "at least one feature"),
    "dim-offsets-short": (
        lambda: _with(2, torch.tensor([0, 4])),
        r"dim_offsets must have F \+ 1 = 3 entries, got 2",
    ),
    "indices-float": (lambda: _with(3, torch.tensor([1.0, 0, 2, 3])), "int32 or int64"),
    "offsets-2d": (lambda: _with(4, torch.tensor([[0, 1, 1, 3, 4]])), r"offsets \[F \* B \+ 1\]"),
    "offsets-not-f-b-plus-one": (
        lambda: _with(4, torch.tensor([0, 1, 3, 4])),
        r"F \* B \+ 1 entries with F = 2, got 4",
    ),
    "offsets-past-nnz": (
        lambda: _with(4, torch.tensor([0, 1, 1, 3, 5])),
        "offsets must rise from 0 to nnz = 4",
    ),
    "id-past-table": (
        lambda: _with(3, torch.tensor([1, 0, 2, 4])),
        "ids must be rows of their feature's table",
    ),
    "dims-decrease": (lambda: _with(2, torch.tensor([0, 12, 4])), "dim_offsets must start at 0 and increase"),
    "bad-mode": (lambda: _kw(mode="max"), "mode must be 'sum' or 'mean'"),
    "total-dim-wrong": (lambda: _kw(total_dim=13), r"dim_offsets\[F\] = 12"),
    "max-dim-wrong": (lambda: _kw(max_dim=4), "the largest dim 8"),
    "psw-with-mean": (
        lambda: _kw(mode="mean", per_sample_weights=torch.ones(4)),
        "only supported with mode='sum'",
    ),
    "psw-wrong-length": (
        lambda: _kw(per_sample_weights=torch.ones(3)),
        r"per_sample_weights must be a floating-point tensor of indices' shape \(4,\)",
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS, ids=list(BAD_CALLS))
def test_bad_arguments_are_named(case: str) -> None:
    make, message = BAD_CALLS[case]
    args, kwargs = make()
    with pytest.raises(ValueError, match=message):
        ops.embedding_bags(*args, **kwargs)


def test_the_small_call_is_right_by_hand(empty_library) -> None:
    """What BAD_CALLS varies is a valid call: its pooled rows, written out."""
    args, kwargs = _small()
    first, second = args[0][:8].view(2, 4), args[0][8:].view(4, 8)
    expected = torch.stack(
        [torch.cat([first[1], second[0] + second[2]]), torch.cat([torch.zeros(4), second[3]])]
    )
    torch.testing.assert_close(ops.embedding_bags(*args, **kwargs), expected)


@settings(max_examples=12, deadline=None, database=None)
@given(
    tables=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 300)), min_size=1, max_size=4),
    data=st.data(),
    batch=st.integers(0, 5),
    dtype=st.sampled_from(["fp32", "bf16"]),
    mode=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
    index_dtype=st.sampled_from(["int32", "int64"]),
)
def test_property_random_layouts_and_lengths(tables, data, batch, dtype, mode, weighted, index_dtype) -> None:
    """Any tables (dims from 1 to 300, one-row ones), features in any order sharing them, empty
    bags and bags over many id steps, against the fp64 reference."""
    features = data.draw(st.lists(st.integers(0, len(tables) - 1), min_size=1, max_size=5))
    lengths = data.draw(
        st.lists(st.integers(0, 40), min_size=len(features) * batch, max_size=len(features) * batch)
    )
    params = dict(tables=tables, features=features, batch=batch, lengths=lengths, mode=mode,
                  weighted=weighted and mode == "sum", index_dtype=index_dtype)  # fmt: skip
    inputs = PROBLEM.make_inputs(Shape(name="hypothesis", dtype=dtype, params=params), 0, DEVICE)
    out = module.embedding_bags_forward(*inputs.args, **inputs.kwargs)
    weights, *layout = inputs.args
    psw = inputs.kwargs["per_sample_weights"]
    options = {k: v for k, v in inputs.kwargs.items() if k != "per_sample_weights"}
    ref = reference(
        weights.double(), *layout, **options, per_sample_weights=None if psw is None else psw.double()
    )
    ok, details = compare(out.double(), ref, PROBLEM.tolerance(dtype))
    assert ok, f"{params}: {details['message']}"


# Compiles every launch of both kernels for an H100/H200 with Triton's real compiler, in the GPU's
# launch configuration (tests/kernels/cuda_compile.py compiles what a launcher picks for DEVICE
# tensors: here the interpreter's few wide programs).
COMPILE_GPU_LAUNCHES = """
import json
import cuda_compile
import kernels.embedding_bags as module
import kernels.embedding_bags_backward as backward_module
forward, backward = module._forward_config, backward_module._backward_config
module._forward_config = lambda dim, size, ids, interpreted=False: forward(dim, size, ids)
backward_module._backward_config = lambda dim, interpreted=False: backward(dim)
print(json.dumps(cuda_compile.main(["embedding_bags", "embedding_bags_backward"])))
"""


# (A persistent launch, the PROGRAMS knob, compiles the same kernel: the knob sets the grid alone.)
@pytest.mark.slow
def test_every_gpu_launch_compiles_for_sm90() -> None:
    report = in_subprocess(COMPILE_GPU_LAUNCHES)
    assert report["failed"] == [], report["failed"]
    assert report["compiled"] == [
        "kernels.embedding_bags._embedding_bags_fwd_kernel",
        "kernels.embedding_bags_backward._embedding_bags_bwd_kernel",
    ]


# Compiles the forward and backward for sm_90 as a launch of bf16 tensors (16-byte aligned
# pointers) specializes them, and reports which global memory instructions their PTX holds.
VECTOR_PTX = """
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.embedding_bags as module
import kernels.embedding_bags_backward as backward_module

def memory_ops(fn, types, constexprs, warps):
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps, "num_stages": 1}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return sorted(set(re.findall(r"\\b(?:(?:ld|st|red|atom)\\.global|mma)[\\w.]*", kernel.asm["ptx"])))

fwd_types = {n: "*i64" for n in ("weight_offsets_ptr", "dim_offsets_ptr", "indices_ptr", "offsets_ptr")}
fwd_types |= {"weights_ptr": "*bf16", "psw_ptr": "*bf16", "out_ptr": "*bf16"}
tile = dict(BLOCK_B=64, BLOCK_L=1, BLOCK_D=64, ACC_3D=False)
fwd = dict(HAS_PSW=False, MODE_MEAN=False, FEATURES=32, EVICT_ROWS="", NUM_STAGES=1, FLAT=False, **tile)
fwd["SLICES_TOGETHER"] = False
fwd["BAGS_MAJOR"] = False
fwd["SLICE_D"] = 8
bwd_types = {n: "*i64" for n in ("weight_offsets_ptr", "dim_offsets_ptr", "indices_ptr", "offsets_ptr")}
bwd_types |= {"grad_out_ptr": "*bf16", "psw_ptr": "*bf16", "grad_ptr": "*fp32"}
bwd = dict(HAS_PSW=False, MODE_MEAN=False, BLOCK_L=16, BLOCK_D=128, SLICE_D=32)
report = {
    f"{name} VEC={vec}": memory_ops(fn, types, {**consts, "VEC": vec}, warps)
    for name, fn, types, consts, warps in (
        ("forward", module._embedding_bags_fwd_kernel, fwd_types, fwd, 2),
        ("backward", backward_module._embedding_bags_bwd_kernel, bwd_types, bwd, 4),
    )
    for vec in (1, 8)
}
flat = {**fwd, "FLAT": True, "BLOCK_B": 32, "BLOCK_L": 2, "HAS_PSW": True, "VEC": 8, "SLICE_D": 16}
report["flat forward VEC=8"] = memory_ops(module._embedding_bags_fwd_kernel, fwd_types, flat, 2)
together = {**fwd, "SLICES_TOGETHER": True, "VEC": 8}
report["together forward VEC=8"] = memory_ops(module._embedding_bags_fwd_kernel, fwd_types, together, 2)
bags_major = {**fwd, "BAGS_MAJOR": True, "VEC": 8}
report["bags-major forward VEC=8"] = memory_ops(module._embedding_bags_fwd_kernel, fwd_types, bags_major, 2)
print(json.dumps(report))
"""


@pytest.mark.slow
def test_aligned_rows_compile_to_16_byte_vectors() -> None:
    """The dims and offsets come from memory, so only the kernels' alignment test lets the
    compiler move rows in 16-byte vectors (v4 of 32 bits; the backward's fp32 atomic adds four
    at a time): with it (VEC 8 for bf16) the PTX holds them, without it (VEC 1) it does not.
    The FLAT forward compiles for sm_90 too, its sums on the tensor cores, and so does the
    forward whose blocks take a row's slices together (SLICES_TOGETHER), or go bag block by bag
    block (BAGS_MAJOR), its rows in vectors."""
    report = in_subprocess(VECTOR_PTX)
    for name in ("forward", "backward"):
        assert not any(".v4." in op for op in report[f"{name} VEC=1"]), report
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= set(report["forward VEC=8"]), report
    backward = report["backward VEC=8"]
    assert any(op.startswith("red.global") and op.endswith(".v4.f32") for op in backward), report
    # FLAT, weighted: rows in vectors too, summed into bags by TF32 tensor-core products.
    flat = report["flat forward VEC=8"]
    assert "ld.global.v4.b32" in flat and any(op.startswith("mma") and ".tf32" in op for op in flat), report
    for order in ("together", "bags-major"):
        assert {"ld.global.v4.b32", "st.global.v4.b32"} <= set(report[f"{order} forward VEC=8"]), report


KERNEL_REGISTERS = """
import json
import kernels.embedding_bags as module
import kernels.embedding_bags_backward as backward_module
from evals.studies.registers import LOOKUP_TYPES, aligned_only, backward_launch, compile_report, lookup_launch

aligned = aligned_only(module)  # every block's rows in vectors
backward_aligned = aligned_only(backward_module)
report = {}
for dtype, size in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
    if dtype != "fp32":  # fp32's misaligned blocks stay whole (_slice_d)
        types = LOOKUP_TYPES | {n: "*" + dtype for n in ("weights_ptr", "psw_ptr", "out_ptr")}
        for mean_ids in (1.5, 20.0):  # the short tile, then the pooled one
            constexprs, warps = lookup_launch(size, mean_ids)
            report[f"{dtype} {mean_ids} ids"] = [
                compile_report(m._embedding_bags_fwd_kernel, types, constexprs, warps)[0]
                for m in (module, aligned)
            ]
    types = LOOKUP_TYPES | {"grad_out_ptr": "*" + dtype, "psw_ptr": "*" + dtype, "grad_ptr": "*fp32"}
    constexprs, warps = backward_launch(size)
    report[f"{dtype} backward"] = [
        compile_report(m._embedding_bags_bwd_kernel, types, constexprs, warps)[0]
        for m in (backward_module, backward_aligned)
    ]
print(json.dumps(report))
"""


@pytest.mark.slow
def test_the_misaligned_paths_keep_the_kernels_registers_in_bounds() -> None:
    """A kernel holds the registers of its costlier path, and the forward's misaligned blocks
    (rows an element at a time) once took nearly twice its aligned blocks' (235 against 128 a
    thread at the short bf16 tile, Triton 3.9), halving the programs an SM holds at every call; the
    backward's, 53 against 28. In column slices (SLICE_D) they take about the aligned path's,
    at each default GPU tile as the launch picks it: the kernel's registers (ptxas, sm_90) are
    within 8 of the same kernel's without those paths (aligned_only). (fp32's forward keeps its
    misaligned blocks whole, as measured faster: kernels.embedding_bags._slice_d.)

    The 2-byte forward tiles' 8-byte paths take more under this compiler, and have a ceiling of
    their own instead: this compiler's figure for paths measured on an H100 (BENCHMARKS.md,
    2026-12-07), so that a rise past it still fails.
    - The pooled tile's 8-byte path (rows of 8-byte alignment, the whole block) takes 168
      registers against 128 under this Triton (3.9), and 128 against 126 under the GPU hosts'
      (3.6, evals/studies/registers.py). Half blocks (162 here) ran 1.35x as fast as
      quarter-block slices (128 here), and whole blocks as fast as half blocks or faster.
    - The short tile's path for 16-byte rows with 8-byte output starts (a dim-4 feature before
      them) takes 168 against 128 here, and 166 against 168 under 3.6. A batch with a dim-4
      feature ran 1.14x; the aligned short shapes, 0.975x and 0.98x (device time)."""
    report = in_subprocess(KERNEL_REGISTERS)
    assert len(report) == 7, report
    own = {f"{dtype} {ids} ids": 168 for dtype in ("bf16", "fp16") for ids in (1.5, 20.0)}
    for tile, (regs, aligned_only) in report.items():
        assert regs <= max(aligned_only + 8, own.get(tile, 0)), (tile, report)
