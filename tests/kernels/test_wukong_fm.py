"""wukong_fm: X (X^T proj) per candidate with the user's embeddings read from its request,
checked by the protocol on its check shapes, differentiable as the reference is (the user's
gradients summed per request), traced by torch.compile, and bad arguments named."""

from __future__ import annotations

import pytest
import torch

import kernels.ops as ops
from sandbox.protocol import check_shape
from search_space import get_problem
from search_space.wukong_fm import reference


def test_the_default_kernel_passes_every_check_shape(device: torch.device) -> None:
    problem = get_problem("wukong_fm")
    for trial, shape in enumerate(problem.check_shapes):
        result = check_shape(problem, ops.wukong_fm, shape, trial, device)
        assert result.ok, (shape.name, shape.dtype, result)


def _inputs(device: torch.device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, 20, generator=gen).to(device)
    x_user = torch.randn(3, 2, 20, generator=gen).to(device)
    proj = (torch.randn(6, 5, generator=gen) / 3).to(device)
    cand_to_request = torch.tensor([0, 0, 1, 2, 2, 2], device=device)
    return x, proj, x_user, cand_to_request


def test_gradients_match_autograd_through_the_reference(device: torch.device) -> None:
    x, proj, x_user, c2r = _inputs(device)
    mine = [t.clone().requires_grad_() for t in (x, proj, x_user)]
    theirs = [t.clone().requires_grad_() for t in (x, proj, x_user)]
    grad_out = torch.randn(6, 6, 5, device=device)
    ops.wukong_fm(mine[0], mine[1], mine[2], c2r).backward(grad_out)
    reference(theirs[0], theirs[1], theirs[2], c2r).backward(grad_out)
    for name, got, want in zip(("x", "proj", "x_user"), mine, theirs, strict=True):
        torch.testing.assert_close(
            got.grad, want.grad, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_the_compiled_call_equals_the_eager_one(device: torch.device) -> None:
    x, proj, x_user, c2r = _inputs(device)

    def block(x, proj, x_user, c2r):
        return ops.wukong_fm(x, proj, x_user, c2r).flatten(1).relu()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, proj, x_user, c2r), block(x, proj, x_user, c2r))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda x, p, u, c: (x, p, u, None), "come together"),
        (lambda x, p, u, c: (x, p[:5], u, c), r"proj must be \[6, k\]"),
        (lambda x, p, u, c: (x, p, u[:, :, :7], c), r"x_user must be \[R, n_u, 20\]"),
        (lambda x, p, u, c: (x, p, u, c.float()), "int32 or int64"),
        (lambda x, p, u, c: (x[0], p, u, c), r"x must be \[B, n_c, d\]"),
    ],
)
def test_bad_arguments_are_named(change, match: str, device: torch.device) -> None:
    with pytest.raises(ValueError, match=match):
        ops.wukong_fm(*change(*_inputs(device)))
