"""The campaign report's plots, drawn with matplotlib's Agg canvas (no display, no pyplot state)
as PNG bytes: the report embeds them in its HTML page and writes them beside its Markdown."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


@dataclass(kw_only=True)
class SpeedupSeries:
    """One problem's correct evaluations in campaign order: where each happened (its number among
    all the campaign's evaluations, seconds since the campaign was created) and its speedup over
    `baseline`."""

    problem: str
    baseline: str
    evaluation: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    speedup: list[float] = field(default_factory=list)

    def best_so_far(self) -> list[float]:
        out: list[float] = []
        for s in self.speedup:
            out.append(max(s, out[-1]) if out else s)
        return out


def _time_axis(seconds: list[float]) -> tuple[float, str]:
    longest = max(seconds, default=0.0)
    if longest < 120:
        return 1.0, "seconds since the campaign started"
    if longest < 2 * 3600:
        return 60.0, "minutes since the campaign started"
    return 3600.0, "hours since the campaign started"


def speedup_plot(series: list[SpeedupSeries], *, over: str, interpreted: bool) -> bytes:
    """PNG of the best speedup so far per problem (a step line over each correct candidate's own
    speedup, drawn faintly), `over` "evaluations" or "time"."""
    fig = Figure(figsize=(5.8, 3.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if over == "time":
        scale, xlabel = _time_axis([s for one in series for s in one.seconds])
    else:
        scale, xlabel = 1.0, "evaluation (all problems, in order)"
    drawn = 0
    for one in series:
        if not one.speedup:
            continue
        xs = [s / scale for s in one.seconds] if over == "time" else one.evaluation
        (line,) = ax.step(
            xs, one.best_so_far(), where="post", linewidth=2, label=f"{one.problem} (vs {one.baseline})"
        )
        ax.scatter(xs, one.speedup, s=14, alpha=0.35, color=line.get_color())
        drawn += 1
    ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle="--")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("best speedup so far (x)")
    title = f"Best speedup over {'time' if over == 'time' else 'evaluations'}"
    if interpreted:
        title += "\n(interpreted CPU timings: not GPU speed)"
    ax.set_title(title, fontsize=11)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(
            0.5, 0.5, "no correct candidate with timed baselines yet", ha="center", transform=ax.transAxes
        )
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
