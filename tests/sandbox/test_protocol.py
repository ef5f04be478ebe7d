"""The correctness protocol: `compare` on hand-made tensors and `check_shape` with in-process
fake candidates that break its rules. (The no-op proof is the judge's: see test_judge.py.)"""

import dataclasses

import pytest
import torch

from sandbox.protocol import check_shape, compare
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


def test_an_infinite_reference_element_must_be_matched_exactly() -> None:
    """A softmax row with no key has lse -inf: the output must be -inf there too, and the finite
    elements are compared as usual (the infinity neither widens nor breaks their bound)."""
    ref = torch.tensor([[1.0, float("-inf"), 3.0]])
    ok, details = compare(ref.clone(), ref, TOL)
    assert ok, details
    for wrong in (0.0, float("inf"), float("nan")):
        out = ref.clone()
        out[0, 1] = wrong
        ok, details = compare(out, ref, TOL)
        assert not ok and "1 of 1 non-finite reference elements differ" in details["message"]
    out = ref.clone()
    out[0, 2] = 3.1
    ok, details = compare(out, ref, TOL)
    assert not ok and "1 of 3 elements outside tolerance" in details["message"]


def test_tuple_outputs_take_a_tolerance_each() -> None:
    """(output, statistics) are compared under the problem's closeness: each its own bound."""
    loose, tight = (
        Tolerance(atol=1e-1, rtol=1e-1, norm_rtol=1e-1),
        Tolerance(atol=1e-6, rtol=1e-6, norm_rtol=1e-6),
    )
    ref = (REF, REF + 10)
    off = (REF * 1.01, REF + 10)
    assert compare(off, ref, (loose, tight), (None, None))[0]
    ok, details = compare((REF, (REF + 10) * 1.01), ref, (loose, tight), (None, None))
    assert not ok and details["message"].startswith("output 1:")
    ok, details = compare(REF, ref, (loose, tight))
    assert not ok and "expected a tuple of 2 tensors" in details["message"]
    ok, details = compare(REF, REF, (loose, tight))
    assert not ok and "expected a tuple of 2 tensors" in details["message"]


def test_closeness_asks_for_the_statistics_bound_only_where_the_call_asks_for_them() -> None:
    jagged = get_problem("jagged_attention")
    shape = next(s for s in jagged.check_shapes if s.params.get("with_lse") and s.dtype == "bf16")
    asking = jagged.make_inputs(shape, 0, CPU)
    plain = jagged.without_statistics(asking)
    assert asking.kwargs["return_lse"] is True and "return_lse" not in plain.kwargs
    scale = jagged.tolerance_scale(plain)
    assert scale is not None
    out = jagged.reference(*plain.args, **plain.kwargs)
    assert jagged.closeness("bf16", plain, out) == (jagged.tolerance("bf16"), scale)
    assert jagged.closeness("bf16", asking, jagged.reference(*asking.args, **asking.kwargs)) == (
        (jagged.tolerance("bf16"), jagged.statistics.tolerances["bf16"]),
        (scale, None),
    )
    bags = PROBLEM.make_inputs(CHECK_SHAPES[0], 0, CPU)  # embedding bags save nothing
    assert PROBLEM.closeness("fp32", bags, reference(*bags.args, **bags.kwargs)) == (
        TOL,
        PROBLEM.tolerance_scale(bags),
    )


def test_each_output_of_several_is_held_to_its_own_dtypes_tolerance() -> None:
    """A bf16 call of layer_norm_gate_grad returns bf16 dx and du beside fp32 dweight and dbias:
    those are held to fp32's bounds, so that rounding them to bf16 is wrong (under the call's
    bf16 tolerance it passed)."""
    grad = get_problem("layer_norm_gate_grad")
    shape = next(s for s in grad.check_shapes if s.dtype == "bf16" and s.params["tokens"] > 0)
    inputs = grad.make_inputs(shape, 0, CPU)
    ref = grad.reference(*inputs.args, **inputs.kwargs)
    assert [t.dtype for t in ref] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    tol, _ = grad.closeness("bf16", inputs, ref)
    assert tol == (grad.tolerance("bf16"),) * 2 + (grad.tolerance("fp32"),) * 2
    assert compare(ref, ref, tol)[0]
    rounded = (*ref[:2], *(t.to(torch.bfloat16).float() for t in ref[2:]))
    assert compare(rounded, ref, grad.tolerance("bf16"))[0]  # what the call's tolerance let through
    ok, details = compare(rounded, ref, tol)
    assert not ok and details["message"].startswith("output 2:")
    # A problem with no bounds for an output's dtype is refused, not judged by the call's.
    bf16_only = dataclasses.replace(grad, tolerances={"bf16": grad.tolerance("bf16")})
    with pytest.raises(ValueError, match="output 2 is torch.float32, a dtype it sets no tolerance for"):
        bf16_only.closeness("bf16", inputs, ref)


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


# --- per-row bounds ---------------------------------------------------------------------------

BAGS_200 = {"num_rows": 5000, "dim": 64, "num_bags": 200, "max_len": 120}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_zeroing_one_percent_of_the_bags_fails_the_row_bound(dtype: str) -> None:
    """Two of 200 bags whose values nearly cancel (every element below half the element
    tolerance), zeroed: each element is inside its bound and the whole inside the norm bound,
    but each of those rows is wrong by its whole norm."""
    tol = PROBLEM.tolerance(dtype)
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    x[[17, 123]] *= tol.atol / 6
    ref = x.to(Shape(name="s", dtype=dtype, params={}).torch_dtype)
    out = ref.clone()
    out[[17, 123]] = 0
    ok, details = compare(out, ref, tol)
    assert not ok
    assert details["message"].startswith("2 of 200 rows outside their norm bound"), details["message"]
    assert details["norm_rel_err"] <= tol.norm_rtol  # neither bound before it would have failed


def _bags_exact(dtype: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the exact fp64 result, the reference's) for 200 power-law bags of 64 columns."""
    inputs = PROBLEM.make_inputs(Shape(name="b200", dtype=dtype, params=BAGS_200), seed, CPU)
    weight, indices, offsets = inputs.args
    exact = reference(weight.double(), indices, offsets, **inputs.kwargs)
    return exact, reference(*inputs.args, **inputs.kwargs)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_an_output_rounded_to_the_element_tolerance_grid_fails_the_row_bound(dtype: str) -> None:
    """Rounded to steps of atol * RMS, every element is inside its bound, yet the rows of
    less than typical norm carry far more error than one rounding to the dtype."""
    tol = PROBLEM.tolerance(dtype)
    exact, ref = _bags_exact(dtype, seed=1)
    step = tol.atol * exact.pow(2).mean().sqrt().item()
    grid = ((exact / step).round() * step).to(ref.dtype)
    ok, details = compare(grid, ref, tol)
    assert not ok
    assert "rows outside their norm bound" in details["message"], details["message"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_honest_rounding_passes_the_row_bound(dtype: str, seed: int) -> None:
    """Accumulated in fp64 (not the reference's fp32) and rounded once to the dtype: within
    every bound."""
    exact, ref = _bags_exact(dtype, seed)
    ok, details = compare(exact.to(ref.dtype), ref, PROBLEM.tolerance(dtype))
    assert ok, details


def test_bf16_truncated_instead_of_rounded_passes_the_row_bound() -> None:
    """Rounding toward zero (a whole unit in the last place, not half) is still one rounding."""
    exact, ref = _bags_exact("bf16", seed=4)
    bits = exact.float().view(torch.int32) & ~0xFFFF
    ok, details = compare(bits.view(torch.float32).to(torch.bfloat16), ref, PROBLEM.tolerance("bf16"))
    assert ok, details


# --- a step at a time -------------------------------------------------------------------------


def _cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, output, reference): one of each verdict, in several ranks."""
    gen = torch.Generator().manual_seed(7)
    ref = torch.randn(40, 3, 8, generator=gen)
    noise = ref + 1e-7 * torch.randn(ref.shape, generator=gen)
    cases = [("exact", ref.clone(), ref), ("noise", noise, ref)]
    far = noise.clone()
    far[31, 2, 5] += 1.0
    cases.append(("one element far", far, ref))
    nan = noise.clone()
    nan[9, 0, 0] = float("nan")
    cases.append(("nan", nan, ref))
    small = ref.clone()
    small[[4, 33]] *= 5e-6  # inside every element bound once zeroed, not inside their rows'
    zeroed = small.clone()
    zeroed[[4, 33]] = 0
    cases.append(("zeroed rows", zeroed, small))
    inf_ref = ref.clone()
    inf_ref[[2, 25], 1, 3] = float("inf")
    cases.append(("inf matched", inf_ref.clone(), inf_ref))
    unmatched = inf_ref.clone()
    unmatched[25, 1, 3] = 0.0
    cases.append(("inf unmatched", unmatched, inf_ref))
    scaled = ref * 1.001
    cases.append(("norm", scaled, ref))
    cases.append(("0-dim", torch.tensor(1.5), torch.tensor(1.5)))
    cases.append(("0-dim wrong", torch.tensor(2.5), torch.tensor(1.5)))
    cases.append(("1-d", noise.flatten(), ref.flatten()))
    return cases


@pytest.mark.parametrize("name, out, ref", _cases(), ids=[c[0] for c in _cases()])
def test_a_comparison_in_steps_of_rows_says_what_the_whole_one_says(monkeypatch, name, out, ref) -> None:
    """The judge compares a few rows at a time (its temporaries bounded whatever the output's
    size): in steps of one or a few rows it gives the whole comparison's verdict, message, worst
    element and error norm."""
    import sandbox.protocol as protocol

    tol = Tolerance(atol=1e-5, rtol=1e-5, norm_rtol=1e-4, row_rtol=1e-4, row_atol=1e-6)
    monkeypatch.setattr(protocol, "COMPARE_CHUNK_ELEMENTS", 1 << 40)
    whole = compare(out, ref, tol)
    for step in (1, 24, 100):
        monkeypatch.setattr(protocol, "COMPARE_CHUNK_ELEMENTS", step)
        ok, details = compare(out, ref, tol)
        assert ok == whole[0], (step, details, whole)
        assert details.get("message") == whole[1].get("message"), step
        assert details.get("worst_index") == whole[1].get("worst_index"), step
        if "norm_rel_err" in whole[1]:
            assert details["norm_rel_err"] == pytest.approx(whole[1]["norm_rel_err"], rel=1e-9, nan_ok=True)
    expected_ok = name in ("exact", "noise", "inf matched", "0-dim", "1-d")
    assert whole[0] == expected_ok, whole


def test_integer_outputs_are_exact_even_past_fp64s_integers() -> None:
    """Ids and counts are exact; an int64 past 2^53 has no fp64 twin, so it is compared as it is."""
    ref = torch.full((3,), 2**60, dtype=torch.int64)
    ok, details = compare(ref + 1, ref, TOL)
    assert not ok and details["message"].startswith("3 of 3 elements differ from the exact"), details
    assert compare(ref.clone(), ref, TOL)[0]
    flags = torch.tensor([True, False])
    assert not compare(~flags, flags, TOL)[0] and compare(flags.clone(), flags, TOL)[0]


def test_a_complex_output_is_refused_not_compared_by_its_real_part() -> None:
    ref = torch.ones(3, dtype=torch.complex64)
    ok, details = compare(ref + 1j, ref, TOL)
    assert not ok and "complex outputs are not compared" in details["message"]


def test_the_worst_row_named_is_one_out_of_bounds() -> None:
    """A zero reference row with a zero error has a bound of 0 too: it is within it, and the
    message names the row that is not."""
    tol = Tolerance(atol=0.0, rtol=1.0, norm_rtol=10.0, row_rtol=1e-3)
    ref = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    out = ref.clone()
    out[2] *= 1.5
    ok, details = compare(out, ref, tol)
    assert not ok and "worst row 2:" in details["message"], details["message"]
