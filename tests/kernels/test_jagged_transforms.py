"""The jagged transforms (search_space/<op>.py, kernels/<op>.py), in pairs that are each
other's gradient: jagged_to_padded_dense and dense_to_jagged, jagged_concat and jagged_split.
The public ops against their references on every check shape (both offset dtypes, truncation,
empty sequences, widths that are no power of two), their baselines, gradients, the custom ops'
registration, argument errors, the sandbox's verdict on the default kernels and on a kernel
that pads with the wrong value, and the launch tiles: the default's at every width, and the
tiles a search writes."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import torch
import triton

from kernels import ops
from sandbox import Candidate, LocalBackend, Status, isolation
from sandbox.protocol import check_shape
from search_space import get_problem
from search_space.jagged_transforms import GPU_BLOCK_D, GPU_ROWS, lengths_of, padded_len
from search_space.problem import Shape
from search_space.template import get_template, knob_values

OPS = ("jagged_to_padded_dense", "dense_to_jagged")
ALL = (*OPS, "jagged_concat", "jagged_split")


def _equal(got, expected) -> bool:
    if isinstance(expected, tuple):
        return isinstance(got, tuple) and len(got) == len(expected) and all(map(_equal, got, expected))
    return got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)


CPU = torch.device("cpu")


def _cases(name: str):
    problem = get_problem(name)
    for shape in (*problem.check_shapes, *problem.interpreted_timing_shapes):
        # int64 offsets on even seeds, int32 on odd; concat and split mix them on seeds 2 and 3
        for seed in (0, 1, 3) if name in ("jagged_concat", "jagged_split") else (0, 1):
            yield pytest.param(name, shape, seed, id=f"{name}-{shape.name}-{shape.dtype}-{seed}")


@pytest.mark.parametrize(("name", "shape", "seed"), [c for n in ALL for c in _cases(n)])
def test_the_op_is_its_reference_exactly(name, shape, seed) -> None:
    problem = get_problem(name)
    inputs = problem.make_inputs(shape, seed, CPU)
    expected = problem.reference(*inputs.args, **inputs.kwargs)
    assert _equal(ops.op(name)(*inputs.args, **inputs.kwargs), expected)
    # torch's dense_to_jagged refuses sequences longer than N (no timing shape has one).
    if name != "dense_to_jagged" or max(lengths_of(shape, seed), default=0) <= padded_len(shape):
        (baseline,) = problem.baselines.values()
        assert _equal(baseline(*inputs.args, **inputs.kwargs), expected)


def test_padding_truncation_and_the_round_trip() -> None:
    values = torch.arange(10.0).repeat_interleave(2).view(10, 2)
    offsets = torch.tensor([0, 3, 3, 10])
    dense = ops.jagged_to_padded_dense(values, offsets, max_len=4, padding_value=-1.0)
    assert dense.shape == (3, 4, 2)
    assert dense[0, :, 0].tolist() == [0.0, 1.0, 2.0, -1.0]
    assert dense[1, :, 0].tolist() == [-1.0] * 4
    assert dense[2, :, 0].tolist() == [3.0, 4.0, 5.0, 6.0]  # rows 7, 8, 9 are past max_len
    back = ops.dense_to_jagged(dense, offsets, total=10)
    assert back[:7].equal(values[:7]) and back[7:].eq(0).all()  # dropped rows come back as zeros
    full = ops.jagged_to_padded_dense(values, offsets, max_len=7)
    assert ops.dense_to_jagged(full, offsets.int(), total=10).equal(values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_each_others_op(dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    offsets = torch.tensor([0, 5, 5, 6, 19])
    values = torch.randn(19, 24, generator=gen).to(dtype).requires_grad_()
    grad_out = torch.randn(4, 8, 24, generator=gen).to(dtype)
    j2pd, d2j = get_problem(OPS[0]).reference, get_problem(OPS[1]).reference
    (expected,) = torch.autograd.grad(j2pd(values, offsets, max_len=8), values, grad_out)
    (got,) = torch.autograd.grad(ops.jagged_to_padded_dense(values, offsets, max_len=8), values, grad_out)
    assert got.equal(expected) and got[14:].eq(0).all()  # sequence 3 past its 8th row gets none
    dense = torch.randn(4, 8, 24, generator=gen).to(dtype).requires_grad_()
    grad_rows = torch.randn(19, 24, generator=gen).to(dtype)
    (expected,) = torch.autograd.grad(d2j(dense, offsets, total=19), dense, grad_rows)
    (got,) = torch.autograd.grad(ops.dense_to_jagged(dense, offsets, total=19), dense, grad_rows)
    assert got.equal(expected)
    # An expanded gradient (of a sum: stride 0 everywhere) and a strided input.
    wide = torch.randn(19, 48, generator=gen).to(dtype)
    strided = wide[:, ::2].detach().requires_grad_()  # row stride 48, column stride 2
    ops.jagged_to_padded_dense(strided, offsets, max_len=8).sum().backward()
    assert strided.grad.equal(torch.cat([torch.ones(14, 24), torch.zeros(5, 24)]).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_concat_and_split_are_each_others_gradient(dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    first_offsets, second_offsets = torch.tensor([0, 4, 4, 9]), torch.tensor([0, 2, 5, 5])
    first = torch.randn(9, 12, generator=gen).to(dtype).requires_grad_()
    second = torch.randn(5, 12, generator=gen).to(dtype).requires_grad_()
    grad_out = torch.randn(14, 12, generator=gen).to(dtype)
    concat, split = get_problem("jagged_concat").reference, get_problem("jagged_split").reference
    expected = torch.autograd.grad(
        concat(first, first_offsets, second, second_offsets), (first, second), grad_out
    )
    got = torch.autograd.grad(
        ops.jagged_concat(first, first_offsets, second, second_offsets), (first, second), grad_out
    )
    assert _equal(tuple(got), tuple(expected))
    values = ops.jagged_concat(first, first_offsets, second, second_offsets).detach().requires_grad_()
    offsets = first_offsets + second_offsets
    head, tail = ops.jagged_split(values, offsets, first_offsets, first_total=9)
    assert _equal((head, tail), (first.detach(), second.detach()))
    grads = torch.randn(9, 12, generator=gen).to(dtype), torch.randn(5, 12, generator=gen).to(dtype)
    (expected,) = torch.autograd.grad(split(values, offsets, first_offsets, first_total=9), values, grads)
    (got,) = torch.autograd.grad((head, tail), values, grads)
    assert _equal(got, expected)
    # Only one part differentiated: the other's rows get zeros, in both paths.
    (only_tail,) = torch.autograd.grad(
        ops.jagged_split(values, offsets, first_offsets, first_total=9)[1], values, grads[1]
    )
    from_first = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    assert only_tail[from_first].eq(0).all() and only_tail[~from_first].equal(grads[1])
    custom = ops.jagged_split.custom_op
    (via_custom,) = torch.autograd.grad(custom(values, offsets, first_offsets, 9)[1], values, grads[1])
    assert via_custom.equal(only_tail)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.slow
def test_the_custom_op_checks_out(name) -> None:
    problem = get_problem(name)
    inputs = problem.make_inputs(problem.check_shapes[0], 0, CPU)
    fn = ops.op(name)
    args = tuple(inputs.args) + tuple(inputs.kwargs.values())
    args = (args[0].clone().requires_grad_(), *args[1:])
    torch.library.opcheck(fn.custom_op, args)


def test_bad_arguments_are_named() -> None:
    values, offsets = torch.randn(6, 4), torch.tensor([0, 2, 6])
    with pytest.raises(ValueError, match=r"values must be \[T, D\]"):
        ops.jagged_to_padded_dense(values.view(6, 2, 2), offsets, max_len=3)
    with pytest.raises(ValueError, match="offsets must be an int32 or int64"):
        ops.jagged_to_padded_dense(values, offsets.float(), max_len=3)
    with pytest.raises(ValueError, match="max_len must be >= 0"):
        ops.jagged_to_padded_dense(values, offsets, max_len=-1)
    dense = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"offsets must have B \+ 1 = 3 entries, got 4"):
        ops.dense_to_jagged(dense, torch.tensor([0, 1, 2, 6]), total=6)
    with pytest.raises(ValueError, match=r"dense must be \[B, N, D\]"):
        ops.dense_to_jagged(values, offsets, total=6)
    with pytest.raises(ValueError, match="first and second must share D and dtype"):
        ops.jagged_concat(values, offsets, torch.randn(6, 3), offsets)
    with pytest.raises(ValueError, match=r"offsets must have B \+ 1 = 3 entries, got 2"):
        ops.jagged_concat(values, offsets, values, offsets[:2])
    with pytest.raises(ValueError, match=r"first_total must be in \[0, T = 6\], got 7"):
        ops.jagged_split(values, offsets, offsets, first_total=7)


@pytest.mark.slow
@pytest.mark.skipif(isolation.bwrap_works() is not None, reason=f"no sandbox: {isolation.bwrap_works()}")
def test_the_sandbox_accepts_the_defaults_and_refuses_the_wrong_padding(tmp_path) -> None:
    backend = LocalBackend(timeout_s=240, scratch_root=tmp_path)
    for name in ALL:
        template = get_template(name)
        result = backend.evaluate(Candidate(problem=name, source=template.render({}), entry=template.entry))
        assert result.status == Status.OK, f"{name}: {result.message}\n{result.log_tail}"
        assert result.timings and all(t.candidate.median_us > 0 for t in result.timings)
    template = get_template(OPS[0])
    source = template.render({}).replace("other=padding_value", "other=0.0")
    assert source != template.render({})
    result = backend.evaluate(Candidate(problem=OPS[0], source=source, entry=template.entry), timing=False)
    assert result.status == Status.WRONG and "edges" in result.message, result.message


def test_host_copies_of_the_data_count_as_computing_a_jagged_transform() -> None:
    """These ops are copies: host code that copies or fills floating-point data does the op
    itself (and would pass the no-op proof beside a kernel doing a sliver of it), so the watch
    reports it for them, and still lets host code allocate and compute on offsets."""
    from sandbox import host_ops

    assert all(get_problem(name).host_copies_compute for name in ALL)
    values, out = torch.randn(6, 4), torch.empty(6, 4)
    for copies_compute, expected in ((False, None), (True, "aten.copy_.default on float32")):
        with host_ops.watching(True, copies_compute=copies_compute) as watch:
            torch.empty(3, 4)
            torch.tensor([0, 2, 6]).cumsum(0)
            out.copy_(values)
        assert watch.first == expected
    with host_ops.watching(True, copies_compute=True) as watch:
        values.new_full((2, 3), 0.5)
    assert watch.first == "aten.new_full.default on float32"


# --- launch tiles: the default's (knobs None) and the tiles a search writes -------------------

MODULES = {name: importlib.import_module(f"kernels.{name}") for name in ALL}
ROWS = {name: get_template(name).knobs[0].name for name in ALL}  # BLOCK_L or BLOCK_T
# Widths around every power of two up to 512, and a few between.
WIDTHS = (1, 2, 3, 5, 7, 8, 9, 15, 17, 24, 31, 33, 48, 63, 65, 100, 127, 129, 200, 255, 257, 300, 513)


def _parts_shape(dim: int, dtype: str) -> Shape:
    """Every op's inputs from one shape: empty, short and truncated sequences (padded_len 24)
    and second parts of uneven lengths."""
    return Shape.of(
        f"d{dim}", dtype, dim=dim, lengths=[0, 3, 40, 1, 17], second=[2, 0, 5, 1, 3], padded_len=24
    )


def test_the_four_kernels_share_one_launch_tile() -> None:
    """Each module is self-contained, so each has its own copy of _tile: the same one."""
    sources = {inspect.getsource(module._tile) for module in MODULES.values()}
    assert len(sources) == 1


def test_a_gpu_launch_takes_the_tile_the_template_counts_knobs_left_none_as() -> None:
    """The template's constraint counts a None as the GPU's tile (GPU_ROWS x GPU_BLOCK_D): the
    tile every module launches, whatever the width."""
    for module in MODULES.values():
        for itemsize in (2, 4):
            assert module._tile(None, 100, itemsize, 10**6, False) == (GPU_ROWS, GPU_BLOCK_D, 4)


@pytest.mark.parametrize("itemsize", [2, 4])
def test_the_interpreted_tile_covers_every_width(itemsize: int) -> None:
    """Every width from 1 to 600: BLOCK_D covers the row (8 KB at the most), the rows fill a
    256 KB tile, and no more rows than the grid has."""
    tile = MODULES["dense_to_jagged"]._tile
    for extent in (1, 5, 37, 10**6):
        most_rows = min(256, triton.next_power_of_2(extent))
        for dim in range(1, 601):
            rows, block_d, num_warps = tile(None, dim, itemsize, extent, True)
            where = f"dim {dim}, {itemsize}-byte, extent {extent}: {rows} x {block_d} on {num_warps} warps"
            assert block_d == min(triton.next_power_of_2(dim), 8192 // itemsize), where
            assert rows == triton.next_power_of_2(rows) and rows <= most_rows, where
            # The rows fill the tile, unless there are no more of them to take.
            assert rows * block_d * itemsize == 262144 or rows == most_rows, where
            assert num_warps in (1, 2, 4, 8), where


def test_set_knobs_override_the_launch_tile(monkeypatch) -> None:
    module = MODULES["jagged_concat"]
    monkeypatch.setitem(module.KNOBS, "BLOCK_D", 32)
    assert module._tile(None, 64, 4, 10**6, False) == (32, 32, 4)
    assert module._tile(16, 64, 4, 10**6, False) == (16, 32, 4)
    assert module._tile(None, 64, 4, 10**6, True) == (256, 32, 8)  # interpreted: the rows fill the tile
    monkeypatch.setitem(module.KNOBS, "num_warps", 8)
    assert module._tile(16, 64, 4, 10**6, False) == (16, 32, 8)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ALL)
def test_the_launch_tiles_are_exact_at_every_width(name: str, dtype: str, monkeypatch) -> None:
    """The interpreted tile (whole rows), and the tile a GPU launches, set as knobs: several
    column blocks a row, the last one partly masked, at widths of no power of two."""
    problem, module = get_problem(name), MODULES[name]
    names = (ROWS[name], "BLOCK_D", "num_warps")
    for dim in WIDTHS:
        inputs = problem.make_inputs(_parts_shape(dim, dtype), dim, CPU)
        expected = problem.reference(*inputs.args, **inputs.kwargs)
        monkeypatch.setattr(module, "KNOBS", dict.fromkeys(names))
        gpu_tile = module._tile(None, dim, inputs.args[0].element_size(), 10**6, False)
        for knobs in (dict.fromkeys(names), dict(zip(names, gpu_tile, strict=True))):
            monkeypatch.setattr(module, "KNOBS", knobs)
            got = getattr(module, name)(*inputs.args, **inputs.kwargs)
            assert _equal(got, expected), f"dim {dim}, knobs {knobs}"


# Knob values a search may write: each alone, and with the others None.
SEARCHED = (
    {"BLOCK_D": 32},
    {"rows": 8, "BLOCK_D": 64, "num_warps": 2},
    {"rows": 16, "num_warps": 1},
    {"rows": 64, "BLOCK_D": 256, "num_warps": 8},
)


@pytest.mark.parametrize("name", ALL)
def test_a_searched_tile_renders_and_checks_out(name: str, monkeypatch) -> None:
    """The template's default is the module itself (knobs None); a rendering differs from it
    only in its KNOBS, whose values the module then runs with."""
    template, problem, module = get_template(name), get_problem(name), MODULES[name]
    assert template.defaults() == {ROWS[name]: None, "BLOCK_D": None, "num_warps": None}
    assert template.render({}) == Path(module.__file__).read_text()
    shapes = [s for s in problem.check_shapes if s.name in ("edges", "wide", "single")]
    for searched in SEARCHED:
        knobs = template.validate({ROWS[name] if k == "rows" else k: v for k, v in searched.items()})
        assert knob_values(template.render(knobs)) == knobs
        monkeypatch.setattr(module, "KNOBS", knobs)
        for shape in shapes:
            check = check_shape(problem, getattr(module, name), shape, 0, CPU)
            assert check.ok, f"{knobs} at {shape.describe()}"


@pytest.mark.parametrize("name", ALL)
def test_the_tile_constraint_bounds_set_tiles(name: str) -> None:
    template, rows = get_template(name), ROWS[name]
    assert template.validate({rows: 128, "BLOCK_D": 128})[rows] == 128  # 16384 elements
    with pytest.raises(ValueError, match="a tile of more than 16384 elements"):
        template.validate({rows: 128, "BLOCK_D": 256})
