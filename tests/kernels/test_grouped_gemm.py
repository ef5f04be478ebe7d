"""grouped_gemm and its weight gradient: each group's rows times its own matrix in one launch,
checked by the protocol on the problems' check shapes (empty groups, uneven splits, a single
group, no bias), differentiable through autograd as the reference is, and traced by
torch.compile."""

from __future__ import annotations

import pytest
import torch

import kernels.ops as ops
from sandbox.protocol import check_shape
from search_space import get_problem
from search_space.grouped_gemm import reference

NAMES = ("grouped_gemm", "grouped_gemm_weight_grad")


@pytest.mark.parametrize("name", NAMES)
def test_the_default_kernel_passes_every_check_shape(name: str, device: torch.device) -> None:
    problem = get_problem(name)
    fn = getattr(ops, name)
    for trial, shape in enumerate(problem.check_shapes):
        result = check_shape(problem, fn, shape, trial, device)
        assert result.ok, (shape.name, shape.dtype, result)


def _inputs(device: torch.device, dtype=torch.float32, counts=(3, 0, 9, 1)):
    gen = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device=device)
    x = torch.randn(sum(counts), 20, generator=gen).to(device, dtype)
    weight = (torch.randn(len(counts), 20, 12, generator=gen) / 4).to(device, dtype)
    bias = torch.randn(len(counts), 12, generator=gen).to(device, dtype)
    return x, offsets, weight, bias


def test_gradients_match_autograd_through_the_reference(device: torch.device) -> None:
    x, offsets, weight, bias = _inputs(device)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    twins = [t.clone().requires_grad_() for t in (x, weight, bias)]
    grad_out = torch.randn(x.shape[0], weight.shape[2], device=device)
    ops.grouped_gemm(leaves[0], offsets, leaves[1], leaves[2]).backward(grad_out)
    reference(twins[0], offsets, twins[1], twins[2]).backward(grad_out)
    for name, got, want in zip(("x", "weight", "bias"), leaves, twins, strict=True):
        torch.testing.assert_close(
            got.grad, want.grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    # The empty group's weight and bias get zero gradients.
    assert not leaves[1].grad[1].any() and not leaves[2].grad[1].any()


def test_the_compiled_call_equals_the_eager_one(device: torch.device) -> None:
    x, offsets, weight, bias = _inputs(device)

    def layer(x, offsets, weight, bias):
        return torch.relu(ops.grouped_gemm(x, offsets, weight, bias)) * 2

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, offsets, weight, bias), layer(x, offsets, weight, bias))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda x, o, w, b: (x[:, :5], o, w, b), r"x's K \(5\) and weight's \(20\) differ"),
        (lambda x, o, w, b: (x, o[:-1], w, b), "holds 4 offsets for 4 groups"),
        (lambda x, o, w, b: (x, o.float(), w, b), "int32 or int64"),
        (lambda x, o, w, b: (x, o, w, b[:, :3]), r"bias must be \[G, M\]"),
        (lambda x, o, w, b: (x.double(), o, w, b), "must share a dtype"),
    ],
)
def test_bad_arguments_are_named(change, match: str, device: torch.device) -> None:
    with pytest.raises(ValueError, match=match):
        ops.grouped_gemm(*change(*_inputs(device)))
