"""Every problem's incumbents (the default kernels dispatch runs) through the sandbox, checked and
timed as a campaign evaluates them: the honest controls of the evaluator. Each must come out ok;
the table shows, per timing shape, the runner's event median beside the judge's own clock per
call and the share of that clock the events account for (what `sandbox.judge.Calibration.audit`
bounds), and how many timed calls were checked.

    python3 -m evals.sandbox_defaults [--problems a,b] [--parallel N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

from rich.console import Console
from rich.table import Table

from agent.incumbents import campaign_arch, incumbents
from kernels.registry import DISPATCHER
from sandbox.local import LocalBackend
from search_space import problem_names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m evals.sandbox_defaults")
    parser.add_argument("--problems", default=",".join(problem_names()))
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", default=None, help="write every result here")
    args = parser.parse_args(argv)
    library = DISPATCHER.library
    # The backend runs as many of the pool's evaluations at once as its `parallel` says.
    backend = LocalBackend(timeout_s=args.timeout, parallel=args.parallel)
    arch = campaign_arch()
    jobs = []
    for name in args.problems.split(","):
        try:
            jobs += [(name, c) for c in incumbents(name, library, arch)[:1]]
        except AttributeError:  # a problem with neither a dispatched default nor a template
            print(f"{name}: no incumbent to evaluate")
    t0 = time.perf_counter()

    def evaluate(job):
        # A line as each one ends, so that a run cut short still says what it found.
        result = backend.evaluate(job[1])
        phases = " ".join(f"{k} {v:.0f}" for k, v in result.phase_s.items())
        line = f"{job[0]}: {result.status.value} in {result.wall_s:.0f} s ({phases})"
        print(line, result.message[:300], flush=True)
        return result

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        results = list(pool.map(evaluate, jobs))
    wall = time.perf_counter() - t0
    columns = ("problem", "status", "checks", "shape", "dtype", "event p50 us", "judge us/call",
               "accounted", "checked", "s")  # fmt: skip
    table = Table(*columns, title=f"incumbents through the sandbox ({wall:.0f} s)")
    for (name, _), r in zip(jobs, results, strict=True):
        status = r.status.value + ("" if r.status.value == "ok" else f": {r.message[:120]}")
        if not r.timings:
            table.add_row(name, status, str(len(r.checks)), "", "", "", "", "", "", f"{r.wall_s:.0f}")
        for i, t in enumerate(r.timings):
            table.add_row(
                name if i == 0 else "",
                status if i == 0 else "",
                str(len(r.checks)) if i == 0 else "",
                t.shape,
                t.dtype,
                f"{t.candidate.median_us:.1f}",
                "" if t.outside_us is None else f"{t.outside_us:.1f}",
                "" if t.accounted is None else f"{t.accounted:.3f}",
                str(t.checked_calls),
                f"{r.wall_s:.0f}" if i == 0 else "",
            )
    Console(width=200).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.model_dump(mode="json") for r in results], f)
    return 0 if all(r.status.value == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
