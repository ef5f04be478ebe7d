"""Op benchmarks: every provider of an op timed the same way, side by side, in one process.
An op whose declaration computes its gradients with a gradient op (the attention ops,
layer_norm_gate) is timed per pass instead (evals/bench_attention.py: forward and backward
through kernels.ops, TFLOP/s on useful FLOPs and GB/s on minimum bytes); `run_op_benchmark`
hands it over.

Embedding-bag throughput is on the problem's minimum bytes (`Problem.bytes`: each gathered row
read once per occurrence, indices and offsets read, output written once):

    achieved GB/s      = min_bytes / median_time
    fraction of copy   = achieved bandwidth / device-to-device copy bandwidth measured in
                         this same run (bytes read plus written)

and every op's TFLOP/s on the problem's FLOPs (`Problem.flops`), for the compute-bound ones
(grouped GEMMs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor

from evals.bench_attention import PASSES, run_attention_benchmark, timed_per_pass
from evals.bench_common import BenchRun, Checked
from kernels.registry import DISPATCHER, KernelLibrary, device_arch, device_name
from sandbox.judge import baseline_providers
from sandbox.protocol import all_baselines
from sandbox.timing import benchmark
from search_space import get_problem, problem_names
from search_space.problem import Problem

COPY_BYTES = 2 * 1024**3
# A provider's timed calls compared with the reference (evals.bench_common.FreshInputs): the same
# two for every provider of a shape.
CHECKED_CALLS = 2
FAMILIES = ("embedding", "attention", "all")


def family_ops(family: str) -> list[str]:
    """The problems of an op family (every problem for "all")."""
    if family not in FAMILIES:
        raise ValueError(f"unknown op family {family!r}; known: {', '.join(FAMILIES)}")
    wanted = [f for f in FAMILIES if f != "all"] if family == "all" else [family]
    return [n for n in problem_names() if get_problem(n).op_family in wanted]


def run_family_benchmark(family: str, **options) -> list[dict]:
    """run_op_benchmark for every op of the family, one after another (same options)."""
    rows: list[dict] = []
    for op in family_ops(family):
        rows += run_op_benchmark(op, **options)
    return rows


def measure_copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    if device.type != "cuda":
        return None
    src = torch.empty(COPY_BYTES // 2, dtype=torch.uint8, device=device).random_(0, 255)
    stats = benchmark(Tensor.copy_, [((torch.empty_like(src), src), {})], device=device, max_reps=50)
    return COPY_BYTES / (stats.median_us * 1e-6)


def _providers(problem: Problem, library: KernelLibrary, device: torch.device, shape) -> dict[str, Callable]:
    from kernels import ops
    from search_space.op import get_op

    with contextlib.suppress(ValueError):  # defines the op (a gradient op: its forward) and its default
        ops.op(get_op(problem.name).gradient_of or problem.name)
    # The baselines exactly as the sandbox worker times them.
    providers: dict[str, Callable] = baseline_providers(problem, all_baselines(problem), device)
    with contextlib.suppress(ValueError):  # not every problem has a hand-written kernel
        providers["default kernel"] = DISPATCHER.default(problem.name)
    entry = library.best(
        problem.name, device_arch(device), shape.dtype, problem.bucket(shape), gpu=device_name(device)
    )
    if entry is not None:
        providers["best registered"] = library.load(entry)
    return providers


def run_op_benchmark(
    op: str,
    *,
    library: str | Path | None = None,
    console: Console | None = None,
    only_shapes: list[str] | None = None,
    without: list[str] | None = None,
    passes: tuple[str, ...] | None = None,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Every provider of `op` timed at each timing shape, on inputs it has never seen
    (evals.bench_common.FreshInputs), some of its timed calls checked against the reference: a
    row whose check failed says WRONG. `only_shapes`: substrings of the timing shapes to run;
    `without`: providers to leave out; `passes`: for ops timed per pass, among fwd, bwd,
    fwd+bwd; `on_row`: called with each row as soon as it is measured."""
    problem = get_problem(op)
    if timed_per_pass(op):
        return run_attention_benchmark(
            op,
            library=library,
            console=console,
            only_shapes=only_shapes,
            without=without,
            passes=passes or PASSES,
            on_row=on_row,
        )
    console = console or Console()
    run = BenchRun.here()
    device = run.device
    lib = KernelLibrary(library) if library else DISPATCHER.library
    copy_bw = measure_copy_bandwidth(device)
    title = run.title(op)
    if copy_bw:
        title += f"; measured copy bandwidth {copy_bw / 1e12:.2f} TB/s"
    table = Table(
        "shape",
        "dtype",
        "provider",
        "median us",
        "p20-p80 us",
        "GB/s",
        "of copy BW",
        "TFLOP/s",
        "vs torch",
        "check",
        title=title,
    )
    rows = []
    for shape in run.shapes(problem, only_shapes):
        warmup = run.input_sets(problem, shape)
        fresh = run.fresh_inputs(problem, shape, checks=CHECKED_CALLS)
        nbytes, nflops = problem.bytes(shape), problem.flops(shape)
        results = {}
        providers = _providers(problem, lib, device, shape)
        for name, fn in [(n, f) for n, f in providers.items() if n not in (without or ())]:
            checked = Checked()
            # Each call to its end event on the current stream, as the judge times candidates and
            # baselines: torch's ops and the library's Triton launches stay on it (a library
            # kernel was registered only after the judge's own clock accounted for its work). An
            # end event after a device-wide synchronize adds the host's round trip, about 12 us
            # on an H100: a fifth of a call at the jagged transforms' smaller shapes.
            stats = benchmark(fn, warmup, device=device, joined_streams=True, **fresh.timing(checked))
            results[name] = (stats, checked)
        torch_us = next((s.median_us for n, (s, _) in results.items() if n.startswith("torch.")), None)
        for name, (stats, checked) in results.items():
            gbps = nbytes / (stats.median_us * 1e-6) / 1e9
            frac = gbps * 1e9 / copy_bw if copy_bw else None
            speedup = torch_us / stats.median_us if torch_us else None
            table.add_row(
                shape.name,
                shape.dtype,
                name,
                f"{stats.median_us:.1f}",
                f"{stats.p20_us:.1f}-{stats.p80_us:.1f}",
                f"{gbps:.0f}",
                f"{100 * frac:.0f}%" if frac else "n/a",
                f"{nflops / (stats.median_us * 1e-6) / 1e12:.2f}",
                f"{speedup:.2f}x" if speedup else "n/a",
                "ok" if checked.ok else f"WRONG {checked.failure[:40]}",
            )
            rows.append(
                {
                    "op": op,
                    "provider": name,
                    "shape": shape.name,
                    "dtype": shape.dtype,
                    "p50_us": stats.median_us,
                    "p20_us": stats.p20_us,
                    "p80_us": stats.p80_us,
                    "gbps": gbps,
                    "copy_fraction": frac,
                    "tflops": nflops / (stats.median_us * 1e-6) / 1e12,
                    "speedup_vs_torch": speedup,
                    "timed_calls": stats.reps,
                    "correct": checked.ok,
                    "message": checked.failure or "",
                    "checked_calls": checked.calls,
                    **run.fields(),
                }
            )
            if on_row is not None:
                on_row(rows[-1])
        del warmup, fresh
        if device.type == "cuda":
            torch.cuda.empty_cache()
    run.finish(console, table)
    return rows
