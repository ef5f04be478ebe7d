"""A quick evaluation backend for campaign tests that are about the agent, not the sandbox.

It applies the real static screen, imports the candidate in this process and checks it with
the real protocol (`check_shape`) on two small check shapes, so broken and wrong kernels fail
as they would in the sandbox, with the same statuses and mismatch details; it does not time
anything: a correct candidate gets a synthetic, interpreted timing from `speed(candidate)`,
and every result the phase seconds `phase_s` of the phases it got through (load, check, timing).
The real backends are tested in tests/sandbox; this one keeps a campaign to a few seconds.
"""

from __future__ import annotations

import itertools
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from sandbox.backend import Alongside, AlongsideClaims
from sandbox.candidate import Candidate
from sandbox.result import DeviceInfo, EvalResult, ShapeTiming, Status, TimingStats
from sandbox.runner import _is_compile_error
from sandbox.screen import screen_candidate
from search_space import get_problem

QUICK_SHAPES = ("single-bag", "mixed-empty")


def load_candidate(path: Path, entry: str):
    """The candidate module's entry, imported in this process (as `candidate`, where Triton's
    source inspection looks it up)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("candidate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["candidate"] = module
    spec.loader.exec_module(module)
    fn = getattr(module, entry, None)
    if not callable(fn):
        raise AttributeError(f"the module defines no callable {entry!r}")
    return fn


DEVICE = DeviceInfo(name="cpu", arch="interpreter", torch="t", triton="t", python="p", interpreted=True)


def hashed_speed(candidate: Candidate) -> float:
    """A stable made-up time per candidate, 50 to 100 us."""
    return 50.0 + int(candidate.id[:6], 16) % 1000 / 20


class QuickBackend:
    """`devices`: the device each evaluation runs on, in turn (one kind by default); baselines
    are timed, and the kernels of `alongside` measured, as the real backends do them: on a
    kind the caller does not hold them for."""

    name = "quick"

    def __init__(
        self,
        speed: Callable[[Candidate], float] = hashed_speed,
        delay_s: float = 0.0,
        phase_s: dict[str, float] | None = None,
        devices: Sequence[DeviceInfo] = (DEVICE,),
    ) -> None:
        self.speed, self.delay_s, self.phase_s = speed, delay_s, phase_s or {}
        self.evaluated: list[str] = []
        self.devices = itertools.cycle(devices)
        self._dir = Path(tempfile.mkdtemp(prefix="quick-backend-"))

    def evaluate_many(
        self, candidates: Sequence[Candidate], *, alongside: Alongside | None = None, **kwargs
    ) -> list[EvalResult]:
        claims = AlongsideClaims(alongside)
        return [self._with_alongside(self.evaluate(c, **kwargs), claims, kwargs) for c in candidates]

    def _with_alongside(self, result: EvalResult, claims: AlongsideClaims, kwargs: dict) -> EvalResult:
        kernels = claims.claim(result)
        if not kernels:
            return result
        # On the same device: the next evaluations' devices go on as they would.
        asked = {k: v for k, v in kwargs.items() if k in ("check", "timing", "trials")}
        measured = [self._evaluate_on(result.device, k, **asked) for k in kernels]
        return result.model_copy(update={"alongside": measured})

    def evaluate(
        self,
        candidate: Candidate,
        *,
        check=True,
        timing=True,
        baselines=None,
        baselines_held_on=(),
        trials=2,
        alongside=None,
    ) -> EvalResult:
        result = self._evaluate_on(
            next(self.devices),
            candidate,
            timing=timing,
            baselines=baselines,
            baselines_held_on=baselines_held_on,
        )
        return self._with_alongside(result, AlongsideClaims(alongside), {"timing": timing})

    def _evaluate_on(
        self,
        device: DeviceInfo,
        candidate: Candidate,
        *,
        check=True,
        timing=True,
        baselines=None,
        baselines_held_on=(),
        trials=2,
    ) -> EvalResult:
        self.evaluated.append(candidate.id)
        time.sleep(self.delay_s)
        rejected = screen_candidate(candidate)
        if rejected is not None:
            return rejected
        base = {"problem": candidate.problem, "candidate_id": candidate.id, "device": device}
        if device.kind in baselines_held_on:
            baselines = []
        phases = self.phase_s
        base["phase_s"] = {k: v for k, v in phases.items() if k == "load"}
        problem = get_problem(candidate.problem)
        path = self._dir / f"{candidate.id}.py"
        path.write_text(candidate.source)
        try:
            fn = load_candidate(path, candidate.entry)
        except Exception as exc:
            return EvalResult(
                status=Status.COMPILE_ERROR,
                message=f"import failed: {type(exc).__name__}: {exc}",
                log_tail=traceback.format_exc(),
                **base,
            )
        from sandbox.protocol import check_shape

        base["phase_s"] = {k: v for k, v in phases.items() if k in ("load", "check")}
        checks = []
        for shape in (s for s in problem.check_shapes if s.name in QUICK_SHAPES and s.dtype == "fp32"):
            try:
                result = check_shape(problem, fn, shape, 0, torch.device("cpu"))
            except Exception as exc:
                status = Status.COMPILE_ERROR if _is_compile_error(exc) else Status.RUNTIME_ERROR
                return EvalResult(
                    status=status,
                    message=f"{shape.describe()}: {type(exc).__name__}: {exc}"[:2000],
                    log_tail=traceback.format_exc(),
                    checks=checks,
                    **base,
                )
            checks.append(result)
            if not result.ok:
                return EvalResult(
                    status=Status.WRONG,
                    message=f"{shape.describe()}: {result.message}",
                    checks=checks,
                    **base,
                )
        median = self.speed(candidate)
        stats = TimingStats(median_us=median, p20_us=median, p80_us=median, reps=5)
        baseline = TimingStats(median_us=100.0, p20_us=100.0, p80_us=100.0, reps=5)
        timings = [
            ShapeTiming(
                shape="quick",
                dtype="fp32",
                bucket="d64",
                candidate=stats,
                baselines={name: baseline for name in baselines or []},
                flops=1e6,
                bytes=1e6,
                achieved_gbps=1e6 / median / 1e3,
            )
        ]
        if timing:
            base["phase_s"] = dict(phases)
        return EvalResult(status=Status.OK, checks=checks, timings=timings if timing else [], **base)
