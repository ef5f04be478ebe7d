"""The softmax forwards' statistics in dispatch: a registered forward that honours the forward
problems' contract (return_lse=True -> (out, lse), search_space.attention_common.SOFTMAX_LSE)
is the only forward a training step runs; an entry registered before the contract still trains,
with one default forward for the statistics, as before.

The registered kernels are the forward problems' templates at their default knobs (each a copy
of the attention library, so the library's own forward is called only for statistics)."""

from __future__ import annotations

import pytest
import torch

from kernels import attention, ops
from kernels.registry import ARCH_INTERPRETER, DISPATCHER, KernelLibrary, device_arch
from sandbox.protocol import compare
from search_space import get_problem
from search_space.problem import Shape
from search_space.template import get_template

_H = {"heads": 2, "dim": 16}
CASES = {
    "jagged": ("jagged_attention", {**_H, "lengths": [0, 1, 9], "max_targets": 2, "rel_bias": True}),
    "target": (
        "target_attention",
        {**_H, "seeds": 2, "lengths": [0, 4, 11], "cands": [1, 2, 2], "shuffle": True},
    ),
}

# Appended to a rendered forward template: an entry recording whether it was asked for lse.
RECORDING = """

CALLS = []


def recorded(*args, **kwargs):
    CALLS.append(kwargs.get("return_lse", False))
    return {entry}(*args, **kwargs)
"""
# An entry of the older, output-only contract: its signature has no return_lse.
LEGACY = {
    "jagged_attention": """

def legacy(q, k, v, offsets, *, max_seq_len, activation="softmax", causal=True, num_targets=None,
           rel_bias=None, scale=None):
    return jagged_attention(q, k, v, offsets, max_seq_len=max_seq_len, activation=activation,
                            causal=causal, num_targets=num_targets, rel_bias=rel_bias, scale=scale)
""",
    "target_attention": """

def legacy(q_cand, k, v, kv_offsets, cand_to_request, *, activation="softmax", scale=None,
           max_candidates=None, max_history=None):
    return target_attention(q_cand, k, v, kv_offsets, cand_to_request, activation=activation,
                            scale=scale, max_candidates=max_candidates, max_history=max_history)
""",
}
# The contract broken: asked for statistics, it returns the output alone.
NO_STATISTICS = """

def no_statistics(*args, return_lse=False, **kwargs):
    return {entry}(*args, **kwargs)
"""


def _register(
    library: KernelLibrary, op: str, shape: Shape, device: torch.device, extra: str, entry: str, **more
):
    problem, template = get_problem(op), get_template(op)
    source = template.render(template.defaults()) + extra.format(entry=template.entry)
    arch = device_arch(device)
    return library.add(
        op=op, entry=entry, source=source, arch=arch, dtype=shape.dtype, buckets=[problem.bucket(shape)],
        median_us=None, interpreted=arch == ARCH_INTERPRETER, evidence={}, provenance={"test": "statistics"},
        **more,
    )  # fmt: skip


def _train(op: str, shape: Shape, device: torch.device, monkeypatch: pytest.MonkeyPatch):
    """One forward and backward through kernels.ops -> the library's own forward kernels it
    launched (whether each was asked for lse), after checking the gradients against the
    reference's. A registered template is a copy of the library, launching its own."""
    inputs = get_problem(f"{op}_grad").make_inputs(shape, 5, device)
    grad_out, *args = inputs.args
    launch_forward = attention.launch_forward
    runs = []

    def counted(*a, **kw):
        runs.append(kw["return_lse"])
        return launch_forward(*a, **kw)

    monkeypatch.setattr(attention, "launch_forward", counted)
    leaves = [t.clone().requires_grad_() for t in args[:3]]
    kwargs = dict(inputs.kwargs)
    if kwargs.get("rel_bias") is not None:
        kwargs["rel_bias"] = kwargs["rel_bias"].clone().requires_grad_()
        leaves.append(kwargs["rel_bias"])
    getattr(ops, op)(*leaves[:3], *args[3:], **kwargs).backward(grad_out)
    monkeypatch.setattr(attention, "launch_forward", launch_forward)
    problem = get_problem(f"{op}_grad")
    want = problem.reference(*inputs.args, **inputs.kwargs)
    tol, scale = problem.tolerance("fp32"), problem.tolerance_scale(inputs)
    assert len(want) == len(leaves)
    for name, leaf, expected in zip(("dq", "dk", "dv", "d_rel_bias"), leaves, want, strict=False):
        ok, details = compare(leaf.grad, expected, tol, scale)
        assert ok, f"{op} {name}: {details['message']}"
    return runs


@pytest.mark.parametrize("case", list(CASES))
def test_a_registered_forward_is_the_only_forward_of_a_training_step(
    case: str, device: torch.device, empty_library: KernelLibrary, monkeypatch: pytest.MonkeyPatch
) -> None:
    op, params = CASES[case]
    shape = Shape(name=case, dtype="fp32", params=params)
    assert _train(op, shape, device, monkeypatch) == [True]  # no entry: the default, with lse

    added = _register(empty_library, op, shape, device, RECORDING, "recorded")
    assert _train(op, shape, device, monkeypatch) == []
    assert DISPATCHER.last[op] == f"library:{added.kernel_id}"
    assert empty_library.load(added).__globals__["CALLS"] == [True]


@pytest.mark.parametrize("case", list(CASES))
def test_an_entry_without_statistics_trains_with_one_default_forward_for_them(
    case: str, device: torch.device, empty_library: KernelLibrary, monkeypatch: pytest.MonkeyPatch
) -> None:
    op, params = CASES[case]
    shape = Shape(name=case, dtype="fp32", params=params)
    added = _register(empty_library, op, shape, device, LEGACY[op], "legacy")
    assert _train(op, shape, device, monkeypatch) == [True]
    assert DISPATCHER.last[op] == f"library:{added.kernel_id}"


def test_an_entry_that_breaks_the_contract_is_named(
    device: torch.device, empty_library: KernelLibrary, monkeypatch: pytest.MonkeyPatch
) -> None:
    op, params = CASES["jagged"]
    shape = Shape(name="jagged", dtype="fp32", params=params)
    added = _register(empty_library, op, shape, device, NO_STATISTICS, "no_statistics")
    with pytest.raises(
        RuntimeError, match=rf"library kernel 'library:{added.kernel_id}' given return_lse=True"
    ):
        _train(op, shape, device, monkeypatch)


@pytest.mark.parametrize("case", list(CASES))
def test_an_entry_for_serving_only_is_not_called_by_a_training_step(
    case: str, device: torch.device, empty_library: KernelLibrary, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry whose training form was slower is registered for serving only: a training step
    runs the default forward (with its statistics), an inference call the entry."""
    op, params = CASES[case]
    shape = Shape(name=case, dtype="fp32", params=params)
    added = _register(empty_library, op, shape, device, RECORDING, "recorded", train_buckets=[])
    assert _train(op, shape, device, monkeypatch) == [True]
    assert DISPATCHER.last[op] == "default"
    inputs = get_problem(op).without_statistics(get_problem(op).make_inputs(shape, 2, device))
    with torch.no_grad():
        getattr(ops, op)(*inputs.args, **inputs.kwargs)
    assert DISPATCHER.last[op] == f"library:{added.kernel_id}"
    assert empty_library.load(added).__globals__["CALLS"] == [False]
