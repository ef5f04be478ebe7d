"""The campaign report (Markdown), rendered from the store with a template file."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2

if TYPE_CHECKING:
    from agent.state import CampaignContext

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("agent", "templates"),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
)


def write_report(ctx: CampaignContext, best: dict[str, str], stop_reason: str | None) -> Path:
    store, cid = ctx.store, ctx.campaign_id
    campaign = store.campaign(cid)
    assert campaign is not None
    per_problem, device, interpreted = [], None, False
    for problem in ctx.config.problems:
        rows = store.evaluations(cid, problem)
        best_row = next((r for r in rows if r.candidate.id == best.get(problem)), None)
        baselines = store.baselines(cid, problem)
        for r in rows:
            if r.result.device is not None:
                d = r.result.device
                device = f"{d.name} ({d.arch}), torch {d.torch}, triton {d.triton}, Python {d.python}"
                interpreted = interpreted or d.interpreted
        per_problem.append(
            {
                "name": problem,
                "rows": rows,
                "status_counts": dict(Counter(r.result.status.value for r in rows)),
                "best": best_row,
                "best_knobs": json.dumps(best_row.candidate.knobs) if best_row else "",
                "baselines": baselines,
                "baseline_names": sorted({n for per_shape in baselines.values() for n in per_shape}),
                "speedups": best_row.result.speedups(baselines) if best_row else {},
            }
        )
    text = _ENV.get_template("report.md.j2").render(
        campaign=campaign,
        problems=ctx.config.problems,
        stop_reason=stop_reason,
        total_evaluations=store.count_evaluations(cid),
        device=device,
        interpreted=interpreted,
        per_problem=per_problem,
        accepted=store.accepted(cid),
    )
    out = Path(ctx.report_dir) / "report.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out
