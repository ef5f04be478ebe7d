"""The campaign's nodes: plan, propose, evaluate, select, register. Each is a small function of
(state, runtime) returning a partial state update."""

from __future__ import annotations

from typing import Literal

from langgraph.runtime import Runtime

from agent.report import write_report
from agent.state import CampaignContext, CampaignState
from sandbox.result import EvalResult, Status

# A new best must beat the old by more than the timing noise, and never by less than this.
MIN_IMPROVEMENT = 0.01


def plan(state: CampaignState, runtime: Runtime[CampaignContext]) -> dict:
    ctx = runtime.context
    budget = ctx.config.budget
    done = ctx.store.count_evaluations(ctx.campaign_id)
    if done >= budget.max_evaluations:
        return {"stop_reason": f"evaluation budget reached ({done} of {budget.max_evaluations})"}
    if ctx.wall_s() >= budget.max_wall_s:
        return {"stop_reason": f"wall-time budget reached ({ctx.wall_s():.0f} s of {budget.max_wall_s:.0f} s)"}
    # Every problem gets its turn: the one with the fewest evaluations goes next.
    problem = min(ctx.config.problems, key=lambda p: ctx.store.count_evaluations(ctx.campaign_id, p))
    return {"problem": problem, "iteration": state.get("iteration", 0) + 1, "stop_reason": None}


def route_after_plan(state: CampaignState) -> Literal["propose", "register"]:
    return "register" if state.get("stop_reason") else "propose"


def propose(state: CampaignState, runtime: Runtime[CampaignContext]) -> dict:
    ctx = runtime.context
    problem = state["problem"]
    rows = ctx.store.evaluations(ctx.campaign_id, problem)
    history = [(r.candidate.knobs, r.score_us) for r in rows]
    remaining = ctx.config.budget.max_evaluations - ctx.store.count_evaluations(ctx.campaign_id)
    n = max(1, min(ctx.config.proposer.batch_size, remaining))
    best_id = state.get("best", {}).get(problem)
    candidates = ctx.proposers[problem].propose(n, history, {r.candidate.id for r in rows},
                                                parent_id=best_id)
    for c in candidates:
        ctx.store.add_candidate(ctx.campaign_id, c)
    if not candidates:
        return {"pending": [], "stop_reason": f"search space of {problem} exhausted"}
    return {"pending": [c.id for c in candidates]}


def route_after_propose(state: CampaignState) -> Literal["evaluate", "register"]:
    return "register" if state.get("stop_reason") else "evaluate"


def _baselines_to_time(ctx: CampaignContext, problem: str) -> list[str]:
    if ctx.store.baselines(ctx.campaign_id, problem):
        return []
    return list(ctx.config.sandbox.baselines)


def evaluate(state: CampaignState, runtime: Runtime[CampaignContext]) -> dict:
    ctx = runtime.context
    for candidate_id in state.get("pending", []):
        # After a resume, evaluations that finished before the kill are not run again.
        if ctx.store.is_evaluated(ctx.campaign_id, candidate_id):
            continue
        if ctx.wall_s() >= ctx.config.budget.max_wall_s:
            break
        candidate = ctx.store.candidate(ctx.campaign_id, candidate_id)
        baselines = _baselines_to_time(ctx, candidate.problem)
        result = ctx.backend.evaluate(candidate, baselines=baselines, trials=ctx.config.sandbox.trials)
        if result.status == Status.OK and baselines:
            ctx.store.add_baselines(ctx.campaign_id, candidate.problem, result)
        ctx.store.add_evaluation(ctx.campaign_id, result)
        ctx.store.set_wall(ctx.campaign_id, ctx.wall_s())
        ctx.events.evaluated(result, best_speedup(ctx, candidate.problem))
    return {"pending": []}


def _noise(result: EvalResult) -> float:
    return max((t.candidate.spread for t in result.timings), default=0.0)


def best_speedup(ctx: CampaignContext, problem: str) -> float | None:
    """Speedup of the fastest correct candidate so far over the problem's first baseline."""
    rows = [r for r in ctx.store.evaluations(ctx.campaign_id, problem) if r.score_us is not None]
    if not rows:
        return None
    best = min(rows, key=lambda r: r.score_us)
    speedups = best.result.speedups(ctx.store.baselines(ctx.campaign_id, problem))
    name = next((b for b in ctx.config.sandbox.baselines if b in speedups), None)
    return speedups.get(name) if name else None


def select(state: CampaignState, runtime: Runtime[CampaignContext]) -> dict:
    """Keep the best correct candidate per problem; replace it only on a margin beyond noise."""
    ctx = runtime.context
    problem = state["problem"]
    best = dict(state.get("best", {}))
    rows = {r.candidate.id: r for r in ctx.store.evaluations(ctx.campaign_id, problem)}
    incumbent = rows.get(best.get(problem, ""))
    for row in sorted(rows.values(), key=lambda r: r.seq):
        if row.score_us is None or row is incumbent:
            continue
        if incumbent is None:
            incumbent = row
            continue
        margin = max(MIN_IMPROVEMENT, _noise(row.result), _noise(incumbent.result))
        if row.score_us < incumbent.score_us * (1 - margin):
            incumbent = row
    if incumbent is not None:
        best[problem] = incumbent.candidate.id
    return {"best": best}


def register(state: CampaignState, runtime: Runtime[CampaignContext]) -> dict:
    """Re-verify each problem's best in a fresh worker with new seeds, then add it to the library."""
    ctx = runtime.context
    registered = list(state.get("registered", []))
    if ctx.config.register_kernels:
        for problem, candidate_id in state.get("best", {}).items():
            if any(a[0] == problem for a in ctx.store.accepted(ctx.campaign_id)):
                continue  # done before a kill; the library write is idempotent anyway
            kernel_id = _register_one(ctx, problem, candidate_id)
            if kernel_id:
                registered.append(kernel_id)
    report = write_report(ctx, state.get("best", {}), state.get("stop_reason"))
    ctx.events.message(f"report: {report}")
    return {"registered": registered}


def _register_one(ctx: CampaignContext, problem: str, candidate_id: str) -> str | None:
    candidate = ctx.store.candidate(ctx.campaign_id, candidate_id)
    evidence = next(r.result for r in ctx.store.evaluations(ctx.campaign_id, problem)
                    if r.candidate.id == candidate_id)
    recheck = ctx.backend.evaluate(candidate, timing=False, trials=ctx.config.sandbox.trials)
    if recheck.status != Status.OK:
        ctx.events.message(f"{problem}: best candidate {candidate_id} failed re-verification "
                           f"({recheck.status.value}: {recheck.message}); not registered")
        return None
    assert evidence.device is not None
    dtypes = sorted({t.dtype for t in evidence.timings}) or ["fp32"]
    entries = []
    for dtype in dtypes:
        timings = [t for t in evidence.timings if t.dtype == dtype]
        prod = 1.0
        for t in timings:
            prod *= t.candidate.median_us
        entries.append(ctx.library.add(
            op=problem, entry=candidate.entry, source=candidate.source, arch=evidence.device.arch,
            dtype=dtype,
            # A kernel is proven on the check shapes of every bucket; its evidence covers the
            # timed buckets. Dispatch is by bucket, so it serves the buckets it was timed on,
            # and all of them on the interpreter (where no timing decides anything).
            buckets=sorted({t.bucket for t in timings}) if not evidence.interpreted else _all_buckets(problem),
            median_us=prod ** (1 / len(timings)) if timings else None,
            interpreted=evidence.interpreted,
            evidence={"evaluation": evidence.model_dump(mode="json"),
                      "reverification": recheck.model_dump(mode="json", include={"status", "checks", "device"})},
            provenance={"campaign": ctx.campaign_id, "proposer": candidate.origin,
                        "candidate": candidate.id, "parent": candidate.parent_id,
                        "knobs": candidate.knobs},
        ))
    kernel_id = entries[0].kernel_id
    ctx.store.add_accepted(ctx.campaign_id, problem, candidate_id, kernel_id, str(ctx.library.root))
    ctx.events.message(f"{problem}: registered {kernel_id} in {ctx.library.root}")
    return kernel_id


def _all_buckets(problem: str) -> list[str]:
    from search_space import get_problem

    p = get_problem(problem)
    return sorted({p.bucket(s) for s in (*p.check_shapes, *p.timing_shapes)})
