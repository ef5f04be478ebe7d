"""Per-pass op benchmark (the attention family, and every op whose gradients are a gradient op):
per op, timing shape and pass (fwd, bwd, fwd+bwd), the kernel under test (`kernels.ops.<op>`)
and every baseline that applies, timed the same way side by side in one process
(sandbox.timing: events, L2 flush, median with p20-p80).

Throughput is on useful FLOPs only (`Problem.flops`: allowed (query, key) pairs, never padding
or masked pairs):

    forward FLOPs    = pairs x heads x 4 D        (2 D for q.k, 2 D for p * v)
    backward FLOPs   = 2.5 x forward FLOPs        five products per pair instead of two:
                                                  q.k recomputed, dP = dO v^T, dV = P^T dO,
                                                  dQ = dS k, dK = dS^T q (FlashAttention's count;
                                                  the same for softmax and pointwise attention)
    fwd+bwd FLOPs    = 3.5 x forward FLOPs
    TFLOP/s          = FLOPs / median time
    fraction of peak = TFLOP/s / the bf16 matrix-product TFLOP/s measured in this same run
                       (an 8192-cube torch.matmul on random data, the best of three medians)
    GB/s             = the pass's minimum bytes / median time: the forward problem's
                       `Problem.bytes` for fwd, the gradient problem's for bwd, their sum for
                       fwd+bwd (the figure that matters for memory-bound ops, a norm's say)
    peak memory      = torch.cuda.max_memory_allocated during one call, less what was allocated
                       before it (the inputs; for bwd also the forward's saved tensors)
    kernel speedup   = a baseline's median time / the kernel's, per shape and pass

The loop reference and its torch.compile are timed forward only: they are the correctness
oracle, and the reference's backward would keep every sequence's score matrices.

For gdpa and target attention, whose eager calls at request shapes are bound by host time, a
second kernel row times the op's forward with its sync-free bounds replayed from a CUDA graph
("kernels.ops, bounds, CUDA graph"), each replay to its last kernel (no host round trip), as a
server replaying graphs would run it. Both kernel rows are compared with every baseline.

Every timed call runs on inputs its provider has never seen (evals.bench_common.FreshInputs):
each pass draws its own, and so does the replayed forward, whose kernel the eager row has
called. Some timed calls are checked: a forward's output against the problem's reference, a
backward's gradients against its gradient problem's (`<op>_grad`, on grad_out and the forward's
arguments, which the backward passes are drawn from); the row says WRONG where one fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from evals.bench_common import FRESH_MAX_SETS, BenchRun, Checked, FreshInputs, select_shapes
from sandbox.judge import baseline_providers
from sandbox.protocol import all_baselines
from sandbox.timing import ArgSet, benchmark
from search_space import get_problem
from search_space.op import Op, get_op
from search_space.problem import Inputs, Problem, Shape

PASSES = ("fwd", "bwd", "fwd+bwd")
BWD_FLOP_FACTOR = 2.5
MATMUL_N = 8192
PEAK_ROUNDS = 3
KERNEL = "kernels.ops"
# The kernel under test with the inputs' launch bounds, replayed from a CUDA graph (forward; see
# launch_bounds), for ops whose bounds a caller may leave out (gdpa, target attention: their
# eager calls are bound by host time at request shapes).
GRAPHED = "kernels.ops, bounds, CUDA graph"
KERNELS = (KERNEL, GRAPHED)
FORWARD_ONLY = ("reference", "reference.compile", GRAPHED)
# A provider's timed calls of a pass compared with the reference (evals.bench_common.FreshInputs):
# one, the same for every provider of the pass, whose reference (a gradient's, for bwd and
# fwd+bwd) takes seconds at the larger shapes.
CHECKED_CALLS = 1
# The replayed forward's timed calls: each replays a graph captured for it, and a capture costs a
# device-wide synchronize and the allocator's cache.
GRAPH_CAPTURES = 20


def pass_flops(forward_flops: float, pass_name: str) -> float:
    """Useful FLOPs of a pass from the forward's (see the module docstring)."""
    factor = {"fwd": 1.0, "bwd": BWD_FLOP_FACTOR, "fwd+bwd": 1.0 + BWD_FLOP_FACTOR}[pass_name]
    return factor * forward_flops


def pass_bytes(op: str, shape: Shape, pass_name: str) -> float:
    """Minimum bytes of a pass: the forward problem's for fwd, its gradient problem's (on the
    same shape: a gradient problem draws the forward's inputs) for bwd, both for fwd+bwd."""
    forward = get_problem(op).bytes(shape)
    if pass_name == "fwd":
        return forward
    backward = get_problem(get_op(op).backward.gradient_op).bytes(shape)
    return backward if pass_name == "bwd" else forward + backward


def measure_matmul_peak(device: torch.device, rounds: int = PEAK_ROUNDS) -> float | None:
    """FLOP/s of an 8192-cube bf16 torch.matmul (2 n^3 FLOPs) on random data, measured now on
    this GPU: the best of `rounds` medians. One median varied from 704 to 758 TFLOP/s between
    two calls of one command on an H200 (clocks under power limits), so the fractions of peak
    are taken against the highest, the stricter bound."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16) for _ in range(2))
    best_us = min(
        benchmark(torch.matmul, [((a, b), {})], device=device, max_reps=50).median_us for _ in range(rounds)
    )
    return 2 * MATMUL_N**3 / (best_us * 1e-6)


def _declaration(op: str) -> Op | None:
    """The op's declaration (search_space.op.Op), or None for a problem that declares none."""
    try:
        return get_op(op)
    except ValueError:
        return None


def timed_per_pass(op: str) -> bool:
    """Whether `op` is benchmarked here, per pass: its declaration computes the gradients with a
    gradient op (search_space.op.Backward), so training runs a dispatched forward and a dispatched
    backward, whose useful FLOPs its problems count."""
    declared = _declaration(op)
    return (
        declared is not None and declared.backward is not None and declared.backward.gradient_op is not None
    )


def launch_bounds(op: str) -> tuple[str, ...]:
    """The launch bounds a caller of `op` may leave out (its declaration's bounds that default to
    None). The problems' inputs carry them, as a model's calls do, so that a call neither syncs
    the host nor checks its inputs on the device and can be captured in a CUDA graph."""
    declared = _declaration(op)
    if declared is None:
        return ()
    parameters = declared.signature.parameters
    return tuple(b for b in declared.bounds if parameters[b].default is None)


def without_bounds(op: str, kwargs: dict) -> dict:
    """kwargs less the op's launch bounds: the call that measures the lengths itself (a host sync)."""
    bounds = launch_bounds(op)
    return {k: v for k, v in kwargs.items() if k not in bounds}


def graphed(
    fn: Callable[[], object], warm: Callable[[], object] | None = None
) -> tuple[Callable[[], None], object]:
    """(replay, outputs): fn captured in a CUDA graph after a warm-up on a side stream, of `warm`
    where given (a call on other inputs: fn's own are then first seen in the capture), else of fn."""
    warm = warm or fn
    warm()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph.replay, outputs


def kernel_under_test(op: str) -> tuple[Callable | None, str]:
    """kernels.ops.<op>, imported only now (it pulls in Triton kernels), or why it is missing."""
    try:
        from kernels import ops
    except Exception as exc:  # a library being written may not import yet; the baselines still run
        return None, f"kernels.ops does not import: {type(exc).__name__}: {exc}"
    fn = getattr(ops, op, None)
    if fn is None:
        return None, f"kernels.ops has no {op}"
    return fn, ""


def _peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del result
    return peak


def _with_grad_leaves(op: str, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
    """The call's arguments with its differentiable ones (its declaration's
    Backward.differentiable: q, k, v of the attention ops, rel_bias where given) replaced by new
    leaves that require grad, and those leaves in that order: the order of the gradients its
    gradient problem returns. A leaf shares its argument's memory (nothing updates it): a graph
    made of a set holds no copy of it."""
    declared = get_op(op)
    positional = list(declared.signature.parameters)[: len(args)]
    named = dict(zip(positional, args, strict=True)) | kwargs
    leaves = {
        name: named[name].detach().requires_grad_()
        for name in declared.backward.differentiable
        if named.get(name) is not None
    }
    call_args = tuple(leaves.get(name, a) for name, a in zip(positional, args, strict=True))
    return call_args, {k: leaves.get(k, v) for k, v in kwargs.items()}, list(leaves.values())


def _providers(problem: Problem, shape: Shape, device: torch.device, kernel: Callable | None) -> dict:
    providers: dict[str, Callable] = {}
    if kernel is not None:
        providers[KERNEL] = kernel
        if launch_bounds(problem.name):
            providers[GRAPHED] = kernel
    # The baselines exactly as the sandbox worker times them, then the shape-dependent ones.
    providers |= baseline_providers(problem, all_baselines(problem), device)
    for name, extra in problem.shape_baselines.items():
        if extra.applies(shape):
            providers[name] = extra.fn
    return providers


@dataclass
class _AtShape:
    """What a timing shape's passes are timed on: the warm-up's sets of the forward problem and of
    its gradient problem (grad_out, then the forward's arguments: the backward passes'), and the
    timed calls' own sets, drawn for each pass (and for the replayed forward) as it comes, after
    the pass's warm-up sets (the pool's budget is what they leave of the GPU's memory)."""

    run: BenchRun
    problem: Problem
    shape: Shape

    @cached_property
    def warmup(self) -> list[ArgSet]:
        return self.run.input_sets(self.problem, self.shape)

    @cached_property
    def grad_warmup(self) -> list[ArgSet]:
        return self.run.input_sets(self.grad_problem, self.shape)

    @property
    def grad_problem(self) -> Problem:
        return get_problem(get_op(self.problem.name).backward.gradient_op)

    def warmup_of(self, pass_name: str) -> list[ArgSet]:
        return self.warmup if pass_name == "fwd" else self.grad_warmup

    def fresh(self, pass_name: str, *, most: int = FRESH_MAX_SETS) -> FreshInputs:
        self.warmup_of(pass_name)
        problem = self.problem if pass_name == "fwd" else self.grad_problem
        return self.run.fresh_inputs(problem, self.shape, checks=CHECKED_CALLS, most=most)

    def release(self, later: tuple[str, ...]) -> None:
        """Frees the warm-up sets that none of the passes `later` runs on (drawn again if asked)."""
        if "fwd" not in later:
            self.__dict__.pop("warmup", None)
        if not set(later) - {"fwd"}:
            self.__dict__.pop("grad_warmup", None)


def _timed(stats, checked: Checked, peak_mem_bytes: int | None) -> dict:
    return {
        "stats": stats,
        "correct": checked.ok,
        "message": checked.failure or "",
        "checked_calls": checked.calls,
        "peak_mem_bytes": peak_mem_bytes,
    }


def _time_forward(fn, at: _AtShape, fresh: FreshInputs, device) -> dict:
    checked = Checked()
    stats = benchmark(fn, at.warmup, device=device, **fresh.timing(checked))
    args, kwargs = at.warmup[0]
    return _timed(stats, checked, _peak_bytes(lambda: fn(*args, **kwargs), device))


def _replayed(replay: Callable[[], None], outputs: object) -> object:
    replay()
    return outputs


def _time_graph_replay(fn, at: _AtShape, device) -> dict:
    """The forward of `fn` with the inputs' launch bounds, captured in a CUDA graph and timed by
    replays, each to its last kernel (`joined_streams`: capture admits no work left on another
    stream). Each timed replay is of a graph captured for it (outside its events) on a set of
    its own, never seen by fn before: fn's host code runs only in a capture, where a memo would
    put a copy of what it kept in the graph, and a graph replayed again would give its kernels
    inputs they have seen. A kernel that cannot be captured (a library kernel that syncs) is an
    error row."""
    if device.type != "cuda":
        return {"skipped": "CUDA graphs need a GPU"}
    with torch.no_grad():
        warm = [(graphed(partial(fn, *args, **kwargs)), {}) for args, kwargs in at.warmup]
    fresh = at.fresh("fwd", most=GRAPH_CAPTURES)
    args, kwargs = at.warmup[0]
    other = partial(fn, *args, **kwargs)

    def capture(i: int) -> ArgSet:
        """Set i's graph, replayed once with zeros for the set's floating-point tensors: a graph's
        first replay also uploads the graph to the device, work no later replay does, and its
        kernels then meet the set's values first in the timed replay. The values wait on the
        host meanwhile: the GPU holds no second copy of the set."""
        with torch.no_grad():
            args, kwargs = fresh.args(i)
            replay, outputs = graphed(partial(fn, *args, **kwargs), warm=other)
            values = [t for t in fresh.sets[i].tensors() if t.is_floating_point()]
            kept = [t.cpu() for t in values]
            for t in values:
                t.zero_()
            replay()
            for t, k in zip(values, kept, strict=True):
                t.copy_(k)
        return (replay, outputs), {}

    checked = Checked()
    stats = benchmark(_replayed, warm, device=device, joined_streams=True, **fresh.timing(checked, capture))
    return _timed(stats, checked, None)


def _keep_saved_buffers():
    """A context in which torch.compile's backward graphs do not donate (free) the tensors saved
    for them: the bwd pass runs one graph's backward many times (retain_graph), which donated
    buffers refuse. Nothing to patch on a torch without the option."""
    try:
        from torch._functorch import config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(config, "donated_buffer"):
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False)


def _time_backward(fn, op, at: _AtShape, fresh: FreshInputs, device, pass_name) -> dict:
    with _keep_saved_buffers():
        return _time_backward_pass(fn, op, at, fresh, device, pass_name)


def _gradient_call(op: str, inputs: Inputs) -> tuple[tuple, dict, list[torch.Tensor], torch.Tensor]:
    """(args, kwargs, leaves, grad_out) of the forward call on a gradient problem's inputs
    (grad_out, then the forward's arguments), its differentiable arguments as leaves."""
    grad_out, *args = inputs.args
    return (*_with_grad_leaves(op, tuple(args), inputs.kwargs), grad_out)


def _differentiated(fn, op: str, inputs: Inputs) -> tuple:
    """(output, leaves, grad_out) of fn on a gradient problem's inputs: a graph to differentiate."""
    call_args, call_kwargs, leaves, grad_out = _gradient_call(op, inputs)
    return fn(*call_args, **call_kwargs), leaves, grad_out


def _backward(out, leaves, grad_out):
    # The warm-up's graphs are differentiated again and again.
    return torch.autograd.grad(out, leaves, grad_out, retain_graph=True, allow_unused=True)


def _forward_backward(fn, call_args, call_kwargs, leaves, grad_out):
    return torch.autograd.grad(fn(*call_args, **call_kwargs), leaves, grad_out, allow_unused=True)


def _time_backward_pass(fn, op, at: _AtShape, fresh: FreshInputs, device, pass_name) -> dict:
    """bwd: the gradients of a forward graph made outside the events, one for each timed call, of
    its own set; fwd+bwd: the forward and its gradients, on leaves of the timed call's set. Both
    compared with the gradient problem's reference on some of the calls' sets."""
    warm_inputs = [Inputs(args=args, kwargs=kwargs) for args, kwargs in at.grad_warmup]
    checked = Checked()
    if pass_name == "bwd":
        graphs = [_differentiated(fn, op, inputs) for inputs in warm_inputs]
        if not graphs[0][0].requires_grad:
            return {"skipped": "no autograd"}
        timing = fresh.timing(checked, lambda i: (_differentiated(fn, op, fresh.sets[i]), {}))
        stats = benchmark(_backward, [(g, {}) for g in graphs], device=device, **timing)
        return _timed(stats, checked, _peak_bytes(lambda: _backward(*graphs[0]), device))

    def leaves_of(inputs: Inputs) -> tuple:
        return (fn, *_gradient_call(op, inputs))

    calls = [leaves_of(inputs) for inputs in warm_inputs]
    _, call_args, call_kwargs, _, _ = calls[0]
    if not fn(*call_args, **call_kwargs).requires_grad:
        return {"skipped": "no autograd"}
    timing = fresh.timing(checked, lambda i: (leaves_of(fresh.sets[i]), {}))
    stats = benchmark(_forward_backward, [(c, {}) for c in calls], device=device, **timing)
    return _timed(stats, checked, _peak_bytes(lambda: _forward_backward(*calls[0]), device))


def _measure(name, fn, pass_name, at: _AtShape, fresh: FreshInputs | None, device) -> dict:
    """One provider on one pass; failures (out of memory, unsupported) become the row's note.
    `fresh`: the pass's timed calls' sets, shared by its providers (but the replayed forward,
    which draws its own)."""
    if pass_name != "fwd" and name in FORWARD_ONLY:
        return {
            "skipped": "forward only ("
            + ("the replayed forward" if name == GRAPHED else "correctness oracle")
            + ")"
        }
    try:
        if name == GRAPHED:
            return _time_graph_replay(fn, at, device)
        assert fresh is not None
        if pass_name == "fwd":
            return _time_forward(fn, at, fresh, device)
        return _time_backward(fn, at.problem.name, at, fresh, device, pass_name)
    except torch.cuda.OutOfMemoryError:
        return {"error": "out of memory"}
    except NotImplementedError as exc:
        return {"skipped": str(exc).splitlines()[0][:120]}
    except Exception as exc:  # a baseline or kernel failing at one shape must not stop the run
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_attention_benchmark(
    op: str,
    *,
    library: str | Path | None = None,
    console: Console | None = None,
    passes: tuple[str, ...] = PASSES,
    shapes: tuple[Shape, ...] | None = None,
    only_shapes: list[str] | None = None,
    without: list[str] | None = None,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Benchmark one op timed per pass (timed_per_pass: the attention ops); returns the rows
    (also printed as a table). `only_shapes` keeps the shapes whose name contains one of its
    substrings; `without` names providers to leave out (e.g. the loop reference at sizes where it
    takes minutes); `on_row` gets each row as soon as its shape and pass are measured (a run
    stopped midway keeps what it measured)."""
    problem = get_problem(op)
    if not timed_per_pass(op):
        raise ValueError(f"{op} computes no gradients with a gradient op: it has no passes to time")
    unknown = set(passes) - set(PASSES)
    if unknown:
        raise ValueError(f"unknown passes {sorted(unknown)}; known: {', '.join(PASSES)}")
    console = console or Console()
    run = BenchRun.here()
    device = run.device
    shapes = run.shapes(problem, only_shapes) if shapes is None else select_shapes(shapes, only_shapes)
    if library is not None:
        from kernels.registry import DISPATCHER

        DISPATCHER.use_library(library)
    kernel, missing = kernel_under_test(op)
    if kernel is None:
        console.print(f"[yellow]{missing}: timing the baselines alone[/]")
    peak = measure_matmul_peak(device)
    title = run.title(op)
    if peak:
        title += f"; measured bf16 matmul {peak / 1e12:.0f} TFLOP/s"
    table = Table(
        "shape",
        "pass",
        "provider",
        "median ms",
        "p20-p80 ms",
        "TFLOP/s",
        "of bf16 peak",
        "GB/s",
        "peak mem",
        "kernel speedup",
        "check",
        title=title,
    )
    rows: list[dict] = []
    for shape in shapes:
        at = _AtShape(run=run, problem=problem, shape=shape)
        forward_flops = problem.flops(shape)
        providers = {
            name: fn
            for name, fn in _providers(problem, shape, device, kernel).items()
            if name not in (without or ())
        }
        for index, pass_name in enumerate(passes):
            # The pass's timed calls' sets, shared by its providers: never seen by the kernel,
            # whose earlier passes ran on sets of their own. Freed before the replayed forward
            # draws its own.
            timed_here = [
                n for n in providers if n != GRAPHED and (pass_name == "fwd" or n not in FORWARD_ONLY)
            ]
            fresh = at.fresh(pass_name) if timed_here else None
            results = {
                name: _measure(name, providers[name], pass_name, at, fresh, device) for name in timed_here
            }
            del fresh
            results |= {
                name: _measure(name, fn, pass_name, at, None, device)
                for name, fn in providers.items()
                if name not in results
            }
            results = {name: results[name] for name in providers}
            at.release(passes[index + 1 :])
            kernel_us = results.get(KERNEL, {}).get("stats")
            kernel_us = kernel_us.median_us if kernel_us else None
            flops = pass_flops(forward_flops, pass_name)
            moved = pass_bytes(op, shape, pass_name)
            timed = {n: r["stats"].median_us for n, r in results.items() if "stats" in r}
            for name, r in results.items():
                row = _row(op, name, shape, pass_name, flops, peak, r, kernel_us, timed)
                row |= {"bytes": moved}
                if "p50_us" in row:
                    row["gbps"] = moved / (row["p50_us"] * 1e-6) / 1e9
                row |= run.fields()
                rows.append(row)
                table.add_row(*_cells(row))
                if on_row is not None:
                    on_row(row)
        del at
        if device.type == "cuda":
            torch.cuda.empty_cache()
    run.finish(console, table)
    return rows


def _row(op, name, shape, pass_name, flops, peak, r, kernel_us, timed) -> dict:
    row = {
        "op": op,
        "provider": name,
        "shape": shape.name,
        "dtype": shape.dtype,
        "pass": pass_name,
        "flops": flops,
        "matmul_peak_flops": peak,
    }
    if "stats" not in r:
        return row | {"skipped": r.get("skipped"), "error": r.get("error")}
    stats = r["stats"]
    tflops = flops / (stats.median_us * 1e-6) / 1e12
    row |= {
        "p50_us": stats.median_us,
        "p20_us": stats.p20_us,
        "p80_us": stats.p80_us,
        "timed_calls": stats.reps,
        "tflops": tflops,
        "peak_fraction": tflops * 1e12 / peak if peak else None,
        "peak_mem_bytes": r["peak_mem_bytes"],
        "correct": r["correct"],
        "message": r["message"],
        "checked_calls": r["checked_calls"],
    }
    if name in KERNELS:  # the kernel eagerly and replayed, each against every baseline
        row["speedup_vs"] = {n: us / stats.median_us for n, us in timed.items() if n not in KERNELS}
    else:
        row["kernel_speedup"] = stats.median_us / kernel_us if kernel_us else None
    return row


def _cells(row: dict) -> list[str]:
    head = [row["shape"], row["pass"], row["provider"]]
    if "p50_us" not in row:
        note = (row.get("error") or row.get("skipped") or "")[:48]
        return [*head, "-", "-", "-", "-", "-", "-", "-", f"[red]{note}[/]" if row.get("error") else note]
    mem = row["peak_mem_bytes"]
    check = {True: "ok", False: f"WRONG {row['message'][:40]}", None: "-"}[row["correct"]]
    speedup = row.get("kernel_speedup")
    return [
        *head,
        f"{row['p50_us'] / 1e3:.3f}",
        f"{row['p20_us'] / 1e3:.3f}-{row['p80_us'] / 1e3:.3f}",
        f"{row['tflops']:.3g}",
        f"{100 * row['peak_fraction']:.0f}%" if row["peak_fraction"] else "n/a",
        f"{row['gbps']:.0f}" if row.get("gbps") is not None else "-",
        f"{mem / 2**20:.0f} MiB" if mem is not None else "n/a",
        f"{speedup:.2f}x" if speedup else "-",
        check,
    ]
