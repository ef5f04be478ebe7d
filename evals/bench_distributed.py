"""Data-parallel training against one process, in one run: `recforge model train` with 1 rank,
N ranks balanced by attention work, and N ranks split in consecutive blocks, on the same
config and steps. Prints examples per second (and the ratio to one rank), MFU, the largest
difference of the logged losses from one rank's, and the final held-out AUC.

    python -m evals.bench_distributed --config small --steps 300 --nproc 2 [--device cuda]

On a host without GPUs the ranks are CPU processes (gloo): a check that it all runs and the
losses agree, whose rates say nothing of GPUs. Each run's output and JSON go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# The first logged window holds warm-up (and compiles): rates are averaged over the rest.
WARM_WINDOWS = 1


def _run(out: Path, name: str, args: list[str]) -> dict | None:
    """One `recforge model train` run; its JSON, or None where it failed (its log says why)."""
    json_path, log = out / f"{name}.json", out / f"{name}.txt"
    cmd = [sys.executable, "-m", "agent", "model", "train", "--no-save", "--json", str(json_path), *args]
    with open(log, "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=os.environ | {"COLUMNS": "200"})
    if code != 0 or not json_path.exists():
        print(f"{name}: failed (exit {code}); see {log}", flush=True)
        return None
    return json.loads(json_path.read_text())


def _rate(result: dict) -> tuple[float, float | None]:
    steps = result["steps"][WARM_WINDOWS:] or result["steps"]
    rate = sum(s["examples_per_s"] for s in steps) / len(steps)
    mfu = [s["mfu"] for s in steps if s["mfu"] is not None]
    return rate, (sum(mfu) / len(mfu) if mfu else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    parser.add_argument("--reference-ops", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-distributed")))
    args = parser.parse_args(argv)
    if args.nproc < 2:
        parser.error(f"--nproc must be 2 or more, got {args.nproc}")
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["--config", args.config, "--steps", str(args.steps)]
    common += ["--device", args.device] if args.device else []
    common += ["--reference-ops"] if args.reference_ops else []
    runs = {
        "1 rank": common,
        f"{args.nproc} ranks, balanced": [*common, "--nproc", str(args.nproc)],
        f"{args.nproc} ranks, consecutive": [*common, "--nproc", str(args.nproc), "--no-balance"],
    }
    results = {}
    for label, run_args in runs.items():
        print(f"running {label} ...", flush=True)
        results[label] = _run(args.out, label.replace(" ", "_").replace(",", ""), run_args)
    base = results["1 rank"]
    base_rate = _rate(base)[0] if base else None
    base_losses = {s["step"]: s["loss"] for s in base["steps"]} if base else {}
    print(f"\n{args.config}, {args.steps} steps; rates over the logged windows after the first")
    print(
        f"{'run':<26} {'examples/s':>11} {'vs 1 rank':>9} {'MFU':>7} "
        f"{'max |loss - 1 rank|':>20} {'final AUC':>10}"
    )
    for label, result in results.items():
        if result is None:
            print(f"{label:<26} (failed)")
            continue
        rate, mfu = _rate(result)
        ratio = f"{rate / base_rate:.2f}x" if base_rate else "-"
        diffs = [abs(s["loss"] - base_losses[s["step"]]) for s in result["steps"] if s["step"] in base_losses]
        auc = result["evals"][-1]["auc"] if result["evals"] else {}
        print(
            f"{label:<26} {rate:>11,.0f} {ratio:>9} {'-' if mfu is None else f'{mfu:.1%}':>7} "
            f"{max(diffs) if diffs else float('nan'):>20.2e} {next(iter(auc.values()), float('nan')):>10.4f}"
        )
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
