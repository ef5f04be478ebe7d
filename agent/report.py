"""The campaign report: Markdown and a self-contained HTML page (plots embedded as PNG data),
rendered from the store with the template files in agent/templates.

It is written when a campaign ends, and by `recforge campaign report ID` at any time after.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from statistics import geometric_mean
from typing import TYPE_CHECKING, Any

import jinja2

from agent.incumbents import measurements, unmeasured_incumbents
from agent.plots import SpeedupSeries, speedup_plot
from agent.population import bucket_key, bucket_us, buckets, pick_bucket_bests, primary_baseline
from agent.store import EvaluationRow, Store
from kernels.registry import KernelLibrary, LibraryEntry
from sandbox.result import Status, TimingStats, ratio
from search_space import get_problem

if TYPE_CHECKING:
    from agent.config import CampaignConfig
    from agent.state import CampaignContext

_LOADER = jinja2.PackageLoader("agent", "templates")
_MARKDOWN = jinja2.Environment(loader=_LOADER, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
_HTML = jinja2.Environment(
    loader=_LOADER, undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=True
)


for _env in (_MARKDOWN, _HTML):
    _env.filters["ratio"] = ratio
PLOTS = {"evaluations": "speedup_over_evaluations.png", "time": "speedup_over_time.png"}
# Longest parent chain followed for a kernel's lineage (chains are acyclic: ids hash the source).
MAX_LINEAGE = 50


@dataclass(frozen=True)
class ReportFiles:
    markdown: Path
    html: Path
    plots: list[Path]


@dataclass(kw_only=True)
class Evidence:
    """How the best candidate was shown correct."""

    checks_passed: int = 0
    checks_total: int = 0
    shapes: int = 0
    trials: int = 0
    noop_proof: str = "not run"
    reverification: str = "not registered"


@dataclass(frozen=True)
class BucketWinner:
    """A (dtype, shape bucket) on which another candidate than the overall best is fastest."""

    dtype: str
    bucket: str
    row: EvaluationRow
    us: float  # geometric mean over the bucket's timing shapes
    best_us: float | None  # the overall best's, None if it was not timed there


@dataclass(kw_only=True)
class ProblemReport:
    name: str
    primary: str  # the production baseline progress and plots compare with
    rows: list[EvaluationRow]
    status_counts: dict[str, int]
    interpreted: bool
    baselines: dict[str, dict[str, TimingStats]]  # timed on the best's kind of device
    baseline_names: list[str]
    best: EvaluationRow | None = None
    # Fastest of what dispatch ran at the campaign's start, as measured on the best's kind of device.
    previous: EvaluationRow | None = None
    # Per kind of device (DeviceInfo.kind): its baselines, and the fastest of what dispatch ran
    # there: each row is compared with those of its own kind.
    baselines_by_kind: dict[str | None, dict[str, dict[str, TimingStats]]] = field(default_factory=dict)
    previous_by_kind: dict[str | None, EvaluationRow] = field(default_factory=dict)
    # Geometric means over the best candidate's timing shapes, in microseconds.
    reference_us: float | None = None
    compile_us: float | None = None
    eager_us: dict[str, float | None] = field(default_factory=dict)
    # Best over each baseline, over the previous best, and of the roofline: none on the interpreter.
    speedups: dict[str, float] = field(default_factory=dict)
    vs_previous: float | None = None
    roofline: float | None = None
    evidence: Evidence = field(default_factory=Evidence)
    bucket_winners: list[BucketWinner] = field(default_factory=list)  # where not the best
    unmeasured: str | None = None  # why nothing could be registered (agent.incumbents)

    @property
    def best_knobs(self) -> str:
        return json.dumps(self.best.candidate.knobs) if self.best else ""

    @property
    def fastest_baseline(self) -> tuple[str, float] | None:
        if not self.speedups:
            return None
        name = min(self.speedups, key=self.speedups.__getitem__)
        return name, self.speedups[name]


@dataclass(kw_only=True)
class AcceptedKernel:
    problem: str
    kernel_id: str
    candidate_id: str
    source: Path
    link: str  # the source file, relative to the report's folder
    entries: list[LibraryEntry]  # one per dtype (and architecture) it serves
    lineage: list[tuple[str, str]]  # (candidate id, origin), the kernel first, then its parents
    reverification: str


def _geomean(values: list[float]) -> float | None:
    return geometric_mean(values) if values else None


def _baseline_us(p: ProblemReport, name: str) -> float | None:
    """Geometric mean of baseline `name` over the best candidate's timing shapes, if timed on all."""
    if p.best is None:
        return None
    times = [p.baselines.get(f"{t.shape}/{t.dtype}", {}).get(name) for t in p.best.result.timings]
    if not times or any(t is None for t in times):
        return None
    return _geomean([t.median_us for t in times if t is not None])


def _evidence(best: EvaluationRow, entries: list[LibraryEntry]) -> Evidence:
    checks = [c for c in best.result.checks if c.trial >= 0]
    proofs = [c for c in best.result.checks if c.trial < 0]  # the run with Triton launches disabled
    ev = Evidence(
        checks_passed=sum(c.ok for c in checks),
        checks_total=len(checks),
        shapes=len({(c.shape, c.dtype) for c in checks}),
        trials=max((c.trial + 1 for c in checks), default=0),
    )
    if proofs:
        ev.noop_proof = "passed" if all(c.ok for c in proofs) else "failed"
    rechecks = [e.evidence.get("reverification") for e in entries if e.source_hash == best.candidate.id]
    if rechecks and rechecks[0]:
        passed = sum(c.get("ok", False) for c in rechecks[0].get("checks", []))
        ev.reverification = f"{rechecks[0]['status']} ({passed} checks, fresh worker and seeds)"
    return ev


def _bucket_winners(
    rows: list[EvaluationRow], best: EvaluationRow | None, chosen: dict[str, str] | None
) -> list[BucketWinner]:
    """Per (dtype, bucket), its best (`chosen`: bucket key -> candidate id, from the campaign's
    selection; replayed from the rows without it) where that is not the overall best."""
    if chosen is None:
        chosen = pick_bucket_bests(rows)
    by_id = {r.candidate.id: r for r in rows}
    out = []
    for dtype, bucket in buckets(rows):
        row = by_id.get(chosen.get(bucket_key(dtype, bucket), ""))
        if row is None or (best is not None and row.candidate.id == best.candidate.id):
            continue
        us = bucket_us(row.result, dtype, bucket)
        assert us is not None
        best_us = bucket_us(best.result, dtype, bucket) if best is not None else None
        out.append(BucketWinner(dtype=dtype, bucket=bucket, row=row, us=us, best_us=best_us))
    return out


def _problem(
    store: Store,
    campaign_id: str,
    problem: str,
    best_id: str | None,
    entries: list[LibraryEntry],
    bucket_best: dict[str, str] | None = None,
) -> ProblemReport:

    rows = store.evaluations(campaign_id, problem)
    measured = measurements(store, campaign_id, problem, rows)
    counts = Counter(r.result.status.value for r in rows)
    ok = [r for r in rows if r.score_us is not None]
    best = next((r for r in ok if r.candidate.id == best_id), None)
    kinds = {r.result.kind for r in rows}
    by_kind = {kind: store.baselines(campaign_id, problem, kind) for kind in kinds}
    previous_by_kind: dict[str | None, EvaluationRow] = {}
    for r in measured:
        if r.score_us is not None:
            known = previous_by_kind.get(r.result.kind)
            if known is None or r.score_us < known.score_us:
                previous_by_kind[r.result.kind] = r
    # The best's kind of device, else (no best yet) the first evaluation's.
    first = next((r.result.kind for r in rows if r.result.kind is not None), None)
    kind = best.result.kind if best is not None else first
    baselines = by_kind.get(kind, {})
    timed = sorted({n for per_shape in baselines.values() for n in per_shape})
    # The production op, unless the config's sandbox.baselines left it out.
    primary = primary_baseline(problem)
    p = ProblemReport(
        name=problem,
        primary=primary if primary in timed or not timed else timed[0],
        rows=rows,
        status_counts={s.value: counts.get(s.value, 0) for s in Status},
        interpreted=any(r.result.interpreted for r in rows),
        baselines=baselines,
        baseline_names=timed,
        best=best,
        previous=previous_by_kind.get(kind),
        baselines_by_kind=by_kind,
        previous_by_kind=previous_by_kind,
        unmeasured=unmeasured_incumbents(measured),
    )
    if p.best is None:
        return p
    p.bucket_winners = _bucket_winners(rows, p.best, bucket_best)
    p.reference_us = _baseline_us(p, "reference")
    p.compile_us = _baseline_us(p, "reference.compile")
    p.eager_us = {name: _baseline_us(p, name) for name in get_problem(problem).baselines}
    p.evidence = _evidence(p.best, entries)
    if p.best.result.interpreted:
        return p  # interpreted timings say nothing of GPU speed: no speedup or roofline from them
    p.speedups = p.best.result.speedups(baselines)
    if p.previous is not None:
        p.vs_previous = p.previous.score_us / p.best.score_us
    p.roofline = _geomean([f for t in p.best.result.timings if (f := t.roofline_fraction)])
    return p


def _series(
    store: Store, campaign_id: str, created_at: str, problems: list[ProblemReport]
) -> list[SpeedupSeries]:
    start = dt.datetime.fromisoformat(created_at)
    when = store.evaluation_times(campaign_id)
    order = {seq: i + 1 for i, seq in enumerate(sorted(when))}
    out = []
    for p in problems:
        # Over the previous best (what dispatch ran at the start, timed in the campaign on the
        # same kind of device) where there is one: the improvement the campaign made, on a GPU
        # and interpreted alike (an interpreted kernel against a compiled baseline is a flat line
        # near zero). Else over the problem's primary baseline, timed on the same kind.
        over_previous = bool(p.previous_by_kind)
        one = SpeedupSeries(problem=p.name, baseline="previous best" if over_previous else p.primary)
        for r in p.rows:
            if r.score_us is None:
                continue
            previous = p.previous_by_kind.get(r.result.kind)
            if over_previous:
                speedup = previous.score_us / r.score_us if previous is not None else None
            else:
                speedup = r.result.speedups(p.baselines_by_kind.get(r.result.kind, {})).get(p.primary)
            if speedup is None:
                continue
            one.evaluation.append(order[r.seq])
            one.seconds.append((dt.datetime.fromisoformat(when[r.seq]) - start).total_seconds())
            one.speedup.append(speedup)
        out.append(one)
    return out


def lineage_of(store: Store, campaign_id: str, candidate_id: str) -> list[tuple[str, str]]:
    """(candidate id, origin) from `candidate_id` back through its parents, as far as the campaign
    knows them."""
    chain: list[tuple[str, str]] = []
    cid: str | None = candidate_id
    while cid is not None and len(chain) < MAX_LINEAGE:
        try:
            c = store.candidate(campaign_id, cid)
        except KeyError:
            chain.append((cid, "not in this campaign"))
            break
        chain.append((cid, c.origin))
        cid = c.parent_id
    return chain


def _library_entries(store: Store, campaign_id: str) -> dict[str, list[LibraryEntry]]:
    """Manifest entries of the campaign's accepted kernels, by library folder."""
    out: dict[str, list[LibraryEntry]] = {}
    for *_, library in store.accepted(campaign_id):
        if library not in out:
            try:
                out[library] = KernelLibrary(library).entries()
            except ValueError:  # an unreadable manifest: the report says what the store knows
                out[library] = []
    return out


def _accepted(store: Store, campaign_id: str, out_dir: Path, libraries: dict) -> list[AcceptedKernel]:
    kernels = []
    for problem, candidate_id, kernel_id, library in store.accepted(campaign_id):
        entries = [e for e in libraries[library] if e.kernel_id == kernel_id]
        source = Path(library).resolve() / (entries[0].source_file if entries else f"{kernel_id}.py")
        recheck = entries[0].evidence.get("reverification", {}) if entries else {}
        kernels.append(
            AcceptedKernel(
                problem=problem,
                kernel_id=kernel_id,
                candidate_id=candidate_id,
                source=source,
                link=Path(os.path.relpath(source, out_dir.resolve())).as_posix(),
                entries=entries,
                lineage=lineage_of(store, campaign_id, candidate_id),
                reverification=recheck.get("status", "unknown"),
            )
        )
    return kernels


def _llm(store: Store, campaign_id: str) -> dict[str, Any]:
    exchanges = store.llm_exchanges(campaign_id)
    per_problem: dict[str, dict[str, float]] = {}
    for e in exchanges:
        agg = per_problem.setdefault(e["problem"], {"requests": 0, "tokens": 0, "cost": 0.0})
        agg["requests"] += 1
        agg["tokens"] += e["prompt_tokens"] + e["completion_tokens"]
        agg["cost"] += e["cost"]
    pauses = [
        {
            "started": dt.datetime.fromtimestamp(started, dt.UTC).isoformat(timespec="seconds"),
            "seconds": until - started,
            "reason": reason,
        }
        for started, until, reason in store.llm_pauses(campaign_id)
    ]
    return {
        "spent": store.llm_spent(campaign_id),
        "models": sorted({e["model"] for e in exchanges}),
        "outcomes": dict(Counter(e["outcome"] for e in exchanges).most_common()),
        "per_problem": per_problem,
        "pauses": pauses,
    }


def _budgets(config: CampaignConfig, store: Store, campaign_id: str, wall_s: float, llm) -> list[dict]:
    b = config.budget
    rows = [
        ("evaluations", b.max_evaluations, store.count_evaluations(campaign_id), "{:.0f}"),
        ("wall time (s)", b.max_wall_s, wall_s, "{:.0f}"),
        ("GPU seconds", b.max_gpu_s, store.device_seconds(campaign_id), "{:.1f}"),
        ("LLM tokens", b.max_llm_tokens, llm["spent"].tokens, "{:.0f}"),
        ("LLM money", b.max_llm_cost, llm["spent"].cost, "{:.4f}"),
    ]
    return [
        {
            "name": name,
            "limit": "none" if limit is None else fmt.format(limit),
            "spent": fmt.format(spent),
            "left": "" if limit is None else fmt.format(max(0.0, limit - spent)),
        }
        for name, limit, spent, fmt in rows
    ]


# Rows of the model's profile the report shows (the rest are in model/profile.json).
MODEL_ROWS = 12


def _model(store: Store, campaign_id: str, config: CampaignConfig, *, interpreted: bool) -> dict | None:
    """The model section: the profile the plan worked from, the gains per problem with the
    evaluations each had, and the step before and after (None for a campaign without a model)."""
    from agent.model_plan import PROFILE_FILE, ModelPlan, load_step, model_dir, untimed_buckets

    if config.model is None:
        return None
    report_dir = config.output_dir / campaign_id
    plan = ModelPlan.load(report_dir, config.problems)
    if plan is None:
        return None
    profile = plan.profile
    gains = [
        {
            **vars(g),
            "evaluations": store.count_evaluations(campaign_id, p),
            "buckets": g.buckets,
            "untimed": untimed_buckets(p, g.calls, interpreted=interpreted),
        }
        for p, g in sorted(plan.gains.items(), key=lambda kv: -kv[1].gain_ms)
    ]
    step = load_step(report_dir)
    return {
        "config": profile["config"],
        "graph": profile["graph"],
        "device": profile["device"],
        "step_ms": profile["step_ms"],
        "gains": gains,
        "rows": profile["rows"][:MODEL_ROWS],
        "step": step if step and "error" not in step else None,
        "step_error": step.get("error") if step else None,
        "profile_file": str(model_dir(report_dir) / PROFILE_FILE),
    }


def render_report(
    store: Store,
    campaign_id: str,
    config: CampaignConfig,
    *,
    best: dict[str, str],
    stop_reason: str | None,
    out_dir: Path,
    bucket_best: dict[str, dict[str, str]] | None = None,
) -> ReportFiles:
    """Write report.md, report.html and the plots' PNG files into `out_dir`. `bucket_best`: the
    campaign's per-bucket selection (problem -> bucket key -> candidate id); replayed if None."""
    campaign = store.campaign(campaign_id)
    assert campaign is not None
    libraries = _library_entries(store, campaign_id)
    entries = [e for es in libraries.values() for e in es]
    problems = [
        _problem(
            store, campaign_id, p, best.get(p), entries, None if bucket_best is None else bucket_best.get(p)
        )
        for p in config.problems
    ]
    devices: dict[str, None] = {}  # each kind of device the campaign ran on, in order
    for p in problems:
        for r in p.rows:
            if (d := r.result.device) is not None:
                devices[f"{d.kind}, torch {d.torch}, triton {d.triton}, Python {d.python}"] = None
    device = "; ".join(devices) or None
    interpreted = any(p.interpreted for p in problems)
    series = _series(store, campaign_id, campaign.created_at, problems)
    pngs = {over: speedup_plot(series, over=over, interpreted=interpreted) for over in PLOTS}
    llm = _llm(store, campaign_id)
    context = {
        "campaign": campaign,
        "problems": config.problems,
        "stop_reason": stop_reason,
        "total_evaluations": store.count_evaluations(campaign_id),
        "device": device,
        "interpreted": interpreted,
        "per_problem": problems,
        "statuses": [s.value for s in Status],
        "status_totals": {s.value: sum(p.status_counts[s.value] for p in problems) for s in Status},
        "accepted": _accepted(store, campaign_id, out_dir, libraries),
        "llm": llm,
        "budgets": _budgets(config, store, campaign_id, campaign.wall_s, llm),
        "plots": PLOTS,
        "plot_data": {over: base64.b64encode(png).decode("ascii") for over, png in pngs.items()},
        "generated": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": _model(store, campaign_id, config, interpreted=interpreted),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    for over, name in PLOTS.items():
        (out_dir / name).write_bytes(pngs[over])
        plots.append(out_dir / name)
    markdown, html = out_dir / "report.md", out_dir / "report.html"
    markdown.write_text(_MARKDOWN.get_template("report.md.j2").render(context))
    html.write_text(_HTML.get_template("report.html.j2").render(context))
    return ReportFiles(markdown=markdown, html=html, plots=plots)


def write_report(
    ctx: CampaignContext,
    best: dict[str, str],
    stop_reason: str | None,
    bucket_best: dict[str, dict[str, str]] | None = None,
) -> Path:
    """The report at a campaign's end; returns the Markdown file (the HTML page is beside it)."""
    files = render_report(
        ctx.store,
        ctx.campaign_id,
        ctx.config,
        best=best,
        stop_reason=stop_reason,
        out_dir=Path(ctx.report_dir),
        bucket_best=bucket_best,
    )
    return files.markdown
