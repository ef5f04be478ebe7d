"""Backward dispatch: the attention ops' backwards resolve their gradient op (`<op>_grad`) in the
kernel library, as the forwards resolve `<op>`, and call a registered kernel the way the gradient
problem (search_space/<op>_grad.py) calls it: grad_out first, then the forward's arguments.

The inputs are the gradient problems' own (make_inputs) at small jagged shapes; the registered
kernels are the problems' templates at their default knobs, as a campaign would register them.
"""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.registry import ARCH_INTERPRETER, DISPATCHER, KernelLibrary, LibraryEntry, device_arch
from sandbox.protocol import compare
from search_space import get_problem
from search_space.problem import Inputs, Shape
from search_space.template import get_template

_H = {"heads": 2, "dim": 16}
# (op, shape): every op once, jagged attention with and without a bias (four gradients or three).
CASES = {
    "jagged-bias-targets": (
        "jagged_attention",
        {**_H, "lengths": [0, 1, 9], "max_targets": 2, "random_targets": True, "rel_bias": True},
    ),
    "jagged-silu": ("jagged_attention", {**_H, "lengths": [3, 0, 12], "activation": "silu", "causal": False}),
    "gdpa-broadcast": (
        "gdpa",
        {**_H, "mode": "broadcast", "n_q": 3, "lengths": [0, 4, 9], "activation": "gelu"},
    ),
    "target-shuffled": (
        "target_attention",
        {**_H, "seeds": 2, "lengths": [0, 4, 11], "cands": [1, 2, 2], "shuffle": True},
    ),
}

# Appended to a rendered template: an entry that records how the backward called it.
RECORDING = """

CALLS = []


def recorded_grad(grad_out, *args, **kwargs):
    CALLS.append((grad_out, args, kwargs))
    return {entry}(grad_out, *args, **kwargs)
"""
# Appended to a rendered template: correct kernels, wrong gradients (every one negated).
NEGATED = """

def negated_grad(grad_out, *args, **kwargs):
    return tuple(-g for g in {entry}(grad_out, *args, **kwargs))
"""


def _case(case: str, device: torch.device) -> tuple[str, Shape, Inputs]:
    op, params = CASES[case]
    shape = Shape(name=case, dtype="fp32", params=params)
    return op, shape, get_problem(f"{op}_grad").make_inputs(shape, 3, device)


def _register(
    library: KernelLibrary, op: str, shape: Shape, device: torch.device, extra: str
) -> LibraryEntry:
    """The gradient problem's template at its default knobs, with `extra` (RECORDING or NEGATED)
    appended, registered for the case's (arch, dtype, bucket) under that extra's entry."""
    problem, template = get_problem(f"{op}_grad"), get_template(f"{op}_grad")
    source = template.render(template.defaults()) + extra.format(entry=template.entry)
    arch = device_arch(device)
    return library.add(
        op=problem.name,
        entry="recorded_grad" if extra is RECORDING else "negated_grad",
        source=source,
        arch=arch,
        dtype=shape.dtype,
        buckets=[problem.bucket(shape)],
        median_us=None,
        interpreted=arch == ARCH_INTERPRETER,
        evidence={},
        provenance={"test": "grad_dispatch"},
    )


def _op_grads(op: str, inputs: Inputs) -> list[torch.Tensor]:
    """Forward and backward through kernels.ops on fresh leaves: the gradients of q, k, v (and
    rel_bias where the call has one), in the gradient problem's order."""
    grad_out, *args = inputs.args
    kwargs = dict(inputs.kwargs)
    leaves = [t.clone().requires_grad_() for t in args[:3]]
    if kwargs.get("rel_bias") is not None:
        kwargs["rel_bias"] = kwargs["rel_bias"].clone().requires_grad_()
        leaves.append(kwargs["rel_bias"])
    out = getattr(ops, op)(*leaves[:3], *args[3:], **kwargs)
    out.backward(grad_out)
    return [leaf.grad for leaf in leaves]


def _assert_matches_reference(op: str, inputs: Inputs, grads: list[torch.Tensor], what: str) -> None:
    problem = get_problem(f"{op}_grad")
    want = problem.reference(*inputs.args, **inputs.kwargs)
    assert len(grads) == len(want), what
    tol, scale = problem.tolerance("fp32"), problem.tolerance_scale(inputs)
    for name, got, expected in zip(("dq", "dk", "dv", "d_rel_bias"), grads, want, strict=False):
        ok, details = compare(got, expected, tol, scale)
        assert ok, f"{what} {name}: {details['message']}"


@pytest.mark.parametrize("case", list(CASES))
def test_backward_runs_a_registered_gradient_kernel(
    case: str, device: torch.device, empty_library: KernelLibrary
) -> None:
    """Without a library kernel the backward runs the default; with one, that kernel is called
    with the gradient problem's arguments (grad_out, then the forward's, all tensors the very ones
    the op received, the launch bounds among them) and its gradients are the backward's."""
    op, shape, inputs = _case(case, device)
    before = DISPATCHER.calls.copy()
    default_grads = _op_grads(op, inputs)
    assert DISPATCHER.calls - before == {(op, "default"): 1, (f"{op}_grad", "default"): 1}
    assert DISPATCHER.last[f"{op}_grad"] == "default"
    _assert_matches_reference(op, inputs, default_grads, f"{case} default backward")

    added = _register(empty_library, op, shape, device, RECORDING)
    before = DISPATCHER.calls.copy()
    grads = _op_grads(op, inputs)
    name = f"library:{added.kernel_id}"
    assert DISPATCHER.calls - before == {(op, "default"): 1, (f"{op}_grad", name): 1}
    assert DISPATCHER.last[f"{op}_grad"] == name

    ((grad_out, args, kwargs),) = empty_library.load(added).__globals__["CALLS"]
    want_grad_out, *want_args = inputs.args
    assert torch.equal(grad_out, want_grad_out)
    assert len(args) == len(want_args)
    for got, want in zip(args, want_args, strict=True):
        assert (got is None and want is None) or torch.equal(got, want)
    assert sorted(kwargs) == sorted(inputs.kwargs)
    for key, want in inputs.kwargs.items():
        if key == "scale":  # the op resolves the default scale before the call
            assert kwargs[key] == shape.params["dim"] ** -0.5
        elif isinstance(want, torch.Tensor):
            assert torch.equal(kwargs[key], want), key
        else:
            assert kwargs[key] == want, key

    # fp32 runs the template with the default kernels' own tiles: the default backward's answer.
    for i, (got, want) in enumerate(zip(grads, default_grads, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m, i=i: f"grad {i}: {m}")
    _assert_matches_reference(op, inputs, grads, f"{case} library backward")


@pytest.mark.parametrize("case", ["jagged-bias-targets", "gdpa-broadcast", "target-shuffled"])
def test_backward_returns_what_a_wrong_registered_kernel_computes(
    case: str, device: torch.device, empty_library: KernelLibrary
) -> None:
    """Dispatch is real: a registered kernel whose gradients are negated makes the backward's
    gradients negated."""
    op, shape, inputs = _case(case, device)
    default_grads = _op_grads(op, inputs)
    added = _register(empty_library, op, shape, device, NEGATED)
    grads = _op_grads(op, inputs)
    assert DISPATCHER.last[f"{op}_grad"] == f"library:{added.kernel_id}"
    assert len(grads) == len(default_grads)
    for got, want in zip(grads, default_grads, strict=True):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, -want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_compiled_backward_dispatches_inside_the_op(
    device: torch.device, empty_library: KernelLibrary
) -> None:
    """Backward dispatch happens in the custom op's implementation, so a graph traced before a
    kernel was registered runs it, and the fake implementations are unchanged."""
    op, shape, inputs = _case("jagged-bias-targets", device)
    grad_out, q, k, v, offsets = inputs.args
    kwargs = {key: value for key, value in inputs.kwargs.items() if key != "rel_bias"}

    def loss(q, k, v, rel_bias):
        return (ops.jagged_attention(q, k, v, offsets, rel_bias=rel_bias, **kwargs) * grad_out).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)

    def grads(fn) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v, inputs.kwargs["rel_bias"])]
        fn(*leaves).backward()
        return [leaf.grad for leaf in leaves]

    default_grads = grads(compiled)
    assert DISPATCHER.last[f"{op}_grad"] == "default"
    added = _register(empty_library, op, shape, device, NEGATED)
    negated = grads(compiled)
    assert DISPATCHER.last[f"{op}_grad"] == f"library:{added.kernel_id}"
    for got, want in zip(negated, default_grads, strict=True):
        torch.testing.assert_close(got, -want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_ops_default_and_reference_take_the_problems_arguments(
    case: str, device: torch.device, empty_library: KernelLibrary, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gradient ops' registered default and reference (for benchmarks, and the reference for
    the backward where Triton cannot run) are called like a library kernel and are correct."""
    op, _, inputs = _case(case, device)
    grad_op = f"{op}_grad"
    assert DISPATCHER.gradient_of(grad_op) == op and DISPATCHER.gradient_of(op) is None
    got = DISPATCHER.default(grad_op)(*inputs.args, **inputs.kwargs)
    _assert_matches_reference(op, inputs, list(got), f"{case} default")
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        impl = DISPATCHER.resolve(grad_op, device=device, dtype="fp32", bucket="d16")
        assert impl.name == "reference"
        _assert_matches_reference(
            op, inputs, list(impl.fn(*inputs.args, **inputs.kwargs)), f"{case} reference"
        )
        grads = _op_grads(op, inputs)
        assert DISPATCHER.last[grad_op] == "reference"
        _assert_matches_reference(op, inputs, grads, f"{case} backward without Triton")
