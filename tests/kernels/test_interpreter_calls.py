"""sandbox/interpreter_calls.py, which the test processes and the sandbox's runners run the
interpreter with: a kernel whose helpers (its own and triton.language's) are called in every
program gives the bytes the interpreter's own calls give, with triton.language patched once per
launch and language module instead of at every call."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from sandbox import interpreter_calls

pytestmark = pytest.mark.skipif(
    not interpreter_calls.STOCK, reason="not installed here (a GPU host, or another Triton)"
)


@triton.jit
def _scaled(x, scale):
    return x * scale


@triton.jit
def _row(x_ptr, row, n, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    return tl.load(x_ptr + row * n + cols, mask=cols < n, other=0.0)


@triton.jit
def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x = _row(x_ptr, row, n, BLOCK)
    total = tl.sum(_scaled(x, 2.0), axis=0)  # tl.sum: a helper of triton.language's own
    peak = tl.max(tl.abs(_scaled(x, 0.5)), axis=0)
    # tl.zeros: a helper of triton.language.standard that calls a builtin of triton.language.core,
    # a module the launch's own patching leaves alone (a call that skipped it would fail).
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
    tl.store(out_ptr + row, total + peak * tl.cdiv(n, BLOCK) + zero)


def _run(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=x.dtype)
    _kernel[(x.shape[0],)](x, out, x.shape[1], BLOCK=16)
    return out


def test_helper_calls_give_the_interpreters_own_result_with_fewer_patchings(monkeypatch) -> None:
    x = torch.randn(6, 13, generator=torch.Generator().manual_seed(0))
    scans = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: scans.append(a[0]) or patch_builtin(*a))

    once = _run(x)
    patched_once = len(scans)
    with monkeypatch.context() as stock:
        stock.setattr(interpreter, "_patch_lang", interpreter_calls.STOCK["_patch_lang"])
        stock.setattr(interpreter.GridExecutor, "__call__", interpreter_calls.STOCK["launch"])
        stock.setattr(interpreter.InterpretedFunction, "__call__", interpreter_calls.STOCK["call"])
        scans.clear()
        every_call = _run(x)
        patched_every_call = len(scans)

    assert torch.equal(once, every_call)
    torch.testing.assert_close(once, 2 * x.sum(1) + 0.5 * x.abs().amax(1))
    # The interpreter's own: at least four module scans (triton.language, its tensor, math and
    # descriptor classes) at each of at least four helper calls in each of the six programs.
    # Installed: the launch's own scans, and those of the first call of a helper from another
    # module (tl.sum's, whose module names the core), once.
    assert patched_every_call >= 6 * 4 * 4, patched_every_call
    assert patched_once <= 2 * 5, patched_once
