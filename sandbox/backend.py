"""What every evaluation backend is (sandbox.local.LocalBackend, sandbox.docker_backend,
sandbox.ray_backend): a candidate in, its EvalResult out."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from pydantic import BaseModel, Field

from sandbox.candidate import Candidate
from sandbox.result import EvalResult, Status


class Alongside(BaseModel):
    """Kernels to evaluate beside a call's candidates on each kind of device that has not
    measured them for the caller yet: right after the call's first evaluation that lands on such
    a kind, on the same GPU, each comes back in that result's `alongside`. A campaign sends the
    kernels dispatch runs today (its incumbents) so that every kind that measures proposals
    measures them too, without knowing which kind a task lands on. It crosses to Ray tasks as
    JSON."""

    held_on: list[str] = Field(default_factory=list)  # DeviceInfo.kind values measured already
    by_arch: dict[str, list[Candidate]] = Field(default_factory=dict)  # the kernels per architecture
    default: list[Candidate] = Field(default_factory=list)  # for an architecture not in by_arch

    def kernels(self, arch: str) -> list[Candidate]:
        return self.by_arch.get(arch, self.default)


class AlongsideClaims:
    """Within one call, which evaluation measures the kernels of `alongside` on which kind: the
    first to land on each kind not held, alone (the call's evaluations run in threads)."""

    def __init__(self, alongside: Alongside | None) -> None:
        self.alongside = alongside
        self._claimed = set(alongside.held_on) if alongside is not None else set()
        self._lock = threading.Lock()

    def claim(self, result: EvalResult) -> list[Candidate]:
        """The kernels to measure beside the evaluation that gave `result` ([]: none). Only an
        evaluation that ran its course (checked and timed) claims a kind: one that failed early
        (a candidate that raises at import) would choose when the incumbents are timed, beside
        its siblings' work on the host."""
        device = result.device
        if self.alongside is None or device is None or result.status != Status.OK or not result.timings:
            return []
        with self._lock:
            if device.kind in self._claimed:
                return []
            self._claimed.add(device.kind)
        return self.alongside.kernels(device.arch)


class Backend(Protocol):
    """`baselines` are timed in each evaluation's judge, unless it runs on a kind of device among
    `baselines_held_on` (DeviceInfo.kind values), or, where `baselines_once`, another evaluation
    of the same evaluate_many call times them on its kind (sandbox.locks.BaselineClaims);
    `alongside`: see Alongside. evaluate_many gives each result to `on_result`, with its index,
    as it comes (Ray's: as it gathers them, in the candidates' order), one at a time; an
    exception it raises ends the call."""

    name: str
    baselines_once: bool

    def evaluate(
        self,
        candidate: Candidate,
        *,
        check: bool = True,
        timing: bool = True,
        baselines: list[str] | None = None,
        baselines_held_on: Collection[str] = (),
        trials: int = 2,
        alongside: Alongside | None = None,
    ) -> EvalResult: ...

    def evaluate_many(
        self,
        candidates: Sequence[Candidate],
        *,
        check: bool = True,
        timing: bool = True,
        baselines: list[str] | None = None,
        baselines_held_on: Collection[str] = (),
        trials: int = 2,
        alongside: Alongside | None = None,
        on_result: Callable[[int, EvalResult], None] | None = None,
    ) -> list[EvalResult]: ...
