"""Evaluations per hour against the number of GPUs, in one run: the same candidates through the
local backend on 1 GPU, then on 2 (or the counts given), one timing worker per GPU.

    python3 -m evals.bench_scaling [--gpus 1,2] [--candidates 24] [--parallel 1] [--json PATH]

The candidates are the sandbox benchmark's realistic mix of the embedding-bag template's
variants (evals.bench_sandbox.realistic_mix: most correct, a third wrong, a few crashing), each
checked on every check shape and, if correct, timed on the timing shapes, as in a campaign; no
baselines are timed (a campaign times them once per kind of device, not per candidate). Each
count starts from the same state: the judges' fork server already running, no compiled kernel
kept from an earlier run (each evaluation compiles in its own scratch directory).

    evaluations per hour = candidates / wall seconds * 3600
    scaling on N GPUs = (evaluations per hour on N) / (evaluations per hour on the first count)

On a host without a GPU it runs as a smoke run in the Triton interpreter: there N is a number of
CPU slots (evaluations at once, with no timing lock between them), which stand in for GPUs and
say nothing of how evaluations scale with GPUs.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evals.bench_sandbox import realistic_mix
from sandbox.gpus import visible_gpus
from sandbox.local import LocalBackend


def run_scaling(counts: list[int], n: int, *, parallel: int = 1, timeout_s: float = 600.0) -> dict:
    """Evaluate the same `n` candidates once per count of GPUs in `counts` (CPU slots where the
    host has none): a row per count with its wall time, evaluations per hour and scaling."""
    gpus = visible_gpus()
    if gpus and max(counts) > len(gpus):
        raise ValueError(f"--gpus asks for {max(counts)} GPUs; this host shows {len(gpus)}")
    candidates = realistic_mix(n)
    rows = []
    for count in counts:
        if gpus:
            backend = LocalBackend(timeout_s=timeout_s, gpus=gpus[:count], parallel=parallel)
        else:  # CPU slots: evaluations at once, standing in for GPUs
            backend = LocalBackend(timeout_s=timeout_s, parallel=count * parallel)
        backend.warm_up()
        t0 = time.perf_counter()
        results = backend.evaluate_many(candidates)
        wall = time.perf_counter() - t0
        per_gpu = Counter(r.device.visible_devices for r in results if r.device is not None)
        rows.append(
            {
                "count": count,
                "wall_s": wall,
                "evaluations": len(results),
                "evaluations_per_hour": len(results) / wall * 3600,
                "statuses": dict(Counter(r.status.value for r in results)),
                "per_gpu": {str(k): v for k, v in sorted(per_gpu.items(), key=str)},
            }
        )
    for row in rows:
        row["scaling"] = row["evaluations_per_hour"] / rows[0]["evaluations_per_hour"]
    interpreted = not gpus
    device = "Triton interpreter on " + (platform.processor() or "cpu") if interpreted else _gpu_name()
    return {"device": device, "interpreted": interpreted, "parallel": parallel, "candidates": n, "rows": rows}


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def print_scaling(summary: dict, console: Console) -> None:
    unit = "CPU slots" if summary["interpreted"] else "GPUs"
    title = f"evaluations per hour by {unit}, {summary['candidates']} candidates, on {summary['device']}"
    if summary["interpreted"]:
        title += " (smoke run: no GPU here; slots are evaluations at once, not GPUs)"
    table = Table(
        unit, "wall s", "evaluations per hour", "scaling", "statuses", "evaluations per GPU", title=title
    )
    for row in summary["rows"]:
        table.add_row(
            str(row["count"]),
            f"{row['wall_s']:.1f}",
            f"{row['evaluations_per_hour']:.0f}",
            f"{row['scaling']:.2f}x",
            ", ".join(f"{k} {v}" for k, v in sorted(row["statuses"].items())),
            "" if summary["interpreted"] else ", ".join(f"{k}: {v}" for k, v in row["per_gpu"].items()),
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m evals.bench_scaling", description="Evaluations per hour on 1 GPU, then on 2."
    )
    parser.add_argument(
        "--gpus", default="1,2", help="counts of GPUs to run on, in order (CPU slots without one)"
    )
    parser.add_argument("--candidates", type=int, default=24, help="candidates in the realistic mix")
    parser.add_argument("--parallel", type=int, default=1, help="evaluations at once per GPU")
    parser.add_argument("--timeout", type=float, default=600.0, help="hard wall-clock limit per evaluation")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    try:
        counts = [int(c) for c in args.gpus.split(",")]
    except ValueError:
        parser.error(f"--gpus {args.gpus!r}: give counts such as 1,2")
    if not counts or min(counts) < 1 or args.candidates < 1 or args.parallel < 1:
        parser.error("--gpus counts, --candidates and --parallel must be at least 1")
    console = Console(width=160)
    try:
        summary = run_scaling(counts, args.candidates, parallel=args.parallel, timeout_s=args.timeout)
    except ValueError as exc:
        parser.error(str(exc))
    print_scaling(summary, console)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
