"""The host-compute watch: which torch ops a candidate's host code runs on floating-point data.

A candidate computes its op in Triton kernels; its host code allocates, views, copies and casts
tensors and may compute on integer ones (offsets, lengths, schedules). Any other torch op with a
floating-point tensor among its inputs or outputs is host code computing the op itself (a
gather by indexing, a product by an operator, a sum by a builtin), which no static screen of
Python can see: tensors and numbers look alike there. The runner watches its calls with this
torch dispatch mode (all untimed ones, and a timed batch the judge picks at random, whose times
it then discards) and reports the first such op; Triton's own launches and autotuning run
unwatched.

Imports torch only: the runner loads it before any candidate code exists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

# Allocation, views, copies and casts: data movement a launcher needs, on any dtype.
BOOKKEEPING = frozenset(
    {
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros",
        "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like",
        "new_full", "arange", "fill_", "zero_", "copy_", "_to_copy", "clone", "view",
        "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "expand", "t", "transpose",
        "permute", "unsqueeze", "squeeze", "select", "slice", "narrow", "split",
        "split_with_sizes", "chunk", "unbind", "alias", "detach", "lift_fresh",
        "lift_fresh_copy", "_local_scalar_dense", "contiguous", "resize_",
    }
)  # fmt: skip


def _floating(value) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


class HostOps(TorchDispatchMode):
    """Records the first torch op outside BOOKKEEPING (and `allowed`, the problem's own) that
    touches floating-point data, or floating-point data viewed as integers."""

    def __init__(self, allowed: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.allowed = BOOKKEEPING | allowed
        self.first: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Floating-point data viewed as integers: computing on the bits (a gather by indexing)
        # is computing on the data.
        as_bits = func is torch.ops.aten.view.dtype and _floating(args[0]) and not _floating(out)
        if self.first is None and as_bits:
            self.first = f"{func} ({args[0].dtype} viewed as {out.dtype})".replace("torch.", "")
        if self.first is None and func.overloadpacket.__name__ not in self.allowed:
            tensors = [*tree_leaves(args), *tree_leaves(kwargs), *tree_leaves(out)]
            floating = [t for t in tensors if _floating(t)]
            if floating:
                self.first = f"{func} on {floating[0].dtype}".replace("torch.", "")
        return out


def _unwatched(run):
    def wrapper(*args, **kwargs):
        with _disable_current_modes():
            return run(*args, **kwargs)

    wrapper.unwatched = True
    return wrapper


def leave_launches_unwatched(kernel_classes: list[type]) -> None:
    """Triton's launches (the interpreter's copies of tiles included) and its autotuner's
    benchmarking run with the watch suspended: they are the kernels', not the host code's.
    Autotuner.run itself, which calls the candidate's hooks and prune functions, stays watched."""
    from triton.runtime.autotuner import Autotuner

    targets = [(cls, "run") for cls in kernel_classes] + [(Autotuner, "_bench")]
    for cls, name in targets:
        run = cls.__dict__.get(name)
        if run is not None and not getattr(run, "unwatched", False):
            setattr(cls, name, _unwatched(run))


@contextlib.contextmanager
def watching(enabled: bool, allowed: frozenset[str] = frozenset()) -> Iterator[HostOps | None]:
    if not enabled:
        yield None
        return
    with HostOps(allowed) as mode:
        yield mode
