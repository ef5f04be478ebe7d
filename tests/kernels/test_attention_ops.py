"""What the attention ops' declarations (search_space/<op>.py and <op>_grad.py: search_space.op.Op)
make through kernels.opdef.define, beyond the kernels themselves (tests/kernels/test_attention.py):
the public signatures model code calls, the custom ops with and without their statistics, the
gradient ops, the launch bounds every implementation gets (and an older library entry does not),
and the graph (train or serve) each call dispatches in.

Registered kernels are the problems' templates at their default knobs, with an entry appended."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from kernels import ops
from kernels.registry import ARCH_INTERPRETER, DISPATCHER, KernelLibrary, LibraryEntry, device_arch
from search_space import get_problem
from search_space.op import Backward, Op, get_op
from search_space.problem import Inputs, Shape
from search_space.template import get_template

_H = {"heads": 2, "dim": 16}
SHAPES = {
    "jagged_attention": {**_H, "lengths": [0, 1, 9], "max_targets": 2, "rel_bias": True},
    "jagged_attention-silu": {**_H, "lengths": [3, 0, 7], "activation": "silu"},
    "gdpa": {**_H, "mode": "broadcast", "n_q": 3, "lengths": [0, 4, 9]},
    "target_attention": {**_H, "seeds": 2, "lengths": [0, 4, 11], "cands": [1, 2, 2], "shuffle": True},
}


def _inputs(case: str, device: torch.device, seed: int = 2) -> tuple[str, Shape, Inputs]:
    """The op's problem's inputs at a small shape, without the statistics flag, scale prepared."""
    op = case.split("-")[0]
    shape = Shape(name=case, dtype="fp32", params=SHAPES[case])
    problem = get_problem(op)
    inputs = problem.without_statistics(problem.make_inputs(shape, seed, device))
    kwargs = {**inputs.kwargs, "scale": SHAPES[case]["dim"] ** -0.5}
    return op, shape, Inputs(args=inputs.args, kwargs=kwargs)


def _register(
    library: KernelLibrary, problem: str, shape: Shape, device: torch.device, extra: str, entry: str, **more
) -> LibraryEntry:
    template = get_template(problem)
    arch = device_arch(device)
    return library.add(
        op=problem, entry=entry, source=template.render(template.defaults()) + extra, arch=arch,
        dtype=shape.dtype, buckets=[get_problem(problem).bucket(shape)], median_us=None,
        interpreted=arch == ARCH_INTERPRETER, evidence={}, provenance={"test": "attention ops"}, **more,
    )  # fmt: skip


def test_public_signatures_are_the_ops() -> None:
    """The signatures model code calls, as they were before the ops were declared."""
    assert str(inspect.signature(ops.jagged_attention)) == (
        "(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, *, max_seq_len: int, "
        "activation: str = 'softmax', causal: bool = True, num_targets: torch.Tensor | None = None, "
        "rel_bias: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor"
    )
    assert str(inspect.signature(ops.gdpa)) == (
        "(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor | None, "
        "kv_offsets: torch.Tensor, *, activation: str = 'gelu', scale: float | None = None, "
        "broadcast_q: bool = False, max_q_len: int | None = None, max_kv_len: int | None = None) "
        "-> torch.Tensor"
    )
    assert str(inspect.signature(ops.target_attention)) == (
        "(q_cand: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_offsets: torch.Tensor, "
        "cand_to_request: torch.Tensor, *, activation: str = 'softmax', scale: float | None = None, "
        "max_candidates: int | None = None, max_history: int | None = None) -> torch.Tensor"
    )
    for name in ("jagged_attention", "gdpa", "target_attention"):
        assert getattr(ops, name).__doc__.lstrip().split()[0] in {
            "Self-attention",
            "Generalized",
            "Request-broadcast",
        }
        assert DISPATCHER.gradient_of(f"{name}_grad") == name


@pytest.mark.parametrize(
    ("case", "statistics"),
    [
        ("jagged_attention", False),
        ("jagged_attention", True),
        ("jagged_attention-silu", True),
        ("gdpa", None),
        ("target_attention", False),
        ("target_attention", True),
    ],
)
@pytest.mark.slow
def test_the_custom_op_checks_out(
    case: str, statistics: bool | None, device: torch.device, empty_library
) -> None:
    """Schema, fake implementation and autograd of recforge::<op>; a forward with statistics
    returns them (empty for silu, [H, rows] for softmax) where asked. Not asked, though its
    inputs require grad (opcheck differentiates it), its backward recomputes them."""
    op, _, inputs = _inputs(case, device)
    fn = getattr(ops, op)
    leaves = [t.clone().requires_grad_() for t in inputs.args[:3]]
    values = (*leaves, *inputs.args[3:], *inputs.kwargs.values())
    if statistics is not None:
        values = (*values, statistics)
    torch.library.opcheck(fn.custom_op, values)
    if statistics is not None:
        out, lse = fn.custom_op(*values)
        softmax = statistics and inputs.kwargs.get("activation", "softmax") == "softmax"
        heads, rows = out.shape[-2], out.shape[:-2].numel()
        assert tuple(lse.shape) == ((heads, rows) if softmax else (0,)) and lse.dtype == torch.float32


@pytest.mark.parametrize("case", ["jagged_attention", "gdpa", "target_attention"])
@pytest.mark.slow
def test_the_gradient_op_checks_out(case: str, device: torch.device, empty_library) -> None:
    """recforge::<op>_grad, called as its problem calls a candidate; where its default reads the
    forward's saved output and statistics, with them too, to the same gradients."""
    op, _, inputs = _inputs(case, device)
    grad_fn = ops.op(f"{op}_grad")
    grad_out = torch.randn_like(getattr(ops, op)(*inputs.args, **inputs.kwargs))
    values = (grad_out, *inputs.args, *inputs.kwargs.values())
    saved = ()
    if get_op(f"{op}_grad").default_from_saved is not None:
        saved = getattr(ops, op).custom_op(*inputs.args, *inputs.kwargs.values(), True)
        values = (*values, None, None)
    torch.library.opcheck(grad_fn.custom_op, values)
    want = grad_fn(grad_out, *inputs.args, **inputs.kwargs)
    assert len(want) == 3 + (inputs.kwargs.get("rel_bias") is not None)
    if saved:
        got = grad_fn(
            grad_out, *inputs.args, **inputs.kwargs, saved_output=saved[0], saved_statistics=saved[1]
        )
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["jagged_attention", "target_attention"])
def test_without_triton_the_statistics_are_shaped_not_computed(
    op: str, empty_library, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where Triton cannot run, forward and gradient op run their references, and the gradient
    op's (a vjp) reads no statistics: the forward returns zeros of their shape, as the fake says."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _, _, inputs = _inputs(op, torch.device("cpu"))
    custom = getattr(ops, op).custom_op
    out, lse = custom(*inputs.args, *inputs.kwargs.values(), True)
    assert DISPATCHER.last[op] == "reference"
    assert tuple(lse.shape) == (out.shape[-2], out.shape[:-2].numel()) and not lse.any()


# Appended to a rendered template: the entry, recording the keywords it was called with.
RECORDING = """

CALLS = []


def recorded(*args, **kwargs):
    CALLS.append(sorted(kwargs))
    return {entry}(*args, **kwargs)
"""
# An entry registered before the op took its launch bounds: its function names none of them.
OLDER = {
    "gdpa": """

CALLS = []


def older(q, k, v, q_offsets, kv_offsets, *, activation="gelu", scale=None, broadcast_q=False):
    CALLS.append(True)
    return gdpa(q, k, v, q_offsets, kv_offsets, activation=activation, scale=scale, broadcast_q=broadcast_q)
""",
    "target_attention": """

CALLS = []


def older(q_cand, k, v, kv_offsets, cand_to_request, *, activation="softmax", scale=None, return_lse=False):
    CALLS.append(True)
    return target_attention(q_cand, k, v, kv_offsets, cand_to_request, activation=activation, scale=scale,
                            return_lse=return_lse)
""",
}


@pytest.mark.parametrize("op", ["gdpa", "target_attention"])
def test_a_library_forward_gets_the_bounds_and_an_older_one_none(
    op: str, device: torch.device, empty_library
) -> None:
    """The launch bounds reach a registered kernel (so it can launch without a host sync); an
    entry whose function predates them is called without them, and still answers alike."""
    _, shape, inputs = _inputs(op, device)
    bounds = get_op(op).bounds
    assert all(inputs.kwargs.get(b) is not None for b in bounds if b != "max_q_len")
    with torch.no_grad():
        want = getattr(ops, op)(*inputs.args, **inputs.kwargs)
        assert DISPATCHER.last[op] == "default"
        entry = _register(empty_library, op, shape, device, RECORDING.format(entry=op), "recorded")
        got = getattr(ops, op)(*inputs.args, **inputs.kwargs)
        assert DISPATCHER.last[op] == f"library:{entry.kernel_id}"
        assert empty_library.load(entry).__globals__["CALLS"] == [sorted(inputs.kwargs)]
        torch.testing.assert_close(got, want, rtol=0, atol=0)

        older = _register(empty_library, op, shape, device, OLDER[op], "older", bucket_us=None)
        empty_library.demote(entry, "a test: leave the older entry alone")
        got = getattr(ops, op)(*inputs.args, **inputs.kwargs)
        assert DISPATCHER.last[op] == f"library:{older.kernel_id}"
        assert empty_library.load(older).__globals__["CALLS"] == [True]
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["jagged_attention-silu", "gdpa"])
def test_a_forward_that_saves_nothing_trains_in_the_serving_graph(
    case: str, device: torch.device, empty_library
) -> None:
    """A call with gradients whose forward saves no statistics (silu; gdpa has none) is computed
    as serving computes it: an entry registered for serving only runs there, in training too.
    Its gradient op's calls are training calls: an entry for them serving only is not run."""
    op, shape, inputs = _inputs(case, device)
    entry = _register(
        empty_library, op, shape, device, RECORDING.format(entry=op), "recorded", train_buckets=[]
    )
    grad_template = get_template(f"{op}_grad")
    grad_entry = _register(
        empty_library, f"{op}_grad", shape, device, RECORDING.format(entry=grad_template.entry), "recorded",
        train_buckets=[],
    )  # fmt: skip
    leaves = [t.clone().requires_grad_() for t in inputs.args[:3]]
    out = getattr(ops, op)(*leaves, *inputs.args[3:], **inputs.kwargs)
    assert DISPATCHER.last[op] == f"library:{entry.kernel_id}"
    out.sum().backward()
    assert DISPATCHER.last[f"{op}_grad"] == "default"
    assert empty_library.load(grad_entry).__globals__["CALLS"] == []


NO_HEADS = """

def misshapen(*args, return_lse=False, **kwargs):
    got = {entry}(*args, return_lse=return_lse, **kwargs)
    return (got[0], got[1][:1]) if return_lse else got
"""


@pytest.mark.parametrize("op", ["jagged_attention", "target_attention"])
def test_a_library_forward_with_misshapen_statistics_is_named(
    op: str, device: torch.device, empty_library
) -> None:
    """Asked for statistics, an entry must return them shaped as the fake implementation says."""
    _, shape, inputs = _inputs(op, device)
    entry = _register(empty_library, op, shape, device, NO_HEADS.format(entry=op), "misshapen")
    leaves = [t.clone().requires_grad_() for t in inputs.args[:3]]
    with pytest.raises(
        RuntimeError, match=rf"'library:{entry.kernel_id}' given return_lse=True returned statistics \(1, "
    ):
        getattr(ops, op)(*leaves, *inputs.args[3:], **inputs.kwargs)


@pytest.mark.slow
def test_a_backward_defines_the_ops_it_uses() -> None:
    """Defining one op defines the ops its backward calls (Backward.uses, and a gradient op), so
    the first backward finds them in any process, whatever was imported before."""
    code = (
        "from kernels.opdef import define, defined; from search_space.op import get_op; "
        "define(get_op('dense_to_jagged')); define(get_op('gdpa')); print(sorted(defined()))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == str(
        ["dense_to_jagged", "gdpa", "gdpa_grad", "jagged_to_padded_dense"]
    )


def test_a_declaration_says_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="a formula"):
        Backward()
    with pytest.raises(ValueError, match="a formula"):
        Backward(gradient_op="gdpa_grad")  # without its differentiable arguments
    declared = get_op("gdpa")
    with pytest.raises(ValueError, match=r"bounds \['max_len'\] are not among its arguments"):
        Op(name="gdpa", problem=declared.problem, default=declared.default, fake=declared.fake,
           bucket=declared.bucket, bounds=("max_len",), reference_options=("attend",))  # fmt: skip
