"""The embedding-bag backward problem: its reference is the table gradient, and the sandbox
checks a gradient kernel against it (the library's own backward passes, a broken one does not)."""

from __future__ import annotations

import inspect

import pytest
import torch

import kernels.embedding_bag as library_kernels
from sandbox.candidate import Candidate
from sandbox.local import LocalBackend
from sandbox.result import Status
from search_space import get_problem
from search_space.problem import Shape

PROBLEM = get_problem("embedding_bag_backward")


@pytest.mark.parametrize(("mode", "weighted"), [("sum", False), ("mean", False), ("sum", True)])
def test_reference_is_the_scattered_gradient(mode: str, weighted: bool) -> None:
    # (per-sample weights go with mode 'sum' only, as in torch)
    shape = Shape(
        name="t", dtype="fp32", params={"num_rows": 9, "dim": 5, "lengths": [3, 0, 4, 1], "duplicates": True}
    )
    grad_out, indices, offsets, num_rows = PROBLEM.make_inputs(shape, 3, torch.device("cpu")).args
    psw = torch.rand(indices.numel()) if weighted else None
    got = PROBLEM.reference(grad_out, indices, offsets, num_rows, mode=mode, per_sample_weights=psw)
    want = torch.zeros(num_rows, 5)
    for b in range(offsets.numel() - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        for i in range(start, end):
            scale = (1.0 / (end - start) if mode == "mean" else 1.0) * (float(psw[i]) if weighted else 1.0)
            want[indices[i]] += scale * grad_out[b]
    torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_sandbox_checks_gradient_kernels() -> None:
    source = inspect.getsource(library_kernels)
    # Forgetting the 1/len of mode 'mean' is found on the mean check shape.
    broken = source.replace(
        'MODE_MEAN=mode == "mean",\n            BLOCK_L=', "MODE_MEAN=False,\n            BLOCK_L="
    )
    assert broken != source
    # Two workers side by side: each keeps one core busy.
    ok, wrong = LocalBackend(parallel=2).evaluate_many(
        [Candidate(problem=PROBLEM.name, source=s, entry=PROBLEM.entry) for s in (source, broken)],
        timing=False,
    )
    assert ok.status == Status.OK, ok.message
    assert wrong.status == Status.WRONG and "mean" in wrong.message, wrong.message
