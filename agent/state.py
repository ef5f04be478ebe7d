"""Campaign graph state (checkpointed after every node) and the per-run context (not).

The state holds only small, serializable facts about where the loop is; candidates, results and
budgets spent live in the store, which outlives any process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict

from agent.config import BudgetSpent, CampaignConfig
from agent.proposers import Proposer
from agent.store import Store
from kernels.registry import KernelLibrary
from sandbox.backend import Backend
from sandbox.result import EvalResult


class CampaignState(TypedDict, total=False):
    campaign_id: str
    iteration: int
    problem: str | None
    pending: list[str]  # candidate ids proposed and not yet evaluated
    best: dict[str, str]  # problem -> candidate id of the current best
    bucket_best: dict[str, dict[str, str]]  # problem -> "dtype/bucket" -> candidate id of its best
    stop_reason: str | None
    registered: list[str]  # kernel ids added to the library by this campaign


@dataclass(frozen=True)
class ProblemProgress:
    evaluations: int
    best_speedup: float | None  # over `baseline`, the problem's production op (nodes.best_speedup)
    baseline: str
    interpreted: bool  # its timings ran in the interpreter: the speedup says nothing about a GPU


@dataclass(frozen=True)
class CampaignProgress:
    """Where a campaign stands: sent when it starts or resumes, at each plan and after each evaluation."""

    spent: BudgetSpent
    problems: dict[str, ProblemProgress]
    # Why the plan chose the problem it works on now (campaigns that plan from a model).
    plan: str | None = None


class Events(Protocol):
    """What the loop reports as it goes (the CLI draws progress bars from it)."""

    def evaluated(self, result: EvalResult, best_speedup: float | None) -> None: ...

    def progress(self, progress: CampaignProgress) -> None: ...

    def message(self, text: str) -> None: ...


class _QuietEvents:
    def evaluated(self, result: EvalResult, best_speedup: float | None) -> None:
        pass

    def progress(self, progress: CampaignProgress) -> None:
        pass

    def message(self, text: str) -> None:
        pass


@dataclass(kw_only=True)
class CampaignContext:
    campaign_id: str
    config: CampaignConfig
    store: Store
    backend: Backend
    library: KernelLibrary
    proposers: dict[str, list[Proposer]]  # per problem, in the order of proposer.kinds
    report_dir: str
    events: Events = field(default_factory=_QuietEvents)
    # The plan's gains from the model's profile (agent.model_plan), for a campaign with a model.
    model_plan: Any = None
    wall_offset_s: float = 0.0  # spent by earlier runs of this campaign
    segment_start: float = field(default_factory=time.monotonic)

    def wall_s(self) -> float:
        return self.wall_offset_s + time.monotonic() - self.segment_start

    def spent(self) -> BudgetSpent:
        llm = self.store.llm_spent(self.campaign_id)
        return BudgetSpent(
            evaluations=self.store.count_evaluations(self.campaign_id),
            wall_s=self.wall_s(),
            gpu_s=self.store.device_seconds(self.campaign_id),
            llm_tokens=llm.tokens,
            llm_cost=llm.cost,
        )
