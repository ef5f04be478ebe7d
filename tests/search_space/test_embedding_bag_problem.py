"""The embedding-bag problem: reference on hand-computed numbers, inputs, roofline counts,
and the knob template's rendering and validation."""

import ast
from pathlib import Path

import pytest
import torch

from search_space import get_problem
from search_space.embedding_bag import (
    CHECK_SHAPES,
    KNOBS,
    SHORT_BAG_MEAN_IDS,
    TEMPLATE,
    TIMING_SHAPES,
    bucket_of,
    call_bucket,
    dim_bucket,
    make_inputs,
    reference,
    torch_embedding_bag,
)
from search_space.problem import Shape
from search_space.template import knob_values

PROBLEM = get_problem("embedding_bag")
CPU = torch.device("cpu")

# Four rows of two columns and three bags: {0, 2, 2}, {} and {3, 1}.
WEIGHT = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
INDICES = torch.tensor([0, 2, 2, 3, 1])
OFFSETS = torch.tensor([0, 3, 3, 5])
PSW = torch.tensor([0.5, 1.0, -1.0, 2.0, 0.25])


# --- reference ------------------------------------------------------------------------------


def test_reference_sum_by_hand() -> None:
    out = reference(WEIGHT, INDICES, OFFSETS, mode="sum")
    # bag 0: w0 + w2 + w2 = [1+5+5, 2+6+6]; bag 1 is empty; bag 2: w3 + w1 = [7+3, 8+4].
    expected = torch.tensor([[11.0, 14.0], [0.0, 0.0], [10.0, 12.0]])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_reference_mean_by_hand_empty_bag_is_zero() -> None:
    out = reference(WEIGHT, INDICES, OFFSETS, mode="mean")
    # The sums above divided by the bag lengths 3, 0 -> 0 (not NaN), and 2.
    expected = torch.tensor([[11.0 / 3, 14.0 / 3], [0.0, 0.0], [5.0, 6.0]])
    torch.testing.assert_close(out, expected)


def test_reference_per_sample_weights_by_hand() -> None:
    out = reference(WEIGHT, INDICES, OFFSETS, mode="sum", per_sample_weights=PSW)
    # bag 0: 0.5 * [1, 2] + 1 * [5, 6] - 1 * [5, 6] = [0.5, 1];
    # bag 2: 2 * [7, 8] + 0.25 * [3, 4] = [14.75, 17.0].
    expected = torch.tensor([[0.5, 1.0], [0.0, 0.0], [14.75, 17.0]])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_reference_matches_torch_embedding_bag(mode: str) -> None:
    torch.testing.assert_close(
        reference(WEIGHT, INDICES, OFFSETS, mode=mode),
        torch_embedding_bag(WEIGHT, INDICES, OFFSETS, mode=mode),
    )


def test_reference_returns_weight_dtype() -> None:
    out = reference(WEIGHT.bfloat16(), INDICES, OFFSETS, mode="sum")
    assert out.dtype == torch.bfloat16
    assert reference(WEIGHT.double(), INDICES, OFFSETS).dtype == torch.float64


# --- inputs ---------------------------------------------------------------------------------


def _shape(dtype: str = "fp32", **params) -> Shape:
    return Shape(name="t", dtype=dtype, params=params)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_make_inputs_explicit_lengths(dtype: str) -> None:
    lengths = [3, 0, 1, 7, 0]
    shape = _shape(dtype, num_rows=20, dim=8, lengths=lengths, weighted=True)
    inputs = PROBLEM.make_inputs(shape, 0, CPU)
    weight, indices, offsets = inputs.args
    psw = inputs.kwargs["per_sample_weights"]
    nnz = sum(lengths)
    assert weight.shape == (20, 8) and weight.dtype == shape.torch_dtype
    assert offsets.shape == (len(lengths) + 1,) and offsets.dtype == torch.int64
    assert offsets.tolist() == [0, 3, 3, 4, 11, 11]
    assert indices.shape == (nnz,) and indices.dtype == torch.int64
    assert int(indices.min()) >= 0 and int(indices.max()) < 20
    assert psw.shape == (nnz,) and psw.dtype == shape.torch_dtype
    assert inputs.kwargs["mode"] == "sum"


def test_make_inputs_power_law_lengths() -> None:
    shape = _shape(num_rows=100, dim=16, num_bags=50, max_len=12, mode="mean")
    inputs = PROBLEM.make_inputs(shape, 3, CPU)
    _, indices, offsets = inputs.args
    lengths = offsets.diff()
    assert offsets.shape == (51,) and int(offsets[0]) == 0
    assert int(lengths.min()) >= 1 and int(lengths.max()) <= 12
    assert indices.numel() == int(offsets[-1])
    assert inputs.kwargs == {"mode": "mean", "per_sample_weights": None}


def test_make_inputs_duplicates_repeat_rows() -> None:
    shape = _shape(num_rows=100, dim=16, lengths=[40, 40], duplicates=True)
    indices = PROBLEM.make_inputs(shape, 0, CPU).args[1]
    assert int(indices.max()) < 4  # few distinct ids, so every bag repeats rows


def test_make_inputs_empty_bag_list() -> None:
    inputs = PROBLEM.make_inputs(_shape(num_rows=10, dim=16, lengths=[]), 0, CPU)
    _, indices, offsets = inputs.args
    assert offsets.tolist() == [0] and indices.numel() == 0


@pytest.mark.parametrize("shape", CHECK_SHAPES, ids=lambda s: f"{s.name}-{s.dtype}")
def test_make_inputs_deterministic_per_seed(shape: Shape) -> None:
    first = PROBLEM.make_inputs(shape, 1234, CPU).tensors()
    again = PROBLEM.make_inputs(shape, 1234, CPU).tensors()
    other = PROBLEM.make_inputs(shape, 1235, CPU).tensors()
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    # The table always has elements, so a different seed must give a different table.
    assert not torch.equal(first[0], other[0])


# --- roofline counts ------------------------------------------------------------------------


def test_flops_and_bytes_weighted_fp32_by_hand() -> None:
    shape = _shape("fp32", num_rows=1000, dim=10, lengths=[2, 0, 3], weighted=True)
    # nnz = 5, B = 3, D = 10, 4-byte elements, 8-byte indices and offsets.
    assert PROBLEM.flops(shape) == 5 * 10 * 2  # a multiply and an add per gathered element
    expected_bytes = (
        5 * 10 * 4  # gathered rows: 200
        + 5 * 8  # indices: 40
        + 4 * 8  # offsets (B + 1): 32
        + 5 * 4  # per-sample weights: 20
        + 3 * 10 * 4  # output: 120
    )
    assert expected_bytes == 412
    assert PROBLEM.bytes(shape) == pytest.approx(expected_bytes)


def test_flops_and_bytes_unweighted_bf16_by_hand() -> None:
    shape = _shape("bf16", num_rows=1000, dim=10, lengths=[2, 0, 3])
    assert PROBLEM.flops(shape) == 5 * 10
    # rows 5*10*2 + indices 5*8 + offsets 4*8 + output 3*10*2 = 100 + 40 + 32 + 60.
    assert PROBLEM.bytes(shape) == pytest.approx(232)


def test_flops_and_bytes_no_bags() -> None:
    shape = _shape("fp32", num_rows=10, dim=16, lengths=[])
    assert PROBLEM.flops(shape) == 0
    assert PROBLEM.bytes(shape) == pytest.approx(8)  # the single offset


@pytest.mark.parametrize(
    ("dim", "bucket"),
    [(1, "d16"), (10, "d16"), (16, "d16"), (48, "d64"), (64, "d64"), (100, "d128"), (200, "d256")],
)
def test_dim_bucket(dim: int, bucket: str) -> None:
    assert dim_bucket(dim) == bucket
    assert PROBLEM.bucket(_shape(num_rows=4, dim=dim, lengths=[1])) == f"{bucket}-short"


def test_every_check_dtype_has_a_tolerance() -> None:
    for shape in CHECK_SHAPES:
        PROBLEM.tolerance(shape.dtype)
    with pytest.raises(ValueError, match="fp64"):
        PROBLEM.tolerance("fp64")


# --- template -------------------------------------------------------------------------------


def test_render_defaults_is_the_default_kernel_byte_for_byte() -> None:
    """One source: the template is kernels/embedding_bag.py, whose KNOBS hold the defaults."""
    import kernels.embedding_bag

    source = TEMPLATE.render({})
    assert source == Path(kernels.embedding_bag.__file__).read_text()
    tree = ast.parse(source)
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert TEMPLATE.entry in functions
    assert knob_values(source) == {knob.name: knob.default for knob in KNOBS}


def test_render_with_knobs() -> None:
    source = TEMPLATE.render({"BLOCK_D": 128, "EVICT_ROWS": "evict_first", "ACC_3D": True})
    chosen = {"BLOCK_D": 128, "EVICT_ROWS": "evict_first", "ACC_3D": True}
    assert knob_values(source) == {**TEMPLATE.defaults(), **chosen}


@pytest.mark.parametrize(
    ("knobs", "named"),
    [
        ({"BLOCK_X": 64}, "BLOCK_X"),  # unknown knob
        ({"BLOCK_D": 48}, "BLOCK_D"),  # not among the choices
        ({"num_stages": 4}, "num_stages"),
        ({"EVICT_ROWS": "evict_last"}, "EVICT_ROWS"),
        ({"BLOCK_B": 16, "BLOCK_L": 8, "BLOCK_D": 256}, "BLOCK_B * BLOCK_L * BLOCK_D"),  # spills
        ({"BLOCK_B": 1, "BLOCK_L": 4, "BLOCK_D": 16, "num_warps": 8}, "smaller than 8 warps"),
    ],
    ids=[
        "unknown",
        "block-d-choice",
        "stages-choice",
        "evict-choice",
        "tile-too-big",
        "tile-too-small",
    ],
)
def test_render_rejects_invalid_knobs(knobs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("*", r"\*")):
        TEMPLATE.render(knobs)


@pytest.mark.parametrize("knobs", [{"ACC_3D": 0}, {"BLOCK_B": 1.0}], ids=["acc-3d-int", "bags-float"])
def test_render_rejects_values_equal_to_a_choice_of_another_type(knobs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(knobs))):
        TEMPLATE.render(knobs)


def test_buckets_separate_short_bags_from_long_ones_alike_for_shapes_and_calls() -> None:
    """One bucket function: a timing shape and a call drawn from it fall in the same bucket, and
    the workload's short bags (one to three ids) in another than its pooled ones."""
    seen = {}
    for shape in TIMING_SHAPES:
        small = Shape(name=shape.name, dtype=shape.dtype, params={**shape.params, "num_rows": 1000})
        weight, indices, offsets = make_inputs(small, seed=3, device=torch.device("cpu")).args
        assert PROBLEM.bucket(shape) == call_bucket(weight.shape[1], indices, offsets), shape.name
        seen[shape.name] = PROBLEM.bucket(shape)
    assert seen["b256k-d64-4m-short"] == "d64-short" and seen["b256k-d64-4m"] == "d64-long"
    assert seen["b64k-d16-1m-short"] == "d16-short" and seen["b64k-d128-1m"] == "d128-long"
    assert (
        bucket_of(64, SHORT_BAG_MEAN_IDS) == "d64-short"
        and bucket_of(64, SHORT_BAG_MEAN_IDS + 0.1) == "d64-long"
    )


def test_an_entry_of_a_bucket_before_regimes_serves_both_regimes(tmp_path) -> None:
    from kernels.registry import KernelLibrary

    library = KernelLibrary(tmp_path / "lib")
    common = dict(op="embedding_bag", entry="embedding_bag", arch="sm_90", dtype="bf16", median_us=None,
                  interpreted=False, evidence={}, provenance={})  # fmt: skip
    old = library.add(source="# old\n", buckets=["d64"], **common)
    assert library.best("embedding_bag", "sm_90", "bf16", "d64-short").kernel_id == old.kernel_id
    assert library.best("embedding_bag", "sm_90", "bf16", "d128-short") is None
    new = library.add(source="# new\n", buckets=["d64-short"], **common)
    assert library.best("embedding_bag", "sm_90", "bf16", "d64-short").kernel_id == new.kernel_id
    assert library.best("embedding_bag", "sm_90", "bf16", "d64-long").kernel_id == old.kernel_id


def test_a_problem_whose_tolerance_bounds_no_row_is_refused() -> None:
    """Element and whole-output bounds alone pass a few zeroed rows: every problem's tolerance
    bounds each row, or is exact."""
    import dataclasses

    from search_space.problem import Tolerance

    problem = get_problem("embedding_bag")
    loose = {**problem.tolerances, "bf16": Tolerance(atol=1.6e-2, rtol=1.6e-2, norm_rtol=8e-3)}
    with pytest.raises(ValueError, match="its bf16 tolerance bounds no output row"):
        dataclasses.replace(problem, tolerances=loose)
    exact = {d: Tolerance(atol=0.0, rtol=0.0, norm_rtol=0.0) for d in problem.tolerances}
    assert dataclasses.replace(problem, tolerances=exact).tolerances == exact
