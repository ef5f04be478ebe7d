"""The table-batched embedding-bag problems: the reference on hand-computed numbers and against
torch's per-feature lookup, the gradient's reference against autograd, the inputs, the roofline
counts, the buckets, what the check shapes cover and how realistic the timing shapes are, and
the knob template."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from search_space import embedding_bags, get_problem
from search_space.embedding_bags import (
    CHECK_SHAPES,
    TEMPLATE,
    TIMING_SHAPES,
    call_bucket,
    call_cost,
    layout_of,
    per_sample_weights_grad,
    reference,
    torch_embedding_bag_per_feature,
)
from search_space.embedding_bags_backward import TEMPLATE as GRAD_TEMPLATE
from search_space.problem import Shape
from search_space.template import knob_values

PROBLEM = get_problem("embedding_bags")
BACKWARD = get_problem("embedding_bags_backward")
CPU = torch.device("cpu")

# Table 0: 3 rows of 2; table 1: 2 rows of 3. Features 0 and 2 read table 0, feature 1 table 1;
# two samples. Bags, feature-major: f0 {2, 0} {}; f1 {1} {0, 1}; f2 {} {1}.
WEIGHTS = torch.arange(12, dtype=torch.float32)  # table 0 rows [0 1] [2 3] [4 5]; table 1 [6 7 8] [9 10 11]
WEIGHT_OFFSETS = torch.tensor([0, 6, 0])
DIM_OFFSETS = torch.tensor([0, 2, 5, 7])
INDICES = torch.tensor([2, 0, 1, 0, 1, 1])
OFFSETS = torch.tensor([0, 2, 2, 3, 5, 5, 6])
OPTIONS = {"total_dim": 7, "max_dim": 3}


def _call(**kwargs) -> torch.Tensor:
    return reference(WEIGHTS, WEIGHT_OFFSETS, DIM_OFFSETS, INDICES, OFFSETS, **OPTIONS, **kwargs)


def test_reference_by_hand() -> None:
    expected = torch.tensor(
        [
            [4.0 + 0, 5 + 1, 9, 10, 11, 0, 0],  # f0: rows 2 + 0; f1: row 1; f2: empty
            [0, 0, 6 + 9, 7 + 10, 8 + 11, 2, 3],  # f0: empty; f1: rows 0 + 1; f2: row 1
        ]
    )
    torch.testing.assert_close(_call(), expected, rtol=0, atol=0)
    mean = expected.clone()
    mean[0, :2] /= 2
    mean[1, 2:5] /= 2
    torch.testing.assert_close(_call(mode="mean"), mean)  # an empty bag's mean is 0
    psw = torch.tensor([0.5, 2.0, -1.0, 1.0, 3.0, 0.25])
    weighted = torch.tensor(
        [[2.0 + 0, 2.5 + 2, -9, -10, -11, 0, 0], [0, 0, 6 + 27, 7 + 30, 8 + 33, 0.5, 0.75]]
    )
    torch.testing.assert_close(_call(per_sample_weights=psw), weighted, rtol=0, atol=0)


def test_reference_returns_the_tables_dtype() -> None:
    weights = WEIGHTS.bfloat16()
    assert (
        reference(weights, WEIGHT_OFFSETS, DIM_OFFSETS, INDICES, OFFSETS, **OPTIONS).dtype == torch.bfloat16
    )
    assert _call().dtype == torch.float32


@pytest.mark.parametrize("shape", [s for s in CHECK_SHAPES if s.dtype == "fp32"], ids=lambda s: s.name)
def test_reference_is_torchs_per_feature_lookup(shape: Shape) -> None:
    inputs = PROBLEM.make_inputs(shape, 4, CPU)
    torch.testing.assert_close(
        reference(*inputs.args, **inputs.kwargs),
        torch_embedding_bag_per_feature(*inputs.args, **inputs.kwargs),
    )


@pytest.mark.parametrize("name", ["shared-weighted", "empty-bags-mean", "hot-rows"])
def test_gradient_references_are_autograd_of_the_forwards(name: str) -> None:
    """The dense gradient's reference and the per-sample weights' formula, against autograd
    through the forward reference, in fp64."""
    shape = next(s for s in BACKWARD.check_shapes if s.name == name and s.dtype == "fp32")
    inputs = BACKWARD.make_inputs(shape, 5, CPU)
    grad_out, weight_offsets, dim_offsets, indices, offsets, num_elements = inputs.args
    kwargs = inputs.kwargs
    weights = PROBLEM.make_inputs(shape, 5, CPU).args[0].double().requires_grad_()
    psw = kwargs["per_sample_weights"]
    psw = None if psw is None else psw.double().requires_grad_()
    options = {k: v for k, v in kwargs.items() if k != "per_sample_weights"}
    layout = (weight_offsets, dim_offsets, indices, offsets)
    reference(weights, *layout, **options, per_sample_weights=psw).backward(grad_out.double())
    got = BACKWARD.reference(grad_out.double(), *layout, num_elements, **options, per_sample_weights=psw)
    torch.testing.assert_close(got, weights.grad)
    if psw is not None:
        by_formula = per_sample_weights_grad(grad_out, weights.detach(), *layout, options["max_dim"])
        torch.testing.assert_close(by_formula.double(), psw.grad, rtol=1e-5, atol=1e-5)


# --- inputs -----------------------------------------------------------------------------------


def _shape(dtype: str = "fp32", **params) -> Shape:
    return Shape(name="t", dtype=dtype, params=params)


@pytest.mark.parametrize(("dtype", "index_dtype"), [("fp32", "int64"), ("bf16", "int32")])
def test_make_inputs_lays_the_tables_out(dtype: str, index_dtype: str) -> None:
    shape = _shape(dtype, tables=[[5, 4], [3, 8]], features=[1, 0, 1], batch=2, lengths=[1, 2, 0, 3, 1, 1],
                   weighted=True, index_dtype=index_dtype)  # fmt: skip
    inputs = PROBLEM.make_inputs(shape, 0, CPU)
    weights, weight_offsets, dim_offsets, indices, offsets = inputs.args
    assert weights.shape == (5 * 4 + 3 * 8,) and weights.dtype == shape.torch_dtype
    assert weight_offsets.tolist() == [20, 0, 20] and dim_offsets.tolist() == [0, 8, 12, 20]
    assert offsets.tolist() == [0, 1, 3, 3, 6, 7, 8] and offsets.dtype == indices.dtype
    assert indices.dtype == embedding_bags.INDEX_DTYPES[index_dtype]
    assert indices[:3].max() < 3 and indices[3:6].max() < 5 and indices[6:].max() < 3
    psw = inputs.kwargs.pop("per_sample_weights")
    assert psw.shape == (8,) and psw.dtype == shape.torch_dtype
    assert inputs.kwargs == {"total_dim": 20, "max_dim": 8, "mode": "sum"}


def test_make_inputs_hot_rows_and_power_law_lengths() -> None:
    shape = _shape(tables=[[100, 16], [1, 4]], batch=64, max_lens=[5, 1], hot_rows=2, mode="mean")
    _, _, _, indices, offsets = PROBLEM.make_inputs(shape, 1, CPU).args
    lengths = offsets.diff()
    assert lengths[:64].min() >= 1 and lengths[:64].max() <= 5 and lengths[64:].eq(1).all()
    hot, one_row = indices[: int(offsets[64])], indices[int(offsets[64]) :]
    assert set(hot.tolist()) <= {98, 99} and one_row.eq(0).all()


@pytest.mark.parametrize("shape", CHECK_SHAPES, ids=lambda s: f"{s.name}-{s.dtype}")
def test_make_inputs_deterministic_per_seed(shape: Shape) -> None:
    first = PROBLEM.make_inputs(shape, 1234, CPU).tensors()
    again = PROBLEM.make_inputs(shape, 1234, CPU).tensors()
    other = PROBLEM.make_inputs(shape, 1235, CPU).tensors()
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])


# --- roofline counts --------------------------------------------------------------------------


def test_flops_and_bytes_by_hand() -> None:
    shape = _shape(
        "bf16", tables=[[5, 4], [3, 8]], features=[1, 0], batch=2, lengths=[1, 2, 0, 3], weighted=True
    )
    # Feature 0 (dim 8) gathers 3 rows, feature 1 (dim 4) 3 rows: 36 elements, nnz 6, F = 2, B = 2.
    assert PROBLEM.flops(shape) == 36 * 2
    expected = (
        36 * 2  # gathered rows
        + 6 * 8  # ids
        + 5 * 8  # offsets (F * B + 1)
        + 5 * 8  # weight_offsets and dim_offsets (2 F + 1)
        + 6 * 2  # per-sample weights
        + 2 * 12 * 2  # output [B, total_dim]
    )
    assert PROBLEM.bytes(shape) == pytest.approx(expected)
    assert BACKWARD.bytes(shape) == pytest.approx(expected + (20 + 24) * 2)  # the dense gradient


@pytest.mark.parametrize("shape", [s for s in CHECK_SHAPES if "lengths" in s.params], ids=lambda s: s.name)
def test_a_calls_cost_is_its_shapes_count(shape: Shape) -> None:
    """Given lengths make the shape's counts exact: a call drawn from it costs the same."""
    inputs = PROBLEM.make_inputs(shape, 0, CPU)
    flops, moved = call_cost(*inputs.args, **inputs.kwargs)
    assert flops == PROBLEM.flops(shape) and moved == pytest.approx(PROBLEM.bytes(shape))


# --- buckets ----------------------------------------------------------------------------------


def test_buckets_separate_short_calls_from_pooled_ones_alike_for_shapes_and_calls() -> None:
    """One bucket function: a timing shape and a call drawn from it (smaller tables, fewer
    samples) fall in the same bucket; short-only batches in another than mixed ones."""
    for shape in TIMING_SHAPES:
        params = {**shape.params, "batch": 4096, "tables": [[1000, dim] for _, dim in shape.params["tables"]]}
        inputs = PROBLEM.make_inputs(Shape(name=shape.name, dtype=shape.dtype, params=params), 3, CPU)
        _, _, _, indices, offsets = inputs.args
        assert PROBLEM.bucket(shape) == call_bucket(inputs.kwargs["max_dim"], indices, offsets), shape.name
        assert PROBLEM.bucket(shape) == ("d256-short" if "short" in shape.name else "d256-pooled"), shape.name


def test_the_ops_buckets_read_no_data() -> None:
    """Dispatch names a call's bucket from sizes and host ints: meta tensors suffice."""
    inputs = PROBLEM.make_inputs(next(s for s in CHECK_SHAPES if s.name == "mixed-dims"), 0, CPU)
    meta = [t.to("meta") for t in inputs.args]
    kwargs = {**inputs.kwargs, "per_sample_weights": None}
    assert embedding_bags.OP.bucket(*meta, **kwargs) == call_bucket(kwargs["max_dim"], *inputs.args[3:])
    assert embedding_bags.OP.fake(*meta, **kwargs).shape == (5, 752)


# --- what the shapes hold ---------------------------------------------------------------------


def test_the_check_shapes_cover_the_edge_cases() -> None:
    def having(predicate) -> set[str]:
        return {s.dtype for s in CHECK_SHAPES if predicate(s.params, layout_of(s))}

    every = {"fp32", "bf16", "fp16"}
    assert having(lambda p, layout: p["batch"] == 0) == every
    assert having(lambda p, layout: p["batch"] > 0 and sum(p.get("lengths", [1])) == 0) == every  # all empty
    assert having(lambda p, layout: 0 in p.get("lengths", []) and p.get("mode") == "mean") == every
    assert having(lambda p, layout: any(rows == 1 for rows, _ in layout.tables)) == every
    assert having(lambda p, layout: p.get("hot_rows", 0) > 0) == every
    assert having(lambda p, layout: len(set(layout.features)) < layout.num_features) == every  # shared tables
    assert having(lambda p, layout: p.get("weighted")) == every
    assert having(lambda p, layout: p.get("index_dtype") == "int32") == every
    assert having(lambda p, layout: p.get("index_dtype", "int64") == "int64") == every
    assert having(lambda p, layout: {4, 16, 48, 100, 128, 200, 256} <= set(layout.dims())) == every
    # Every id in one bag, and (fp32 only) a bag past 1024 ids.
    assert having(lambda p, layout: sum(v > 0 for v in p.get("lengths", [0, 0])) == 1) == every
    assert having(lambda p, layout: max(p.get("lengths", []), default=0) > 1024) == {"fp32"}


def test_the_timing_shapes_are_realistic() -> None:
    """Batches of 64k to 256k samples, 20 to 40 features of dims 16 to 256 (mostly short bags,
    many of one id), and in one bf16 batch a feature of 4 columns besides; tables of 1 to 2 GB;
    short-only and mixed calls, in bf16 and fp32."""
    kinds = set()
    for shape in TIMING_SHAPES:
        p, layout = shape.params, layout_of(shape)
        assert 65_536 <= p["batch"] <= 262_144 and 20 <= layout.num_features <= 40, shape.name
        assert set(layout.dims()) - {4} == {16, 32, 64, 128, 256}, shape.name
        assert 1e9 <= layout.num_elements * shape.torch_dtype.itemsize <= 2e9, shape.name
        short = [m for m in p["max_lens"] if m <= 3]
        assert len(short) >= 0.8 * layout.num_features and short.count(1) >= len(short) / 3, shape.name
        assert max(p["max_lens"]) in (3, 120), shape.name
        # Hundreds of MB to a few GB a call: a few hundred microseconds at HBM bandwidth.
        assert 5e8 <= PROBLEM.bytes(shape) <= 5e9, shape.name
        kinds.add((shape.dtype, "short" if max(p["max_lens"]) <= 3 else "mixed"))
    assert kinds == {("bf16", "short"), ("bf16", "mixed"), ("fp32", "short"), ("fp32", "mixed")}
    assert [s.dtype for s in TIMING_SHAPES if 4 in layout_of(s).dims()] == ["bf16"]


# --- the template -----------------------------------------------------------------------------


@pytest.mark.parametrize("template", [TEMPLATE, GRAD_TEMPLATE], ids=["forward", "backward"])
def test_each_template_renders_its_default_kernel_byte_for_byte(template) -> None:
    """The lookup and its tables' gradient are modules of their own: each template renders its
    module at its defaults."""
    source = Path(importlib.import_module(template.source_module).__file__).read_text()
    assert template.render({}) == source
    assert knob_values(source) == template.defaults()


def test_each_template_writes_its_own_knobs_within_their_bounds() -> None:
    forward = TEMPLATE.render({"BLOCK_B": 4, "BLOCK_L": 8, "ACC_3D": True})
    assert knob_values(forward) == {**TEMPLATE.defaults(), "BLOCK_B": 4, "BLOCK_L": 8, "ACC_3D": True}
    backward = GRAD_TEMPLATE.render({"BLOCK_L": 32, "num_warps": 2})
    assert knob_values(backward) == {**GRAD_TEMPLATE.defaults(), "BLOCK_L": 32, "num_warps": 2}
    with pytest.raises(ValueError, match="BLOCK_B"):
        TEMPLATE.render({"BLOCK_B": 16, "BLOCK_L": 32, "BLOCK_D": 256})
    with pytest.raises(ValueError, match="the update tile spills"):
        GRAD_TEMPLATE.render({"BLOCK_L": 64, "BLOCK_D": 256})
    with pytest.raises(ValueError, match="smaller than 8 warps"):
        GRAD_TEMPLATE.render({"BLOCK_L": 4, "BLOCK_D": 16, "num_warps": 8})
