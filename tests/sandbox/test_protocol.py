"""The correctness protocol: `compare` on hand-made tensors and `check_shape` with in-process
fake candidates that break its rules."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from sandbox.protocol import check_shape, compare, kernels_do_the_work
from search_space import get_problem
from search_space.embedding_bag import CHECK_SHAPES, reference
from search_space.problem import Inputs, Shape, Tolerance

PROBLEM = get_problem("embedding_bag")
TOL = PROBLEM.tolerance("fp32")
CPU = torch.device("cpu")
REF = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.0, -4.0]])


# --- compare --------------------------------------------------------------------------------


def test_exact_match_passes() -> None:
    ok, details = compare(REF.clone(), REF, TOL)
    assert ok, details
    assert details["max_abs_err"] == 0.0 and details["norm_rel_err"] == 0.0


def test_error_within_tolerance_passes() -> None:
    ok, details = compare(REF * (1 + 2e-6), REF, TOL)
    assert ok, details


def test_error_outside_tolerance_names_the_element() -> None:
    out = REF.clone()
    out[1, 2] += 0.01
    ok, details = compare(out, REF, TOL)
    assert not ok
    assert details["worst_index"] == [1, 2]
    assert "1 of 6 elements" in details["message"] and "[1, 2]" in details["message"]
    assert details["max_abs_err"] == pytest.approx(0.01, rel=1e-3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_fails(bad: float) -> None:
    out = REF.clone()
    out[0, 1] = bad
    ok, details = compare(out, REF, TOL)
    assert not ok
    assert details["worst_index"] == [0, 1]


def test_zeros_fail_on_small_magnitude_reference() -> None:
    """atol scales with rms(ref): returning zeros cannot pass because the outputs are small."""
    ref = REF * 1e-4
    ok, details = compare(torch.zeros_like(ref), ref, TOL)
    assert not ok, details
    # The same relative accuracy as a passing case at unit scale still passes.
    ok, details = compare(ref * (1 + 2e-6), ref, TOL)
    assert ok, details


def test_norm_bound_fails_when_every_element_is_just_inside() -> None:
    """Each element within atol * rms + rtol * |ref|, the whole too far off in norm."""
    tol = Tolerance(atol=1e-2, rtol=0.0, norm_rtol=1e-3)
    ref = torch.ones(100)
    ok, details = compare(ref + 5e-3, ref, tol)
    assert not ok
    assert "relative error norm" in details["message"]


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        (REF[:1], "returned (1, 3)"),
        (REF.t(), "returned (3, 2)"),
        (REF.double(), "torch.float64"),
        (REF.bfloat16(), "torch.bfloat16"),
        (REF.tolist(), "returned list"),
    ],
    ids=["fewer-rows", "transposed", "fp64", "bf16", "not-a-tensor"],
)
def test_shape_dtype_or_type_mismatch_fails(out, expected: str) -> None:
    ok, details = compare(out, REF, TOL)
    assert not ok
    assert expected in details["message"]


def test_empty_outputs_match() -> None:
    ok, _ = compare(torch.empty(0, 16), torch.empty(0, 16), TOL)
    assert ok


# --- check_shape ----------------------------------------------------------------------------

SHAPE = next(s for s in CHECK_SHAPES if s.name == "mixed-empty" and s.dtype == "fp32")


def test_check_shape_passes_a_correct_candidate() -> None:
    result = check_shape(PROBLEM, reference, SHAPE, trial=1, device=CPU)
    assert result.ok, result.message
    assert (result.shape, result.dtype, result.trial) == ("mixed-empty", "fp32", 1)


def test_check_shape_rejects_a_candidate_that_modifies_its_inputs() -> None:
    def mutating(weight, indices, offsets, **kwargs):
        out = reference(weight, indices, offsets, **kwargs)
        weight.mul_(2)  # the right answer, computed before the table is scaled in place
        return out

    result = check_shape(PROBLEM, mutating, SHAPE, trial=0, device=CPU)
    assert not result.ok
    assert "modified its inputs" in result.message


def test_check_shape_rejects_an_output_aliasing_an_input() -> None:
    def aliasing(weight, indices, offsets, **kwargs):
        out = weight[: offsets.numel() - 1]  # a view of the table with the output's shape
        out.copy_(reference(weight, indices, offsets, **kwargs))
        return out

    result = check_shape(PROBLEM, aliasing, SHAPE, trial=0, device=CPU)
    assert not result.ok
    assert "modified its inputs" in result.message or "shares memory" in result.message


def test_check_shape_rejects_an_output_view_of_an_input() -> None:
    def view_only(weight, indices, offsets, **kwargs):
        return weight[: offsets.numel() - 1]

    result = check_shape(PROBLEM, view_only, SHAPE, trial=0, device=CPU)
    assert not result.ok
    assert "shares memory with an input" in result.message


def test_check_shape_rejects_a_wrong_candidate_with_details() -> None:
    def doubled(weight, indices, offsets, **kwargs):
        return reference(weight, indices, offsets, **kwargs) * 2

    result = check_shape(PROBLEM, doubled, SHAPE, trial=0, device=CPU)
    assert not result.ok
    assert "outside tolerance" in result.message
    assert result.worst_index is not None and result.max_abs_err > 0


def test_check_shape_draws_fresh_inputs_every_trial() -> None:
    seen = []

    def recording(weight, indices, offsets, **kwargs):
        seen.append(weight.clone())
        return reference(weight, indices, offsets, **kwargs)

    for trial in range(2):
        assert check_shape(PROBLEM, recording, SHAPE, trial=trial, device=CPU).ok
    assert not torch.equal(seen[0], seen[1])


# --- several outputs (a backward's gradients) -------------------------------------------------


def _pair_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x + 1


def _pair_inputs(shape, seed, device):
    gen = torch.Generator(device=device).manual_seed(seed)
    return Inputs(args=(torch.randn(shape.params["n"], generator=gen, device=device),))


PAIR = dataclasses.replace(
    PROBLEM,
    name="pair",
    check_shapes=(Shape(name="n7", dtype="fp32", params={"n": 7}),),
    make_inputs=_pair_inputs,
    reference=_pair_reference,
)


def test_compare_checks_each_output_of_a_tuple() -> None:
    ref = (REF, REF + 1)
    assert compare((REF.clone(), REF + 1), ref, TOL)[0]
    ok, details = compare((REF.clone(), REF + 1.5), ref, TOL)
    assert not ok and details["message"].startswith("output 1: ")
    ok, details = compare(REF.clone(), ref, TOL)
    assert not ok and "expected a tuple of 2 tensors" in details["message"]
    ok, details = compare((REF.clone(),), ref, TOL)
    assert not ok and "returned 1 values" in details["message"]


@pytest.mark.parametrize(
    ("candidate", "message"),
    [
        (lambda x: (x * 2, x + 1), ""),
        (lambda x: (x * 2, x * 2), "output 1: "),
        (lambda x: (x * 2,) * 2, "shares memory with an earlier output"),
        (lambda x: (x * 2, x), "shares memory with an input"),
    ],
    ids=["correct", "wrong-second", "same-tensor-twice", "returns-input"],
)
def test_check_shape_with_several_outputs(candidate, message: str) -> None:
    check = check_shape(PAIR, candidate, PAIR.check_shapes[0], 0, CPU, repeat=True, held=[])
    assert check.ok == (message == ""), check.message
    assert message in check.message


def test_compare_scale_replaces_the_reference_rms() -> None:
    """A problem's error scale (e.g. the values' RMS for softmax attention) sets what atol is
    relative to; the norm bound still fails an output that is wrong as a whole."""
    ref = torch.ones(100)
    ref[0] = 1e-3
    near = ref.clone()
    near[0] += 0.03  # 1.5 x atol of the output's RMS (about 1), within atol of a scale of 2
    tol = Tolerance(atol=2e-2, rtol=2e-2, norm_rtol=1e-2)
    assert not compare(near, ref, tol)[0]
    assert compare(near, ref, tol, scale=2.0)[0]
    ok, details = compare(torch.zeros(100), ref, tol, scale=1000.0)
    assert not ok and "relative error norm" in details["message"]


# --- the no-op proof ------------------------------------------------------------------------


@triton.jit
def _mark_kernel(flag_ptr):
    tl.store(flag_ptr, 1)


def _reference_after_a_kernel(*args, **kwargs) -> torch.Tensor:
    """The reference's output, but only once a Triton kernel has set a flag the host then reads
    (as a launcher reads row offsets a grouping kernel wrote); without it, a ValueError."""
    flag = torch.zeros(1, dtype=torch.int32)
    _mark_kernel[(1,)](flag)
    if int(flag) != 1:
        raise ValueError("the flag was never set")
    return reference(*args, **kwargs)


def test_no_op_proof_fails_a_candidate_correct_without_its_kernels() -> None:
    proof = kernels_do_the_work(PROBLEM, reference, CPU)
    assert not proof.ok and proof.trial == -1
    assert "still correct with every Triton kernel disabled" in proof.message


def test_no_op_proof_passes_a_candidate_that_cannot_run_without_its_kernels() -> None:
    assert check_shape(PROBLEM, _reference_after_a_kernel, SHAPE, trial=1, device=CPU).ok
    proof = kernels_do_the_work(PROBLEM, _reference_after_a_kernel, CPU)
    assert proof.ok, proof.message
    assert proof.message == "no output with every Triton kernel disabled (ValueError)"
