"""Dispatch overhead: the host time `kernels.registry.DISPATCHER.resolve` takes to choose the
kernel for one call, with a library holding several entries per op (so the choice is real), on
this machine's device: a GPU's architecture where there is one, else the interpreter's.

A choice is made once per (op, device, dtype, bucket, graph) and manifest version; what every
call pays is one cache lookup and the bookkeeping (the manifest is looked at again every
`kernels.registry.RECHECK_S` seconds, or after a write in this process). The kernel's launch is not
part of it (`recforge bench ops` times the ops whole). Per declared op, `run_op_dispatch_benchmark`
times what every call pays before its kernel: the op's shape bucket and the choice for it."""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time

import torch

from kernels.registry import ARCH_INTERPRETER, DISPATCHER, device_arch
from search_space.embedding_bag import TEMPLATE

ENTRIES = (4, 8, 16, 32)  # BLOCK_L of the entries registered for the measured key


def _device() -> torch.device:
    """The GPU, else the CPU with Triton's interpreter (where the library's kernels run there)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return device


def _means_us(fn, calls: int, repeats: int) -> list[float]:
    """The mean host microseconds of `fn()` over `calls` calls, `repeats` times (after one call:
    a choice's import, a cache's first entry)."""
    fn()
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - start) / calls * 1e6)
    return means


def run_dispatch_benchmark(calls: int = 20_000, repeats: int = 7) -> dict:
    """Median (over `repeats`) of the mean host microseconds per resolve, with entries of the
    key, and without (the default kernel)."""
    import kernels.ops  # noqa: F401  (registers the ops)

    device = _device()
    arch = device_arch(device)
    original = DISPATCHER.library
    rows = {}
    try:
        with tempfile.TemporaryDirectory(prefix="recforge-dispatch-") as root:
            library = DISPATCHER.use_library(root)
            for block in ENTRIES:
                library.add(
                    op="embedding_bag", entry=TEMPLATE.entry, source=TEMPLATE.render({"BLOCK_L": block}),
                    arch=arch, dtype="fp32", buckets=["d64-long"], median_us=float(block),
                    interpreted=arch == ARCH_INTERPRETER, evidence={}, provenance={},
                )  # fmt: skip
            for name, bucket in (("library entry", "d64-long"), ("default kernel", "d128-long")):
                key = dict(device=device, dtype="fp32", bucket=bucket)
                chosen = DISPATCHER.resolve("embedding_bag", **key).name  # the choice, the import
                if chosen.startswith("library:") != (name == "library entry"):
                    raise RuntimeError(f"dispatch chose {chosen} for the {name} case")
                means = _means_us(lambda k=key: DISPATCHER.resolve("embedding_bag", **k), calls, repeats)
                rows[name] = {"us_per_call": statistics.median(means), "spread": max(means) - min(means)}
    finally:
        DISPATCHER._library = original
    return {"device": str(device), "arch": arch, "entries": len(ENTRIES), "calls": calls, "rows": rows}


def run_op_dispatch_benchmark(calls: int = 5_000, repeats: int = 5) -> dict:
    """Per declared op, the host microseconds of what every call pays before its kernel: the
    op's shape bucket (from its arguments' shapes and bounds) and the choice of kernel for it,
    on the inputs of the op's first check shape (a bucket reads shapes and bounds, never data,
    so their size does not matter)."""
    from kernels import ops
    from search_space import get_problem, problem_names
    from search_space.op import get_op

    device = _device()
    rows = {}
    for name in problem_names():
        try:
            op = get_op(name)
        except ValueError:  # a problem without an op of its own
            continue
        ops.op(op.gradient_of or name)  # defines the op (and its gradient op) with its default kernels
        problem = get_problem(name)
        shape = problem.check_shapes[0]
        inputs = problem.without_statistics(problem.make_inputs(shape, 7, device))
        bucket = functools.partial(op.bucket, *inputs.args, **inputs.kwargs)
        key = {"device": device, "dtype": shape.dtype}

        def choice(b=bucket, k=key, n=name) -> None:
            DISPATCHER.resolve(n, bucket=b(), **k)

        rows[name] = {
            "bucket": bucket(),
            "bucket_us": statistics.median(_means_us(bucket, calls, repeats)),
            "total_us": statistics.median(_means_us(choice, calls, repeats)),
        }
    return {"device": str(device), "arch": device_arch(device), "calls": calls, "rows": rows}
