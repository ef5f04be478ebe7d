"""Starting, resuming and inspecting campaigns.

A campaign's home (RECFORGE_HOME, default ./.recforge) holds `store.db` (candidates, results,
budgets spent) and `checkpoints.db` (LangGraph's SQLite checkpointer: where the loop is).
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from langgraph.checkpoint.sqlite import SqliteSaver

from agent.config import CampaignConfig, LLMConfigError, SandboxConfig
from agent.graph import compile_graph
from agent.incumbents import campaign_arch, incumbents
from agent.model_plan import ModelPlan
from agent.model_plan import prepare as prepare_model
from agent.nodes import campaign_progress
from agent.population import pick_best
from agent.proposers import make_proposers
from agent.report import ReportFiles, render_report
from agent.state import CampaignContext, CampaignState, Events, _QuietEvents
from agent.store import Store
from kernels.registry import DISPATCHER, KernelLibrary
from sandbox.backend import Backend
from sandbox.gpus import GpusUnknown, select_gpus, visible_gpus
from sandbox.isolation import IsolationUnavailable
from sandbox.local import LocalBackend

if TYPE_CHECKING:
    from agent.llm.preflight import Preflight


def make_backend(sandbox: SandboxConfig, scratch_root: Path, artifact_root: Path | None = None) -> Backend:
    """The evaluation backend a campaign's config asks for; all three give the same statuses.
    Compiled kernels are kept under `artifact_root` by content hash and reused (None: never)."""
    if sandbox.backend == "docker":
        from sandbox.docker_backend import DockerBackend

        return DockerBackend(
            timeout_s=sandbox.timeout_s,
            scratch_root=scratch_root,
            mem_limit=sandbox.docker_mem_limit,
            cpus=sandbox.docker_cpus,
            image=sandbox.docker_image,
            artifact_root=artifact_root,
        )
    if sandbox.backend == "ray":
        from sandbox.ray_backend import RayBackend

        # Ray workers keep scratch and artifacts on their own hosts, in their temporary
        # directories: the campaign's home may not exist there.
        return RayBackend(
            address=sandbox.ray_address,
            timeout_s=sandbox.timeout_s,
            isolation=sandbox.isolation,
            artifact_root=None
            if artifact_root is None
            else Path(tempfile.gettempdir()) / "recforge-artifacts",
        )
    try:
        return LocalBackend(
            timeout_s=sandbox.timeout_s,
            scratch_root=scratch_root,
            parallel=sandbox.parallel_workers,
            artifact_root=artifact_root,
            isolation=sandbox.isolation,
            gpus=campaign_gpus(sandbox),
        )
    except GpusUnknown as exc:
        raise CampaignError(f"cannot evaluate on this host's GPUs: {exc}") from None
    except IsolationUnavailable as exc:
        raise CampaignError(str(exc)) from None


def campaign_gpus(sandbox: SandboxConfig) -> list[str] | None:
    """The GPUs of this host that the local backend evaluates on, one timing worker each
    (sandbox.gpus; None: the visible GPUs as one); CampaignError, saying what the host has,
    where `sandbox.gpus` names GPUs it does not have."""
    if sandbox.gpus is None:
        return None
    try:
        return select_gpus(sandbox.gpus, visible_gpus())
    except ValueError as exc:
        raise CampaignError(f"sandbox.{exc}") from None


def campaign_library(config: CampaignConfig) -> KernelLibrary:
    """The library the campaign measures and registers into: the config's, else dispatch's."""
    return KernelLibrary(config.library) if config.library else DISPATCHER.library


def check_llm_endpoint(config: CampaignConfig) -> Preflight:
    """The pre-flight check of the campaign's LLM endpoint (agent.llm.preflight), against the
    largest first prompt of its problems; LLMConfigError if it fails."""
    from agent.llm.preflight import preflight
    from agent.proposers.llm import first_prompts

    assert config.llm is not None
    library = campaign_library(config)

    def starts(problem: str) -> list:
        return incumbents(problem, library, campaign_arch()) if config.start_from == "library" else []

    return preflight(config.llm, first_prompts(config.problems, starts))


def default_home() -> Path:
    return Path(os.environ.get("RECFORGE_HOME", ".recforge"))


@dataclass(frozen=True)
class CampaignOutcome:
    campaign_id: str
    status: str
    stop_reason: str | None
    best: dict[str, str]
    registered: list[str]
    report: Path  # Markdown; the HTML page is beside it (report.html)
    library: Path
    interpreted: bool = False  # timed on the interpreter: `best` is the first correct proposal


class CampaignError(RuntimeError):
    """A campaign that cannot be started or resumed; the message says why and what to do."""


class Campaigns:
    def __init__(self, home: str | os.PathLike | None = None) -> None:
        self.home = Path(home) if home else default_home()
        self.store = Store(self.home / "store.db")
        self.checkpoints = self.home / "checkpoints.db"

    @staticmethod
    def new_id(config: CampaignConfig) -> str:
        """A fresh campaign id: the config's name, the time and a random suffix."""
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        return f"{config.name}-{stamp}-{secrets.token_hex(2)}"

    def start(
        self, config: CampaignConfig, events: Events | None = None, campaign_id: str | None = None
    ) -> CampaignOutcome:
        """Run a new campaign (under `campaign_id`, default a new_id) to its end."""
        campaign_gpus(config.sandbox)  # the GPUs it asks for are here, before anything is recorded
        endpoint = self._preflight(config)  # or spent
        campaign_id = campaign_id or self.new_id(config)
        if config.model is not None:
            # Profile the model once (and keep the library as it is): the plan works from it,
            # and where the config names no problems they come from it (stored so).
            (events or _QuietEvents()).message(
                f"profiling the {config.model.config} model's {config.model.graph} step to plan from"
            )
            try:
                config = prepare_model(config, config.output_dir / campaign_id, campaign_library(config).root)
            except ValueError as exc:
                raise CampaignError(str(exc)) from None
        self.store.create_campaign(campaign_id, config.name, config.model_dump_json())
        if endpoint is not None:
            self.store.add_llm_preflight(campaign_id, endpoint)
        return self._run(campaign_id, config, events, fresh=True, endpoint=endpoint)

    def resume(self, campaign_id: str, events: Events | None = None) -> CampaignOutcome:
        row = self.store.campaign(campaign_id)
        if row is None:
            known = ", ".join(c.id for c in self.store.campaigns()[:5]) or "none"
            raise CampaignError(f"no campaign {campaign_id!r} in {self.home}; recent: {known}")
        config = CampaignConfig.model_validate_json(row.config_json)
        endpoint = self._preflight(config)
        if endpoint is not None:
            # The endpoint works again (a key fixed, a model served): an earlier stop is lifted.
            self.store.clear_llm_stops(campaign_id)
            self.store.add_llm_preflight(campaign_id, endpoint)
        return self._run(campaign_id, config, events, fresh=False, endpoint=endpoint)

    def _preflight(self, config: CampaignConfig) -> Preflight | None:
        """The LLM endpoint's pre-flight check where the campaign proposes with an LLM (None
        without one); CampaignError if it fails."""
        if config.llm is None or "llm" not in config.proposer.kinds:
            return None
        try:
            return check_llm_endpoint(config)
        except LLMConfigError as exc:
            raise CampaignError(str(exc)) from None

    def library_for(self, config: CampaignConfig) -> KernelLibrary:
        return campaign_library(config)

    def _run(
        self,
        campaign_id: str,
        config: CampaignConfig,
        events: Events | None,
        fresh: bool,
        endpoint: Preflight | None = None,
    ) -> CampaignOutcome:
        row = self.store.campaign(campaign_id)
        assert row is not None
        events = events or _QuietEvents()
        try:
            # The client starts from what the pre-flight learned: the model's context (prompts
            # are shrunk to fit before they are sent) and the structured-output form to use.
            client = None
            if endpoint is not None and config.llm is not None:
                from agent.llm.client import ChatClient

                client = ChatClient(
                    config.llm,
                    context_tokens=endpoint.context_tokens,
                    structured_output=endpoint.structured_output,
                )
            proposers = make_proposers(config, self.store, campaign_id, events, client)
        except LLMConfigError as exc:
            raise CampaignError(str(exc)) from None
        ctx = CampaignContext(
            campaign_id=campaign_id,
            config=config,
            store=self.store,
            backend=make_backend(config.sandbox, self.home / "scratch", self.home / "artifacts"),
            library=self.library_for(config),
            proposers=proposers,
            report_dir=str(config.output_dir / campaign_id),
            model_plan=ModelPlan.load(config.output_dir / campaign_id, config.problems)
            if config.model
            else None,
            events=events,
            wall_offset_s=row.wall_s,
            segment_start=time.monotonic(),
        )
        run_config = {"configurable": {"thread_id": campaign_id}, "recursion_limit": 1_000_000}
        with SqliteSaver.from_conn_string(str(self.checkpoints)) as saver:
            graph = compile_graph(saver)
            snapshot = graph.get_state(run_config)
            started = bool(snapshot.values)
            # Ended: no step left, nor one whose writes were saved without the checkpoint after
            # them (LangGraph saves a checkpoint while the next step runs, and a kill can come
            # between): such a step has no `next` either, but its task is there to continue from.
            if started and not snapshot.next and not snapshot.tasks:
                if row.status != "running":
                    raise CampaignError(
                        f"campaign {campaign_id} already finished "
                        f"({row.stop_reason or row.status}); see `recforge campaign status {campaign_id}`"
                    )
                # Killed after its last step and before the store said so: only the bookkeeping
                # is left (the graph registered and reported already).
                return self._finished(campaign_id, ctx, snapshot.values)
            self.store.set_status(campaign_id, "running")
            initial: CampaignState | None = None
            if fresh or not started:
                initial = {
                    "campaign_id": campaign_id,
                    "iteration": 0,
                    "best": {},
                    "pending": [],
                    "registered": [],
                    "stop_reason": None,
                }
            events.progress(campaign_progress(ctx))
            try:
                final = graph.invoke(initial, run_config, context=ctx)
            except KeyboardInterrupt:
                self.store.set_wall(campaign_id, ctx.wall_s())
                self.store.set_status(campaign_id, "interrupted", "interrupted by the user")
                raise
            except Exception as exc:
                self.store.set_wall(campaign_id, ctx.wall_s())
                self.store.set_status(campaign_id, "failed", f"{type(exc).__name__}: {exc}")
                raise
        return self._finished(campaign_id, ctx, final)

    def _finished(self, campaign_id: str, ctx: CampaignContext, final: dict) -> CampaignOutcome:
        row = self.store.campaign(campaign_id)
        if row is None or row.status != "finished":  # the register step records both itself
            self.store.set_wall(campaign_id, ctx.wall_s())
            self.store.set_status(campaign_id, "finished", final.get("stop_reason"))
        return CampaignOutcome(
            campaign_id=campaign_id,
            status="finished",
            stop_reason=final.get("stop_reason"),
            best=final.get("best", {}),
            registered=final.get("registered", []),
            report=Path(ctx.report_dir) / "report.md",
            library=ctx.library.root,
            interpreted=any(
                r.result.interpreted for r in self.store.evaluations(campaign_id, best_only=True)
            ),
        )

    def report(self, campaign_id: str, out_dir: Path | None = None) -> ReportFiles:
        """Write the campaign's report (Markdown and a self-contained HTML page) from the store,
        whether it is finished, stopped or still running; by default where the campaign writes
        it at its end (the config's output_dir / ID)."""
        row = self.store.campaign(campaign_id)
        if row is None:
            known = ", ".join(c.id for c in self.store.campaigns()[:5]) or "none"
            raise CampaignError(f"no campaign {campaign_id!r} in {self.home}; recent: {known}")
        config = CampaignConfig.model_validate_json(row.config_json)
        checkpointed = self._checkpointed(campaign_id)
        best = checkpointed.get("best")
        if best is None:  # no checkpoint (e.g. a copied store): replay the selection
            best = {}
            for problem in config.problems:
                chosen = pick_best(self.store.evaluations(campaign_id, problem))
                if chosen is not None:
                    best[problem] = chosen.candidate.id
        return render_report(
            self.store,
            campaign_id,
            config,
            best=best,
            bucket_best=checkpointed.get("bucket_best"),  # replayed by the report if missing
            stop_reason=row.stop_reason,
            out_dir=out_dir or config.output_dir / campaign_id,
        )

    def _checkpointed(self, campaign_id: str) -> dict:
        """The campaign's last checkpointed state; empty without one."""
        if not self.checkpoints.exists():
            return {}
        run_config = {"configurable": {"thread_id": campaign_id}}
        with SqliteSaver.from_conn_string(str(self.checkpoints)) as saver:
            values = compile_graph(saver).get_state(run_config).values
        return values or {}
