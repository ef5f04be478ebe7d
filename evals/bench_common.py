"""What the product benchmarks share: the run's device, software and commit, and how a
benchmark draws its shapes and input sets (evals.bench_ops, evals.bench_attention).

The judge times a candidate on inputs it has never seen and checks timed outputs, so a kernel
that memoizes its outputs gains nothing there; the benchmarks, which report figures for the
library's kernels after the judge accepted them, hold them to the same rule (FreshInputs): each
timed call of a provider runs on a set drawn for it, never seen by that provider (its warm-up
runs on other sets), and some of those calls are compared with the reference.
"""

from __future__ import annotations

import math
import os
import platform
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from rich.console import Console
from rich.table import Table

from sandbox.judge import seed_of_form
from sandbox.protocol import compare
from sandbox.timing import ArgSet
from search_space.problem import Inputs, Problem, Shape

# The warm-up's input sets: of the forms 0, 1, 2 (a problem draws some settings of a call, an
# index dtype say, from its seed's low bits: sandbox.judge.SEED_FORMS), one on the interpreter.
WARMUP_SETS, INTERPRETED_SETS = 3, 1
# Timed calls' sets (FreshInputs): at least FRESH_MIN_SETS (a median of three calls, the floor:
# the judge times 8 to 48) and at most FRESH_MAX_SETS (the timed calls sandbox.timing.benchmark
# makes at most), fewer where the next one would take the sets past their budget or their drawing
# past FRESH_DRAW_S. The budget is FRESH_MEMORY_SHARE of the GPU's memory free when the sets are
# drawn (what every set alive then, the warm-up's and other pools', leaves), less FRESH_WORKING_SETS
# sets' size for the pass's own work (outputs, saved tensors, gradients, a graph's pool). A call of
# a millisecond on tables of gigabytes (the embedding shapes: 1.6 GB a set) is so timed a few
# times; one of tens of microseconds on small inputs up to 200 times; every provider times every
# set. They are drawn before the warm-up, so that host work does not sit between timed calls
# (sandbox.timing.WARMUP_MS). The interpreter times 3 calls (sandbox.timing.benchmark).
FRESH_MIN_SETS, FRESH_MAX_SETS = 3, 200
FRESH_MEMORY_SHARE = 0.5
FRESH_WORKING_SETS = 2
FRESH_DRAW_S = 1.0
INTERPRETED_FRESH_SETS = 3


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

    def input_sets(self, problem: Problem, shape: Shape) -> list[ArgSet]:
        """The warm-up's inputs, to rotate over: three on a GPU, of the forms 0, 1, 2 (so that
        every form a timed call meets is compiled), one interpreted. Without the problem's
        request for statistics: a public op saves them itself when a gradient will be taken (the
        forward+backward rows), and providers take the op's arguments."""
        return [
            (i.args, i.kwargs)
            for i in (
                problem.without_statistics(problem.make_inputs(shape, seed_of_form(form), self.device))
                for form in range(self.warmup_sets)
            )
        ]

    @property
    def warmup_sets(self) -> int:
        return INTERPRETED_SETS if self.interpreted else WARMUP_SETS

    def fresh_inputs(
        self, problem: Problem, shape: Shape, *, checks: int, most: int = FRESH_MAX_SETS
    ) -> FreshInputs:
        """A round of timed calls' inputs at `shape` (FreshInputs), of the warm-up's forms."""
        return FreshInputs(problem, shape, self.device, forms=self.warmup_sets, checks=checks, most=most)

    def finish(self, console: Console, table: Table) -> None:
        console.print(table)
        if self.interpreted:
            console.print("[yellow]interpreted Triton on a CPU: these timings say nothing about GPU speed[/]")


@dataclass
class Checked:
    """What the checks of one provider's timed calls found: how many ran, the first failure."""

    calls: int = 0
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


class FreshInputs:
    """The inputs of one round of timed calls at a shape: timed call i of every provider runs on
    set i, drawn from a fresh seed before any timing (sandbox.timing.benchmark's `fresh`); every
    provider times every set, and the calls on `checks` of the sets, chosen at random among all
    but the first (checked_calls), are compared with the reference on their inputs (its `check`).

    Shared by providers of different code, which never see each other's calls; never by two
    rounds of one code (a pass after another, a kernel called and replayed), which draw a round
    each. Providers share the checked sets, so that one reference serves them all (at an
    attention shape it takes seconds). An op that updates its arguments (Problem.updates)
    updates a set in place: a later provider gets it as the earlier left it, inputs it has never
    seen with the same ids (the same work), and each check compares with the reference on a copy
    of the set made before its call.

    A memo keyed on a sample of the values never hits; one keyed on the sets' addresses never
    either (the sets are all alive, each at its own addresses). One that answers a call with
    another call's outputs (keyed on the addresses of what a call makes from its set, a
    backward's saved tensors, which an earlier call's may have held; or on anything else) fails
    a check: the checks never fall on the first timed call alone, which no earlier timed call
    can answer."""

    def __init__(
        self,
        problem: Problem,
        shape: Shape,
        device: torch.device,
        *,
        forms: int,
        checks: int,
        most: int = FRESH_MAX_SETS,
    ) -> None:
        """Sets of the forms 0 to `forms` - 1 in turn (the warm-up's), `most` at most."""
        self.problem, self.shape = problem, shape
        interpreted = device.type != "cuda"
        most = min(most, INTERPRETED_FRESH_SETS) if interpreted else most
        least = min(FRESH_MIN_SETS, most)
        budget = fresh_budget(device)
        self.sets: list[Inputs] = []
        nbytes, t0 = 0, time.perf_counter()
        while len(self.sets) < most:
            if len(self.sets) >= least:
                # The next set and the pass's working sets, each the size of the sets so far.
                per_set = nbytes / len(self.sets)
                if nbytes + (1 + FRESH_WORKING_SETS) * per_set > budget:
                    break
                if time.perf_counter() - t0 > FRESH_DRAW_S:
                    break
            drawn = problem.make_inputs(shape, seed_of_form(len(self.sets) % forms), device)
            self.sets.append(problem.without_statistics(drawn))
            nbytes += sum(t.nbytes for t in drawn.tensors())
        self.checked = checked_calls(len(self.sets), checks, every=interpreted)
        self._references: dict[int, tuple] = {}

    def __len__(self) -> int:
        return len(self.sets)

    def args(self, i: int) -> ArgSet:
        """Timed call i's arguments."""
        return self.sets[i].args, self.sets[i].kwargs

    def timing(self, checked: Checked, fresh: Callable[[int], ArgSet] | None = None) -> dict:
        """sandbox.timing.benchmark's options for one provider's round: its timed calls on these
        sets (`fresh`: call i's arguments made from set i, where they are not the set itself),
        its checks' findings to `checked`. Every provider times every set."""
        return {
            "fresh": fresh or self.args,
            "check": self.checker(checked),
            "min_reps": len(self.sets),
            "max_reps": len(self.sets),
        }

    def checker(self, checked: Checked) -> Callable[[int, tuple, dict], Callable[[object], None] | None]:
        """benchmark's `check` for one provider, whose findings go to `checked`: for a call on a
        checked set, a function comparing its output (the problem's result of the call) with the
        reference's on the set."""

        def before(i: int, args: tuple, kwargs: dict) -> Callable[[object], None] | None:
            if i not in self.checked:
                return None
            inputs = self.sets[i]
            pristine = inputs.clone() if self.problem.updates else None

            def verify(out: object) -> None:
                ref, tol, scale = self._reference(i, pristine)
                ok, details = compare(self.problem.result(inputs, out), ref, tol, scale)
                checked.calls += 1
                if not ok and checked.ok:
                    checked.failure = f"{details.get('message', '')} (timed call {i})"

            return verify

        return before

    def _reference(self, i: int, pristine: Inputs | None) -> tuple:
        """(the reference's output, tolerance, error scale) on set i; for an op that updates its
        arguments, on `pristine` (a copy of them before the call), else once for all providers."""
        if pristine is None and i in self._references:
            return self._references[i]
        inputs = pristine if pristine is not None else self.sets[i]
        ref = self.problem.result(inputs, self.problem.reference(*inputs.args, **inputs.kwargs))
        found = (ref, *self.problem.closeness(self.shape.dtype, inputs, ref))
        if pristine is None:
            self._references[i] = found
        return found


def fresh_budget(device: torch.device) -> float:
    """Bytes the timed calls' sets and the pass's work may take (FreshInputs): FRESH_MEMORY_SHARE
    of the GPU's memory free now, the allocator's cached blocks included; unbounded on a CPU."""
    if device.type != "cuda":
        return math.inf
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return FRESH_MEMORY_SHARE * (free + cached)


def checked_calls(sets: int, checks: int, *, every: bool) -> frozenset[int]:
    """The timed calls whose outputs are checked: all of them with `every` (the interpreter's
    three, as the judge checks all of its), else `checks` drawn at random among the calls after
    the first (which no earlier timed call can answer), or the one call there is."""
    if every:
        return frozenset(range(sets))
    later = range(1, sets) if sets > 1 else range(sets)
    return frozenset(random.sample(later, min(checks, len(later))))


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
