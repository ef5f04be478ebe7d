"""What the product benchmarks share: the run's device, software and commit, and how a
benchmark draws its shapes and input sets (evals.bench_ops, evals.bench_attention)."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from rich.console import Console
from rich.table import Table

from sandbox.protocol import fresh_seed
from search_space.problem import Problem, Shape


@dataclass(frozen=True)
class BenchRun:
    """What every benchmark row carries and every table's title shows: the device, software and
    commit it ran on; and how a benchmark draws its shapes and input sets on that device."""

    device: torch.device
    gpu: str
    versions: str
    commit: str

    @classmethod
    def here(cls) -> BenchRun:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return cls(
            device=device,
            gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
            versions=(
                f"torch {torch.__version__}, triton {triton.__version__}, Python {platform.python_version()}"
            ),
            commit=git_commit(),
        )

    @property
    def interpreted(self) -> bool:
        return self.device.type != "cuda"

    def title(self, op: str) -> str:
        return f"{op} on {self.gpu}; {self.versions}; commit {self.commit}"

    def fields(self) -> dict:
        return {
            "gpu": self.gpu,
            "versions": self.versions,
            "commit": self.commit,
            "interpreted": self.interpreted,
        }

    def shapes(self, problem: Problem, only: list[str] | None = None) -> tuple[Shape, ...]:
        """The problem's timing shapes for this device (interpreted ones on a CPU), filtered."""
        return select_shapes(
            problem.interpreted_timing_shapes if self.interpreted else problem.timing_shapes, only
        )

    def input_sets(self, problem: Problem, shape: Shape) -> list[tuple[tuple, dict]]:
        """Fresh inputs to rotate over: three on a GPU (nothing stays cached), one interpreted.
        Without the problem's request for statistics: a public op saves them itself when a
        gradient will be taken (the forward+backward rows), and providers take the op's
        arguments."""
        return [
            (i.args, i.kwargs)
            for i in (
                problem.without_statistics(problem.make_inputs(shape, fresh_seed(), self.device))
                for _ in range(1 if self.interpreted else 3)
            )
        ]

    def finish(self, console: Console, table: Table) -> None:
        console.print(table)
        if self.interpreted:
            console.print("[yellow]interpreted Triton on a CPU: these timings say nothing about GPU speed[/]")


def select_shapes(shapes: tuple[Shape, ...], only: list[str] | None) -> tuple[Shape, ...]:
    """The shapes whose name contains one of `only` (all of them when `only` is empty)."""
    return tuple(s for s in shapes if not only or any(part in s.name for part in only))


def git_commit() -> str:
    """The checkout's commit; RECFORGE_COMMIT overrides it where the tree is a copy whose git
    metadata is not the checkout's (a GPU host that receives the working tree)."""
    if os.environ.get("RECFORGE_COMMIT"):
        return os.environ["RECFORGE_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                timeout=5,
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
