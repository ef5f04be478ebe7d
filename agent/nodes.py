"""The campaign's nodes: plan, propose, evaluate, select, register. Each is a small function of
(state, runtime) returning a partial state update."""

from __future__ import annotations

import json
import time
from pathlib import Path
from statistics import geometric_mean
from typing import Literal

from langgraph.runtime import Runtime

from agent.config import BudgetSpent
from agent.incumbents import ORIGIN as INCUMBENT
from agent.incumbents import (
    campaign_arch,
    incumbents,
    measurements,
    on_kind,
    to_measure,
    unmeasured_incumbents,
)
from agent.model_plan import measure_change, measure_model
from agent.population import (
    beaten_on_recheck,
    beats,
    bucket_us,
    buckets,
    elites,
    first_correct_proposal,
    margin,
    pick_best,
    pick_bucket_bests,
    primary_baseline,
    serving_us,
)
from agent.proposers import ProposalRequest, propose_batch
from agent.report import lineage_of, write_report
from agent.state import CampaignContext, CampaignProgress, CampaignState, ProblemProgress
from agent.store import EvaluationRow, device_seconds
from sandbox.backend import Alongside
from sandbox.protocol import campaign_baselines
from sandbox.result import EvalResult, Status, TimingStats

# Re-verifications of a winner that may land on other kinds of GPU before it is not registered.
RECHECK_TRIES = 3
# Over this speedup against the fastest baseline, a result is suspicious until a person looks.
SUSPICIOUS_SPEEDUP = 10.0


def plan(state: CampaignState, runtime: Runtime[CampaignContext]) -> dict:
    ctx = runtime.context
    spent = ctx.spent()
    if reached := ctx.config.budget.reached(spent):
        ctx.events.progress(campaign_progress(ctx, spent))
        return {"stop_reason": reached}
    counts = {p: ctx.store.count_evaluations(ctx.campaign_id, p) for p in ctx.config.problems}
    reason = None
    if ctx.model_plan is not None:
        # The most expected gain in the model's step left (agent.model_plan).
        problem, reason = ctx.model_plan.choose(counts, ctx.config.proposer.batch_size)
    else:
        # Every problem gets its turn: the one with the fewest evaluations goes next.
        problem = min(ctx.config.problems, key=counts.__getitem__)
    ctx.events.progress(campaign_progress(ctx, spent, plan=reason))
    return {"problem": problem, "iteration": state.get("iteration", 0) + 1, "stop_reason": None}


def campaign_progress(
    ctx: CampaignContext, spent: BudgetSpent | None = None, plan: str | None = None
) -> CampaignProgress:
    problems = {}
    for problem in ctx.config.problems:
        best = ctx.store.evaluations(ctx.campaign_id, problem, best_only=True)
        problems[problem] = ProblemProgress(
            evaluations=ctx.store.count_evaluations(ctx.campaign_id, problem),
            best_speedup=best_speedup(ctx, problem),
            baseline=primary_baseline(problem),
            interpreted=bool(best) and best[0].result.interpreted,
        )
    return CampaignProgress(spent=spent or ctx.spent(), problems=problems, plan=plan)


def _device_budget_left(ctx: CampaignContext) -> bool:
    """Wall time and GPU seconds left to evaluate with (the other budgets stop proposing, not
    the evaluation of what was proposed)."""
    budget = ctx.config.budget
    if ctx.wall_s() >= budget.max_wall_s:
        return False
    return budget.max_gpu_s is None or ctx.store.device_seconds(ctx.campaign_id) < budget.max_gpu_s


def route_after_plan(state: CampaignState) -> Literal["propose", "register"]:
    return "register" if state.get("stop_reason") else "propose"


def propose(state: CampaignState, runtime: Runtime[CampaignContext]) -> dict:
    ctx = runtime.context
    problem = state["problem"]
    rows = ctx.store.evaluations(ctx.campaign_id, problem)
    remaining = ctx.config.budget.max_evaluations - ctx.store.count_evaluations(ctx.campaign_id)
    n = max(1, min(ctx.config.proposer.batch_size, remaining))
    best_id = state.get("best", {}).get(problem)
    seen = {r.candidate.id for r in rows}
    # The first batches measure what dispatch runs today, every kernel of it however small the
    # batches: the bar every proposal must clear (unless the campaign starts from the
    # reference, proposals only).
    seeds = []
    if ctx.config.start_from == "library":
        seeds = [c for c in incumbents(problem, ctx.library, campaign_arch()) if c.id not in seen]
    seeds = seeds[:n]
    proposers = ctx.proposers[problem]
    request = ProposalRequest(
        campaign_id=ctx.campaign_id,
        problem=problem,
        rows=rows,
        best=next((r for r in rows if r.candidate.id == best_id), None),
        seen=frozenset(seen | {c.id for c in seeds}),
        elites=elites(
            rows,
            ctx.config.proposer.elites,
            best_id=best_id,
            bucket_best=state.get("bucket_best", {}).get(problem, {}).values(),
        ),
    )
    shares = [ctx.config.proposer.share(p.kind) for p in proposers]
    candidates = seeds + propose_batch(proposers, shares, n - len(seeds), request)
    for c in candidates:
        ctx.store.add_candidate(ctx.campaign_id, c)
    if candidates:
        return {"pending": [c.id for c in candidates]}
    pauses = [t for p in proposers if (t := p.paused_until()) is not None]
    if pauses:
        # Only paused proposers left (an LLM-only campaign in an outage): wait, within the wall budget.
        wait = max(0.0, min(min(pauses) - time.time(), ctx.config.budget.max_wall_s - ctx.wall_s()))
        ctx.events.message(f"{problem}: every proposer is paused; waiting {wait:.0f} s")
        time.sleep(wait)
        return {"pending": []}
    reasons = [r for p in proposers if (r := p.exhausted) is not None]
    if len(reasons) == len(proposers):
        return {"pending": [], "stop_reason": "; ".join(reasons)}
    return {"pending": []}  # nothing usable this round (e.g. the LLM's replies); the next may do better


def route_after_propose(state: CampaignState) -> Literal["evaluate", "register"]:
    return "register" if state.get("stop_reason") else "evaluate"


def _baselines(ctx: CampaignContext, problem: str) -> list[str]:
    from search_space import get_problem

    return list(ctx.config.sandbox.baselines or campaign_baselines(get_problem(problem)))


def evaluate(state: CampaignState, runtime: Runtime[CampaignContext]) -> dict:
    """Evaluate the pending candidates as one batch (a Ray backend spreads it over the cluster).
    Baselines are timed once per problem and kind of device: each evaluation carries the kinds
    the campaign holds them for, and one that lands on another kind (a Ray cluster of several GPU
    models, a host whose GPUs differ) times them there. A backend that times them once per kind
    within a call (Backend.baselines_once: the local one) takes the problem's first batch whole;
    another gets its first evaluation alone, to time them where it lands. Likewise the
    incumbents are measured again beside the first proposal on each kind that has not measured
    them."""
    ctx = runtime.context
    # After a resume, evaluations that finished before the kill are not run again.
    todo = [
        ctx.store.candidate(ctx.campaign_id, cid)
        for cid in state.get("pending", [])
        if not ctx.store.is_evaluated(ctx.campaign_id, cid)
    ]
    while todo and _device_budget_left(ctx):
        problem = todo[0].problem
        held = ctx.store.baseline_kinds(ctx.campaign_id, problem)
        whole = held or getattr(ctx.backend, "baselines_once", False)
        batch, todo = (todo, []) if whole else (todo[:1], todo[1:])
        alongside = _incumbents_alongside(ctx, problem, batch)
        results = ctx.backend.evaluate_many(
            batch,
            baselines=_baselines(ctx, problem),
            baselines_held_on=held,
            trials=ctx.config.sandbox.trials,
            alongside=alongside,
        )
        # The first timing of the baselines on a kind is kept: the comparisons use it from then
        # on, those of this batch's results too, whichever of them timed it.
        for candidate, result in zip(batch, results, strict=True):
            _keep_baselines(ctx, candidate.problem, result)
        for candidate, result in zip(batch, results, strict=True):
            if alongside is not None:
                _keep_incumbents(ctx, alongside, result.alongside)
            result = result.model_copy(update={"alongside": []})
            if result.status == Status.OK and not result.interpreted:
                result = _check_plausible(ctx, candidate, result)
            ctx.store.add_evaluation(ctx.campaign_id, result)
            ctx.store.set_wall(ctx.campaign_id, ctx.wall_s())
            ctx.events.evaluated(result, best_speedup(ctx, candidate.problem))
            ctx.events.progress(campaign_progress(ctx))
    return {"pending": []}


def _incumbents_alongside(ctx: CampaignContext, problem: str, batch: list) -> Alongside | None:
    """The incumbents to measure on each kind of device the batch lands on that has not measured
    them all; None where the campaign compares with none, or where the batch measures them
    itself (its first batches: the incumbents as candidates)."""
    if ctx.config.start_from != "library" or any(c.origin == INCUMBENT for c in batch):
        return None
    rows = ctx.store.evaluations(ctx.campaign_id, problem)
    measured = measurements(ctx.store, ctx.campaign_id, problem, rows)
    return to_measure(problem, ctx.library, measured) if measured else None


def _keep_incumbents(ctx: CampaignContext, alongside: Alongside, measured: list[EvalResult]) -> None:
    """The incumbents' measurements on a new kind of device, as the campaign's."""
    kernels = {c.id: c for cs in [*alongside.by_arch.values(), alongside.default] for c in cs}
    for result in measured:
        # Only what was asked for, on a kind not held already; one that ran on nothing (screened
        # out) says nothing of a kind.
        kernel = kernels.get(result.candidate_id)
        if kernel is not None and result.kind is not None and result.kind not in alongside.held_on:
            ctx.store.add_incumbent_evaluation(ctx.campaign_id, kernel, result)


def best_baseline_speedup(result: EvalResult, stored: dict[str, dict[str, TimingStats]]) -> float | None:
    """Geometric mean over timing shapes of (fastest baseline's time / candidate's time)."""
    ratios = []
    for t in result.timings:
        known = stored.get(f"{t.shape}/{t.dtype}", {}) | t.baselines
        if known:
            ratios.append(min(b.median_us for b in known.values()) / t.candidate.median_us)
    return geometric_mean(ratios) if ratios else None


def _check_plausible(ctx: CampaignContext, candidate, result: EvalResult) -> EvalResult:
    """A speedup beyond SUSPICIOUS_SPEEDUP over the fastest baseline is more often a measuring
    or checking failure than a kernel: re-measure it in a fresh worker with its baselines, and
    record it as suspicious either way, so that it is never accepted without a person."""
    stored = ctx.store.baselines(ctx.campaign_id, candidate.problem, result.kind)
    speedup = best_baseline_speedup(result, stored)
    if speedup is None:
        # Its kind's baselines were claimed by an evaluation of its batch that failed while
        # timing (sandbox.locks.BaselineClaims): timed now, in a fresh worker, with this candidate.
        result, stored = _baselines_timed_again(ctx, candidate, result)
        speedup = best_baseline_speedup(result, stored)
        if speedup is None:
            return result
    if speedup <= SUSPICIOUS_SPEEDUP:
        return result
    again = ctx.backend.evaluate(
        candidate, baselines=_baselines(ctx, candidate.problem), trials=ctx.config.sandbox.trials
    )
    remeasured = best_baseline_speedup(again, {}) if again.status == Status.OK else None
    note = f"{remeasured:.1f}x" if remeasured is not None else f"{again.status.value}: {again.message}"
    return result.model_copy(
        update={
            "phase_s": _remeasured(result, again),
            "status": Status.SUSPICIOUS,
            "message": f"{speedup:.1f}x over the fastest baseline; re-measured in a fresh worker: {note}; "
            f"not accepted without review",
        }
    )


def _baselines_timed_again(ctx: CampaignContext, candidate, result: EvalResult) -> tuple[EvalResult, dict]:
    """`result`, with the device seconds of fresh evaluations of its candidate that time the
    baselines (each kept as the campaign's on the kind it lands on, if not held there), up to
    RECHECK_TRIES until one lands on the result's kind, and the baselines of that kind then
    held. Where there are none, the result is suspicious: a speedup not put against any
    baseline is never accepted without a person."""
    problem = candidate.problem
    why = "no baselines"
    for _ in range(RECHECK_TRIES):
        asked = {"baselines": _baselines(ctx, problem), "trials": ctx.config.sandbox.trials}
        again = ctx.backend.evaluate(candidate, **asked)
        _keep_baselines(ctx, problem, again)
        result = result.model_copy(update={"phase_s": _remeasured(result, again)})
        stored = ctx.store.baselines(ctx.campaign_id, problem, result.kind)
        if stored:
            return result, stored
        if again.status != Status.OK:
            why = f"{again.status.value}: {again.message}"
            break
        why = f"it ran on {again.kind}" if again.kind != result.kind else "no baselines"
    message = (
        f"no baselines were timed on its kind of device; evaluated again to time them: {why}; "
        "not accepted without review"
    )
    return result.model_copy(update={"status": Status.SUSPICIOUS, "message": message}), {}


def _keep_baselines(ctx: CampaignContext, problem: str, result: EvalResult) -> None:
    """The baselines `result` timed, kept as the campaign's on its kind of device unless some are
    held there already."""
    if result.status != Status.OK or not result.timed_baselines:
        return
    if result.kind not in ctx.store.baseline_kinds(ctx.campaign_id, problem):
        ctx.store.add_baselines(ctx.campaign_id, problem, result)


def _remeasured(result: EvalResult, again: EvalResult) -> dict[str, float]:
    """`result`'s phases, with the device seconds of `again` added to its re-measuring."""
    return result.phase_s | {"remeasure": result.phase_s.get("remeasure", 0.0) + device_seconds(again)}


def best_speedup(ctx: CampaignContext, problem: str) -> float | None:
    """Speedup of the fastest correct candidate so far over the problem's production baseline
    (its first eager PyTorch op, e.g. torch.embedding_bag), as timed on its kind of device."""
    rows = ctx.store.evaluations(ctx.campaign_id, problem, best_only=True)
    if not rows:
        return None
    best = rows[0]
    speedups = best.result.speedups(ctx.store.baselines(ctx.campaign_id, problem, best.result.kind))
    return speedups.get(primary_baseline(problem))


def select(state: CampaignState, runtime: Runtime[CampaignContext]) -> dict:
    """Keep the best correct candidate per problem, and per (problem, dtype, shape bucket);
    replace one only on a margin beyond noise."""
    ctx = runtime.context
    problem = state["problem"]
    best = dict(state.get("best", {}))
    bucket_best = dict(state.get("bucket_best", {}))
    rows = ctx.store.evaluations(ctx.campaign_id, problem)
    incumbent = pick_best(rows, best.get(problem))
    if incumbent is not None:
        best[problem] = incumbent.candidate.id
    bucket_best[problem] = pick_bucket_bests(rows, bucket_best.get(problem))
    return {"best": best, "bucket_best": bucket_best}


def register(state: CampaignState, runtime: Runtime[CampaignContext]) -> dict:
    """Per problem and dtype, re-verify the winner in a fresh worker with new seeds and add it to
    the library, if it beats the kernels dispatch runs today (see `_winners`)."""
    ctx = runtime.context
    registered = list(state.get("registered", []))
    if ctx.config.register_kernels:
        for problem in ctx.config.problems:
            if any(a[0] == problem for a in ctx.store.accepted(ctx.campaign_id)):
                continue  # done before a kill; the library write is idempotent anyway
            registered += _register_problem(ctx, problem)
    # The campaign's last step: the report says so, with its wall time as the CLI shows it.
    if ctx.config.model is not None:
        ctx.events.message("measuring the model's step with the library at the start and now")
        measure_model(ctx.config, Path(ctx.report_dir), ctx.library.root)
    ctx.store.set_wall(ctx.campaign_id, ctx.wall_s())
    ctx.store.set_status(ctx.campaign_id, "finished", state.get("stop_reason"))
    report = write_report(ctx, state.get("best", {}), state.get("stop_reason"), state.get("bucket_best"))
    ctx.events.message(f"report: {report}")
    return {"registered": registered}


def _winners(
    ctx: CampaignContext, problem: str, rows: list[EvaluationRow], measured: list[EvaluationRow]
) -> dict[str, dict[str, list[str]]]:
    """Candidate id -> dtype -> the shape buckets it is to serve, decided on each kind of device
    apart: a proposal is compared only with what dispatch runs today as measured on the kind it
    ran on (`measured`: every measurement of the incumbents), and where the campaign measured
    incumbents but not on that kind, or one of them failed there, nothing is registered for it.

    On a GPU, each timed (dtype, bucket) goes to the fastest correct proposal on it, if that beats
    the fastest incumbent (what dispatch runs today) on the same bucket by more than either's
    timing noise there. A proposal that wins every bucket so gets one entry covering them all;
    proposals that win different buckets get an entry each, for the buckets they win. On the
    interpreter timings decide nothing (the same kernel measures 17 ms in one run and 34 ms in
    the next), so the first correct proposal is registered as it is, labelled interpreted, for
    the interpreter only and every bucket: the same campaign picks the same kernel every time."""
    winners: dict[str, dict[str, list[str]]] = {}
    proposals = [r for r in rows if r.score_us is not None and r.candidate.origin != INCUMBENT]
    # Without a correct proposal, the incumbents' kinds: each says why nothing is registered.
    kinds = sorted({r.result.kind for r in proposals} or {r.result.kind for r in measured}, key=str)
    for kind in kinds:
        where = problem if len(kinds) == 1 else f"{problem} on {kind}"
        incumbents_here = on_kind(measured, kind)
        if measured and not incumbents_here:
            ctx.events.message(
                f"{where}: nothing registered: what dispatch runs today was not measured there"
            )
            continue
        unmeasured = unmeasured_incumbents(incumbents_here)
        if unmeasured is not None:
            ctx.events.message(f"{where}: nothing registered: {unmeasured}")
            continue
        held = [r for r in incumbents_here if r.score_us is not None]
        _winners_on_kind(ctx, where, problem, on_kind(proposals, kind), held, winners)
    return winners


def _winners_on_kind(
    ctx: CampaignContext,
    where: str,
    problem: str,
    proposals: list[EvaluationRow],
    held: list[EvaluationRow],
    winners: dict[str, dict[str, list[str]]],
) -> None:
    """_winners among `proposals` and incumbents `held`, all measured on one kind of device."""

    def fastest(among: list[EvaluationRow], dtype: str, bucket: str | None = None):
        scored = [(r, s) for r in among if (s := serving_us(r.result, dtype, bucket)) is not None]
        return min(scored, key=lambda rs: rs[1], default=(None, None))

    rows = proposals + held
    for dtype in sorted({t.dtype for r in rows for t in r.result.timings}):
        best, _ = fastest(proposals, dtype)
        if best is None:
            ctx.events.message(f"{where} {dtype}: no correct proposal; library unchanged")
            continue
        if best.result.interpreted:
            first = first_correct_proposal(proposals, lambda r, d=dtype: serving_us(r.result, d))
            assert first is not None  # `best` is one
            winners.setdefault(first.candidate.id, {})[dtype] = _all_buckets(problem)
            continue
        for bucket in [b for d, b in buckets(rows) if d == dtype]:
            win, win_us = fastest(proposals, dtype, bucket)
            if win is None:
                continue
            inc, inc_us = fastest(held, dtype, bucket)
            if inc is not None and not beats(win_us, win.result, inc_us, inc.result, (dtype, bucket)):
                needed = margin(win.result, inc.result, (dtype, bucket))
                ctx.events.message(
                    f"{where} {dtype} {bucket}: best proposal {win.candidate.id} ({win_us:.1f} us) "
                    f"does not beat what dispatch runs today ({inc_us:.1f} us) by {100 * needed:.0f}%; "
                    "bucket unchanged"
                )
                continue
            winners.setdefault(win.candidate.id, {}).setdefault(dtype, []).append(bucket)


def _training_buckets(
    ctx: CampaignContext,
    problem: str,
    rows: list[EvaluationRow],
    winner: EvaluationRow,
    dtype: str,
    won: list[str],
) -> list[str] | None:
    """Of the buckets `won` (which the winner serves in serving), those it serves in training
    steps too; None: all of them. A forward that saves statistics for its backward (softmax's
    lse) is called in another form in training: there it serves a bucket only if its training
    form was timed in that bucket and is not slower than what dispatch runs today (the
    incumbents among `rows`, as measured on the winner's kind of device) by more than either's
    noise. Ops without statistics are called alike in both graphs; on the interpreter timings
    decide nothing."""
    from search_space import get_problem

    if get_problem(problem).statistics is None or winner.result.interpreted:
        return None
    held = [
        r
        for r in on_kind(rows, winner.result.kind)
        if r.score_us is not None and r.candidate.origin == INCUMBENT
    ]
    train = []
    for bucket in won:
        where = (dtype, bucket, "train")
        win_us = bucket_us(winner.result, *where)
        if win_us is None:
            ctx.events.message(
                f"{problem} {dtype} {bucket}: {winner.candidate.id} has no training-form timing in this "
                "bucket; it serves serving only there"
            )
            continue
        scored = [(r, us) for r in held if (us := bucket_us(r.result, *where)) is not None]
        inc, inc_us = min(scored, key=lambda rs: rs[1], default=(None, None))
        if inc is not None and win_us > inc_us * (1 + margin(winner.result, inc.result, where)):
            ctx.events.message(
                f"{problem} {dtype} {bucket}: {winner.candidate.id}'s training form ({win_us:.1f} us) is "
                f"slower than what dispatch runs today ({inc_us:.1f} us); it serves serving only there"
            )
            continue
        train.append(bucket)
    return train


def _incumbents_again(
    ctx: CampaignContext, held: list[EvaluationRow], recheck: EvalResult, cache: dict[str, EvalResult]
) -> list[tuple[str, EvalResult]]:
    """What dispatch ran at the campaign's start (its incumbents among `held`), evaluated again
    now, beside a winner's re-verification on the same kind of device (each once a problem, in
    `cache`): the winner's timing is compared with theirs, never with its own from another run."""
    out, seen = [], set()
    for row in held:
        if row.candidate.origin != INCUMBENT or row.candidate.id in seen:
            continue
        seen.add(row.candidate.id)
        if row.candidate.id not in cache:
            cache[row.candidate.id] = ctx.backend.evaluate(
                row.candidate, timing=True, trials=ctx.config.sandbox.trials
            )
        again = cache[row.candidate.id]
        if again.status == Status.OK and again.kind == recheck.kind:
            out.append((f"incumbent {row.candidate.id}", again))
    return out


def _register_problem(ctx: CampaignContext, problem: str) -> list[str]:
    rows = ctx.store.evaluations(ctx.campaign_id, problem)
    measured = measurements(ctx.store, ctx.campaign_id, problem, rows)
    kernel_ids = []
    beside_cache: dict[str, EvalResult] = {}
    for candidate_id, served in _winners(ctx, problem, rows, measured).items():
        row = next(r for r in rows if r.candidate.id == candidate_id)
        candidate, evidence = row.candidate, row.result
        held = [r for r in on_kind(measured, evidence.kind) if r.score_us is not None]
        # A fresh judge and runner check it again and time it again, and the incumbents are
        # evaluated again beside it (_incumbents_again): where one of them is now faster on a
        # bucket it serves, nothing is registered.
        recheck = ctx.backend.evaluate(candidate, timing=True, trials=ctx.config.sandbox.trials)
        # A backend picks the GPU, not its kind (a Ray cluster of several models, a host whose
        # GPUs differ): times from another GPU kind say nothing of the ones that won, so it tries
        # again, and registers nothing where the timing cannot be borne out on the winning kind.
        # (A backend without a GPU re-verifies on the interpreter: its checks count, as ever.)
        elsewhere = []
        while recheck.status == Status.OK and not recheck.interpreted and recheck.kind != evidence.kind:
            elsewhere.append(recheck.kind)
            if len(elsewhere) == RECHECK_TRIES:
                break
            recheck = ctx.backend.evaluate(candidate, timing=True, trials=ctx.config.sandbox.trials)
        if recheck.status != Status.OK:
            ctx.events.message(
                f"{problem}: candidate {candidate.id} failed re-verification "
                f"({recheck.status.value}: {recheck.message}); not registered"
            )
            continue
        if len(elsewhere) == RECHECK_TRIES:
            ctx.events.message(
                f"{problem}: candidate {candidate.id} was re-verified on {sorted(set(map(str, elsewhere)))}, "
                f"never on {evidence.kind} where it won, in {RECHECK_TRIES} tries: its timing is not borne "
                "out; not registered"
            )
            continue
        beside = [] if recheck.interpreted else _incumbents_again(ctx, held, recheck, beside_cache)
        slower = beaten_on_recheck(recheck, beside, served)
        if slower is not None:
            ctx.events.message(f"{problem}: candidate {candidate.id}: {slower}; not registered")
            continue
        assert evidence.device is not None
        for dtype, dtype_buckets in served.items():
            # Proven correct on the check shapes of every bucket; on a GPU it serves the buckets
            # it won, on the interpreter all of them. Its times are those of what it serves.
            times = [
                t.candidate.median_us
                for t in evidence.timings
                if t.dtype == dtype and t.bucket in dtype_buckets
            ]
            per_bucket = {b: us for b in dtype_buckets if (us := serving_us(evidence, dtype, b)) is not None}
            train_buckets = _training_buckets(ctx, problem, held, row, dtype, dtype_buckets)
            entry = ctx.library.add(
                op=problem,
                entry=candidate.entry,
                source=candidate.source,
                arch=evidence.device.arch,
                dtype=dtype,
                buckets=dtype_buckets,
                median_us=geometric_mean(times) if times else None,
                bucket_us=per_bucket,
                train_buckets=train_buckets,
                interpreted=evidence.interpreted,
                evidence={
                    "evaluation": evidence.model_dump(mode="json"),
                    "reverification": recheck.model_dump(
                        mode="json", include={"status", "checks", "device", "timings"}
                    ),
                },
                provenance={
                    "campaign": ctx.campaign_id,
                    "proposer": candidate.origin,
                    "candidate": candidate.id,
                    "parent": candidate.parent_id,
                    "knobs": candidate.knobs,
                },
            )
            _open_change(ctx, problem, held, row, entry)
            training = "" if train_buckets is None else f" (training: {', '.join(train_buckets) or 'none'})"
            ctx.events.message(
                f"{problem} {dtype}: registered {entry.kernel_id} for {', '.join(entry.buckets)}{training} "
                f"in {ctx.library.root}"
            )
        ctx.store.add_accepted(ctx.campaign_id, problem, candidate.id, entry.kernel_id, str(ctx.library.root))
        kernel_ids.append(entry.kernel_id)
    return kernel_ids


def _open_change(
    ctx: CampaignContext, problem: str, held: list[EvaluationRow], row: EvaluationRow, entry
) -> None:
    """A kernel change for review of what was just registered (`held`: the incumbents' correct
    measurements on its kind of device), where the campaign opens them (agent.review); a change
    that cannot be opened is reported, the registration stands."""
    import hashlib

    from agent import review

    repo = review.campaign_repo(ctx.config)
    if repo is None:
        return
    previous = min(held, key=lambda r: bucket_us(r.result, entry.dtype) or float("inf"), default=None)
    lineage = [cid for cid, _ in lineage_of(ctx.store, ctx.campaign_id, row.candidate.id)]
    llm = ctx.store.llm_proposals(ctx.campaign_id, problem).get(row.candidate.id)
    prompt_hash = None
    if llm is not None and llm.messages:
        prompt_hash = hashlib.sha256(json.dumps(llm.messages[:2], sort_keys=True).encode()).hexdigest()[:16]
    # Eager and torch.compile are timed once per problem and kind of device, with its first
    # evaluation there: the change's tables show them beside the winner and the previous best.
    stored = ctx.store.baselines(ctx.campaign_id, problem, row.result.kind)
    result = row.result.with_baselines(stored)
    before = previous.result.with_baselines(stored) if previous else None
    headline, message = review.describe(
        entry=entry, result=result, previous=before, campaign=ctx.campaign_id, lineage=lineage,
        prompt_hash=prompt_hash, previous_knobs=previous.candidate.knobs if previous else None,
        rationale=llm.rationale if llm is not None else "",
    )  # fmt: skip
    model_step = measure_change(ctx.config, Path(ctx.report_dir), ctx.library.root, entry.kernel_id)
    if model_step is not None:
        message += "\n" + model_step["summary"] + "\n"
    evidence = {
        "headline": headline,
        "model_step": model_step,
        "evaluation": result.model_dump(mode="json"),
        "previous_best": before.model_dump(mode="json") if before else None,
        "lineage": lineage,
        "proposer": row.candidate.origin,
        "prompt_hash": prompt_hash,
        "library": str(ctx.library.root),  # where a rejection takes it out of dispatch
    }
    try:
        change = review.open_change(
            repo, entry=entry, source=row.candidate.source, evidence=evidence, description=message
        )
    except review.ReviewError as exc:
        ctx.events.message(f"{problem}: no kernel change opened for {entry.kernel_id}: {exc}")
        return
    ctx.events.message(f"{problem}: kernel change {change.id} on branch {change.branch} ({headline})")
    wanted = ctx.config.review.pull_requests
    if wanted is False or (wanted is None and review.gh_ready(repo) is not None):
        return
    try:
        url = review.open_pull_request(repo, change, remote=ctx.config.review.remote)
    except review.ReviewError as exc:
        ctx.events.message(f"{problem}: {exc}")
        return
    ctx.events.message(f"{problem}: pull request for {change.id}: {url}")


def _all_buckets(problem: str) -> list[str]:
    from search_space import get_problem

    p = get_problem(problem)
    return sorted({p.bucket(s) for s in (*p.check_shapes, *p.timing_shapes)})
