"""What the kernel library runs for a piece of model code: every public op's call, with its
shape bucket, the implementation dispatch chose and, where the op declares its cost, its FLOPs
and minimum bytes. Under the torch profiler each call is a range named `recforge::<op>::<bucket>`,
so its time (the device's, on a GPU) is attributed to the op and bucket.

    with trace() as calls:
        model(batch)
    calls.calls  # [Call(op="embedding_bag", bucket="fp32/d64/short", ...), ...]

Tracing costs a cost function per call (which may read sizes back from the device: a timed
trace calls them after the timing, in `seconds()`); without a trace, an op's call pays one list
check.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels.registry import DISPATCHER

# A call's profiler range. An op-scoped range where torch has one, not a user-scoped
# record_function: the profiler credits a GPU kernel to the innermost op-scoped event around its
# launch, so the library's kernels are credited to the range of their call (model.profile tells
# them from the rest of the step by it), not to the autograd Function around it.
_RANGE = getattr(torch._C._profiler, "_RecordFunctionFast", torch.profiler.record_function)

# The traces being recorded, innermost last (empty: tracing is off).
ACTIVE: list[Trace] = []
RANGE_PREFIX = "recforge::"


@dataclass
class Call:
    op: str
    bucket: str
    dtype: str  # the first tensor argument's
    implementation: str  # "library:<kernel_id>", "default" or "reference"
    flops: float | None
    bytes: float | None
    # With a timed trace: the call's time in seconds (on a GPU, between events on its stream,
    # read once the trace's `seconds()` syncs; on a CPU, the host's clock).
    seconds: float | None = None
    _events: tuple[Any, Any] | None = field(default=None, repr=False)
    _cost: Callable[[], tuple[float, float]] | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return range_name(self.op, self.bucket)


def range_name(op: str, bucket: str) -> str:
    return f"{RANGE_PREFIX}{op}::{bucket}"


@dataclass
class Trace:
    timed: bool = False
    calls: list[Call] = field(default_factory=list)

    def record(self, op: Any, args: tuple, kwargs: dict, call: Callable[[], Any]) -> Any:
        """Run `call` (op `op`'s call on args and kwargs) as a named profiler range, and note it."""
        first = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        bucket = op.bucket(*args, **kwargs)
        # A cost may read sizes back from the device: a timed trace reads it after the timing.
        later = self.timed and op.cost is not None
        cost = op.cost(*args, **kwargs) if op.cost is not None and not later else (None, None)
        events, started = None, 0.0
        if self.timed and first.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        elif self.timed:
            started = time.perf_counter()
        with _RANGE(range_name(op.name, bucket)):
            out = call()
        seconds = None
        if events is not None:
            events[1].record()
        elif self.timed:
            seconds = time.perf_counter() - started
        dtype = str(first.dtype).removeprefix("torch.")
        implementation = DISPATCHER.last.get(op.name, "?")
        call_ = Call(op.name, bucket, dtype, implementation, *cost, seconds=seconds, _events=events)
        if later:
            call_._cost = lambda: op.cost(*args, **kwargs)
        self.calls.append(call_)
        return out

    def seconds(self) -> list[Call]:
        """The calls, each with its time (syncing the device where events time them) and cost."""
        for c in self.calls:
            if c._events is not None and c.seconds is None:
                c._events[1].synchronize()
                c.seconds = c._events[0].elapsed_time(c._events[1]) / 1e3
            if c._cost is not None:
                c.flops, c.bytes = c._cost()
                c._cost = None
        return self.calls


@contextmanager
def trace(*, timed: bool = False) -> Iterator[Trace]:
    """Record the library's calls made inside the block (`timed`: and time each)."""
    recorded = Trace(timed=timed)
    ACTIVE.append(recorded)
    try:
        yield recorded
    finally:
        ACTIVE.remove(recorded)
