"""Sandbox throughput: candidate evaluations per hour on a realistic mix.

The mix follows what a campaign sends: most candidates are knob settings of the template that
compile and pass, a third are wrong (a bug in the mean path, found only on some check shapes),
and a few crash (raise inside the entry). Each is checked on every check shape and, if correct,
timed on the problem's timing shapes, exactly as in a campaign; the baselines are timed once,
as a campaign's first batch of a problem times them (sandbox.locks.BaselineClaims).

    evaluations per hour = number of candidates / wall seconds * 3600
"""

from __future__ import annotations

import random
import time
from collections import Counter

from rich.console import Console
from rich.table import Table

from sandbox.candidate import Candidate
from search_space.embedding_bag import TEMPLATE

WRONG_EDIT = ("acc_BD = acc_BD / tl.maximum", "acc_BD = acc_BD * 2 / tl.maximum")
CRASH_LINE = '    raise RuntimeError("crashed on purpose")\n'


def realistic_mix(n: int, seed: int = 0) -> list[Candidate]:
    """`n` distinct candidates: about 60% correct, a third wrong, the rest crashing."""
    rng = random.Random(seed)
    settings, seen = [], set()
    while len(settings) < n:
        knobs = {k.name: rng.choice(k.choices) for k in TEMPLATE.knobs}
        try:
            source = TEMPLATE.render(knobs)
        except ValueError:
            continue  # a constraint: the proposer would not send it either
        if source not in seen:
            seen.add(source)
            settings.append((knobs, source))
    out = []
    for i, (knobs, source) in enumerate(settings):
        kind = "wrong" if i % 3 == 1 else "crash" if i % 10 == 9 else "correct"
        if kind == "wrong":
            source = source.replace(*WRONG_EDIT)
        elif kind == "crash":
            source = source.replace(
                '    """weight [num_rows, D]', CRASH_LINE + '    """weight [num_rows, D]', 1
            )
        out.append(
            Candidate(
                problem="embedding_bag", source=source, entry=TEMPLATE.entry, knobs=knobs, origin="template"
            )
        )
    return out


def mean_phases(results) -> dict[str, float]:
    """Mean seconds per worker phase, with `startup` = wall minus the worker's own phases."""
    totals: Counter = Counter()
    for r in results:
        totals.update(r.phase_s)
        totals["startup"] += r.unphased_s()
    return {name: total / len(results) for name, total in totals.items()}


def _phases(result) -> str:
    """One evaluation's phases and lock holds, in seconds, for its progress line."""
    parts = [f"{name} {seconds:.1f}" for name, seconds in result.phase_s.items() if seconds >= 0.05]
    parts.append(f"judge start-up {result.unphased_s():.1f}")
    parts += [f"held {kind} {seconds:.1f}" for kind, seconds in sorted(result.gpu_held_s.items())]
    return ", ".join(parts)


def _evaluate_all(
    backend, candidates: list[Candidate], baselines: list[str], t0: float, console: Console
) -> list:
    """The candidates evaluated as a campaign's first batch of a problem is: with a backend that
    times the baselines once per kind within a call (Backend.baselines_once), all in one call,
    as many at once as it takes; with another, the first alone, to time them where it lands,
    then the rest. Each result is printed as it comes: a run cut short still shows what it
    measured."""

    def show(i: int, result) -> None:
        timed = " (timed the baselines)" if result.timed_baselines else ""
        console.print(
            f"{time.perf_counter() - t0:6.1f} s  #{i + 1:<3} {result.status.value:14} "
            f"judge {result.wall_s:5.1f} s: {_phases(result)}{timed}",
            style="dim",
        )
        if "beside_out_of_memory" in result.phase_s:  # run again alone: why the first run failed
            console.print(f"         {result.log_tail.partition(chr(10))[0][:300]}", style="dim")

    if getattr(backend, "baselines_once", False):
        return backend.evaluate_many(candidates, baselines=baselines, on_result=show)
    first = backend.evaluate(candidates[0], baselines=baselines)
    show(0, first)
    held = [first.kind] if first.kind is not None and first.timed_baselines else []
    rest = backend.evaluate_many(
        candidates[1:], baselines=baselines, baselines_held_on=held, on_result=lambda i, r: show(i + 1, r)
    )
    return [first, *rest]


def run_sandbox_benchmark(backend, n: int, *, baselines: list[str], console: Console | None = None) -> dict:
    """Evaluate the mix as a campaign's first batch (the baselines timed once, beside the
    candidates' evaluations where the backend can), then, where the backend keeps compiled
    artifacts, evaluate the first correct candidate once more, as a campaign's re-verification
    does, to show what reusing its compiled kernels saves."""
    console = console or Console()
    candidates = realistic_mix(n)
    t0 = time.perf_counter()
    results = _evaluate_all(backend, candidates, baselines, t0, console)
    wall = time.perf_counter() - t0
    statuses = Counter(r.status.value for r in results)
    interpreted = any(r.interpreted for r in results)
    per_hour = len(results) / wall * 3600
    timers = [i for i, r in enumerate(results) if r.timed_baselines]
    phases = mean_phases(results)
    table = Table(
        "candidates",
        "wall s",
        "evaluations per hour",
        "baselines timed by",
        "statuses",
        "backend",
        title="sandbox throughput" + (" (interpreted Triton on a CPU)" if interpreted else ""),
    )
    table.add_row(
        str(len(results)),
        f"{wall:.1f}",
        f"{per_hour:.0f}",
        ", ".join(f"#{i + 1} ({results[i].wall_s:.1f} s)" for i in timers) or "none",
        ", ".join(f"{k} {v}" for k, v in statuses.most_common()),
        backend.name,
    )
    console.print(table)
    for candidate, result in zip(candidates, results, strict=True):
        if result.status.value != "ok":  # what each wrong one was told, so a false positive shows
            console.print(f"{candidate.id} {result.status.value}: {result.message[:300]}", style="dim")
    console.print(
        "mean seconds per evaluation: "
        + ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(phases.items()))
    )
    held: Counter = Counter()
    for r in results:
        held.update(r.gpu_held_s)
    # The exclusive holds (timed batches, one evaluation at a time on a GPU) against the wall: near
    # 100%, timing itself bounds the throughput. Shared holds overlap, so theirs can pass 100%.
    if held:
        console.print(
            "GPU's lock held, all evaluations: "
            + ", ".join(
                f"{kind} {seconds:.1f} s ({seconds / wall:.0%} of the wall)"
                for kind, seconds in sorted(held.items())
            )
        )
    summary = {
        "candidates": len(results),
        "wall_s": wall,
        "evaluations_per_hour": per_hour,
        "baselines_timed_by": [{"candidate": i + 1, "wall_s": results[i].wall_s} for i in timers],
        "statuses": dict(statuses),
        "interpreted": interpreted,
        "backend": backend.name,
        "mean_phase_s": phases,
        "gpu_held_s": dict(held),
    }
    reevaluated = next(  # one that timed no baselines: its walls then compare
        (
            (c, r)
            for i, (c, r) in enumerate(zip(candidates, results, strict=True))
            if r.status.value == "ok" and i not in timers
        ),
        None,
    )
    if getattr(backend, "artifacts", None) is not None and reevaluated is not None:
        candidate, before = reevaluated
        again = backend.evaluate(candidate)
        summary["reevaluation"] = {
            "status": again.status.value,
            "artifacts_reused": again.artifacts_reused,
            "first": {"wall_s": before.wall_s, **before.phase_s},
            "again": {"wall_s": again.wall_s, **again.phase_s},
        }
        console.print(
            f"re-evaluation of {candidate.id} ({again.status.value}, compiled kernels reused: "
            f"{again.artifacts_reused}): load+check {_compile_bound(before):.1f} s first, "
            f"{_compile_bound(again):.1f} s again; wall {before.wall_s:.1f} s, then {again.wall_s:.1f} s"
        )
    return summary


def _compile_bound(result) -> float:
    """Seconds of the phases where kernels compile (first launch per specialization)."""
    return result.phase_s.get("load", 0.0) + result.phase_s.get("check", 0.0)
