"""Kernels that memoize their outputs, for the benchmarks' tests: each keeps its outputs under a
key of its inputs and answers a call whose key it has seen from them."""

from __future__ import annotations

from collections.abc import Callable

from search_space.problem import Inputs

Key = Callable[[tuple, dict], object]


def by_address(args: tuple, kwargs: dict) -> object:
    """The inputs' addresses (and shapes)."""
    return tuple((t.data_ptr(), tuple(t.shape)) for t in Inputs(args=args, kwargs=kwargs).tensors())


def by_sample(args: tuple, kwargs: dict) -> object:
    """A sample of the inputs' values: each tensor's first and last few elements."""
    tensors = Inputs(args=args, kwargs=kwargs).tensors()
    return tuple((tuple(t.shape), *t.flatten()[:4].tolist(), *t.flatten()[-4:].tolist()) for t in tensors)


def always(args: tuple, kwargs: dict) -> object:
    """One key for every call: the first call's outputs answer all the others."""
    return None


class Memo:
    """A provider that keeps each call's outputs under `key` of its inputs and answers a call
    whose key it has seen from them; `answered` says, call by call, whether it did."""

    def __init__(self, fn: Callable, key: Key) -> None:
        self.fn, self.key = fn, key
        self.kept: dict[object, object] = {}
        self.answered: list[bool] = []

    def __call__(self, *args, **kwargs):
        key = self.key(args, kwargs)
        self.answered.append(key in self.kept)
        if key not in self.kept:
            self.kept[key] = self.fn(*args, **kwargs)
        return self.kept[key]
