"""What every evaluation backend is (sandbox.local.LocalBackend, sandbox.docker_backend,
sandbox.ray_backend): a candidate in, its EvalResult out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from sandbox.candidate import Candidate
from sandbox.result import EvalResult


class Backend(Protocol):
    name: str

    def evaluate(
        self,
        candidate: Candidate,
        *,
        check: bool = True,
        timing: bool = True,
        baselines: list[str] | None = None,
        trials: int = 2,
    ) -> EvalResult: ...

    def evaluate_many(
        self,
        candidates: Sequence[Candidate],
        *,
        check: bool = True,
        timing: bool = True,
        baselines: list[str] | None = None,
        trials: int = 2,
    ) -> list[EvalResult]: ...
