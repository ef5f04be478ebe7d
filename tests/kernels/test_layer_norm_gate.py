"""layer_norm_gate: the HSTU layer's output norm fused with its gate. Its default kernel and its
gradient op's pass every check shape; its gradients (through the eager path and the custom op)
match autograd of the reference for x, u, weight and bias, in fp32 and bf16, with no rows, with a
gate that is a strided view (the model's chunk of one projection), under autocast; dispatch runs
the references where asked; and bad arguments are named."""

from __future__ import annotations

import pytest
import torch

import kernels.ops as ops
from kernels.registry import DISPATCHER
from sandbox.protocol import check_shape
from search_space import get_problem
from search_space.layer_norm_gate import reference


@pytest.mark.parametrize("name", ["layer_norm_gate", "layer_norm_gate_grad"])
@pytest.mark.slow
def test_the_default_kernels_pass_every_check_shape(name: str, device: torch.device, empty_library) -> None:
    problem = get_problem(name)
    fn = ops.op(name)
    for trial, shape in enumerate(problem.check_shapes):
        result = check_shape(problem, fn, shape, trial, device)
        assert result.ok, (shape.name, shape.dtype, result)


def _inputs(rows: int, dim: int, dtype: torch.dtype, device: torch.device):
    """x, u as a chunk of a wider projection (a row stride of its own, as HSTULayer's u), weight,
    bias (fp32), an upstream gradient; one row of constant values."""
    gen = torch.Generator().manual_seed(rows * 1000 + dim)
    x = 2.0 + torch.randn(rows, dim, generator=gen)
    if rows > 2:
        x[2] = 0.7
    u = torch.randn(rows, 4 * dim, generator=gen).to(device, dtype).chunk(4, dim=1)[1]
    weight = 1.0 + 0.1 * torch.randn(dim, generator=gen)
    bias = 0.1 * torch.randn(dim, generator=gen)
    grad_out = torch.randn(rows, dim, generator=gen)
    return (
        x.to(device, dtype),
        u,
        weight.to(device),
        bias.to(device),
        grad_out.to(device, dtype),
    )


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize(
    ("dtype", "rows", "dim"), [(torch.float32, 21, 100), (torch.bfloat16, 40, 128), (torch.float32, 0, 64)]
)
def test_gradients_match_autograd_through_the_reference(
    dtype: torch.dtype, rows: int, dim: int, device: torch.device, empty_library
) -> None:
    x, u, weight, bias, grad_out = _inputs(rows, dim, dtype, device)
    assert u.stride(0) == 4 * dim
    theirs = _leaves(x, u, weight, bias)
    reference(*theirs, 1e-5).float().backward(grad_out.float())
    fn = ops.layer_norm_gate
    for path, call in (("eager", fn), ("custom op", fn.custom_op)):
        mine = [t.detach().requires_grad_() for t in (x, u, weight, bias)]  # u: the strided view
        out = call(*mine, 1e-5)
        assert out.dtype == dtype and out.shape == (rows, dim)
        out.backward(grad_out)
        for name, got, want in zip(("x", "u", "weight", "bias"), mine, theirs, strict=True):
            assert got.grad.dtype == want.dtype, (path, name)
            tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
            torch.testing.assert_close(
                got.grad, want.grad, **tol, msg=lambda m, n=name, p=path: f"{p} {n}: {m}"
            )
    if rows == 0:
        assert not mine[2].grad.any() and not mine[3].grad.any()
    assert DISPATCHER.last["layer_norm_gate_grad"] == "default"


def test_the_custom_ops_check_out(device: torch.device, empty_library) -> None:
    x, u, weight, bias, grad_out = _inputs(6, 48, torch.float32, device)
    torch.library.opcheck(ops.layer_norm_gate.custom_op, (*_leaves(x, u, weight, bias), 1e-5))
    grad_fn = ops.layer_norm_gate_grad
    torch.library.opcheck(grad_fn.custom_op, (grad_out, x, u, weight, bias, 1e-5))
    got = grad_fn(grad_out, x, u, weight, bias)
    want = get_problem("layer_norm_gate_grad").reference(grad_out, x, u, weight, bias)
    assert len(got) == 4
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_under_autocast_the_gate_is_rounded_once_and_the_parameters_keep_their_dtype(
    device: torch.device, empty_library
) -> None:
    """The model's call: bf16 activations from autocast's matrix products, fp32 LayerNorm
    parameters; the op is not cast by autocast, so its gradients come back in those dtypes."""
    x, u, weight, bias, grad_out = _inputs(9, 64, torch.bfloat16, device)
    mine = _leaves(x, u, weight, bias)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = ops.layer_norm_gate(*mine, eps=1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(x, u, weight, bias), atol=2e-2, rtol=2e-2)
    out.backward(grad_out)
    assert [t.grad.dtype for t in mine] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]


def test_the_references_run_where_asked(device: torch.device, empty_library) -> None:
    x, u, weight, bias, grad_out = _inputs(5, 32, torch.float32, device)
    mine = _leaves(x, u, weight, bias)
    with DISPATCHER.references_only("layer_norm_gate"):
        out = ops.layer_norm_gate(*mine)
        out.backward(grad_out)
    assert DISPATCHER.last["layer_norm_gate"] == DISPATCHER.last["layer_norm_gate_grad"] == "reference"
    torch.testing.assert_close(out, reference(x, u, weight, bias))
    assert all(t.grad is not None for t in mine)


def test_the_compiled_call_equals_the_eager_one(device: torch.device, empty_library) -> None:
    x, u, weight, bias, _ = _inputs(7, 40, torch.float32, device)

    def block(x, u, weight, bias):
        return ops.layer_norm_gate(x, u, weight, bias, 1e-5).relu()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, u, weight, bias), block(x, u, weight, bias))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda x, u, w, b: (x[0], u, w, b), r"x must be an fp32, bf16 or fp16 \[T, I\]"),
        (lambda x, u, w, b: (x, u[:, :5], w, b), "u must be like x"),
        (lambda x, u, w, b: (x, u.double(), w, b), "u must be like x"),
        (lambda x, u, w, b: (x, u, w[:3], b), r"weight and bias must be \[8\]"),
        (lambda x, u, w, b: (x, u, w, b.half()), "one dtype"),
    ],
)
def test_bad_arguments_are_named(change, match: str, device: torch.device) -> None:
    x, u, weight, bias, _ = _inputs(4, 8, torch.float32, device)
    with pytest.raises(ValueError, match=match):
        ops.layer_norm_gate(*change(x, u, weight, bias))
