"""The prompts: what a kernel engineer would want to know, gathered from the problem, the store
and the hardware table, and rendered with the template files in `prompts/`."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

import jinja2

from agent.llm.proposals import current_knobs, knob_space
from agent.store import EvaluationRow, LLMProposalRow
from sandbox import screen
from sandbox.candidate import Candidate
from sandbox.hardware import CEILINGS
from sandbox.result import EvalResult, Status, TimingStats, ratio
from search_space import get_problem
from search_space.problem import Problem, Shape

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("agent", "llm/prompts"),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
)

# The GPU the kernels are written for when the campaign runs on the interpreter.
TARGET_ARCH = "sm_90"
MESSAGE_CHARS = 600  # of an attempt's error message in the history
LOG_TAIL_CHARS = 2500  # of a failed evaluation's log in a repair turn
MAX_MISMATCHES = 3


@dataclass(frozen=True)
class Ceilings:
    arch: str
    measured_here: bool  # False: the campaign runs elsewhere (the interpreter); these are the target's
    hbm_tb_per_s: float
    bf16_tflop_per_s: float

    @property
    def ridge_flop_per_byte(self) -> float:
        return self.bf16_tflop_per_s * 1e12 / (self.hbm_tb_per_s * 1e12)


def ceilings(arch: str) -> Ceilings:
    known = arch in CEILINGS
    c = CEILINGS[arch if known else TARGET_ARCH]
    return Ceilings(
        arch=arch if known else TARGET_ARCH,
        measured_here=known,
        hbm_tb_per_s=c["hbm_bytes_per_s"] / 1e12,
        bf16_tflop_per_s=c["bf16_flops_per_s"] / 1e12,
    )


def _shape_line(problem: Problem, shape: Shape, hw: Ceilings) -> dict:
    flops, nbytes = problem.flops(shape), problem.bytes(shape)
    intensity = flops / nbytes if nbytes else float("inf")
    return {
        "describe": shape.describe(),
        "flops": flops,
        "bytes": nbytes,
        "intensity": intensity,
        "bound": "memory" if intensity < hw.ridge_flop_per_byte else "compute",
    }


def mismatches(result: EvalResult) -> list[str]:
    """Where and by how much the failed checks were off."""
    out = []
    for c in result.checks:
        if c.ok:
            continue
        where = f"{c.shape} {c.dtype} trial {c.trial}"
        figures = []
        if c.max_abs_err is not None:
            figures.append(f"max abs err {c.max_abs_err:.4g}")
        if c.norm_rel_err is not None:
            figures.append(f"norm rel err {c.norm_rel_err:.3g}")
        if c.worst_index is not None:
            figures.append(f"worst at index {c.worst_index}")
        out.append(f"{where}: {c.message}" + (f" ({', '.join(figures)})" if figures else ""))
    return out[:MAX_MISMATCHES]


def _timing_lines(result: EvalResult, baselines: dict[str, dict[str, TimingStats]]) -> list[str]:
    if result.interpreted:
        # The interpreter's times (the same kernel at 17 ms and 34 ms in two runs) say nothing of
        # GPU speed: no microseconds, GB/s or speedups from them reach the model.
        return []
    lines = []
    for t in result.timings:
        known = baselines.get(f"{t.shape}/{t.dtype}", {}) | t.baselines
        vs = ", ".join(f"{ratio(b.median_us / t.candidate.median_us)} vs {n}" for n, b in known.items())
        roof = (
            f"{100 * t.roofline_fraction:.0f}% of roofline"
            if t.roofline_fraction is not None
            else "roofline n/a"
        )
        lines.append(
            f"{t.shape} {t.dtype}: {t.candidate.median_us:.1f} us (p20 {t.candidate.p20_us:.1f}, "
            f"p80 {t.candidate.p80_us:.1f}), {t.achieved_gbps:.0f} GB/s, {roof}" + (f"; {vs}" if vs else "")
        )
    return lines


def attempt_summary(row: EvaluationRow, llm: LLMProposalRow | None) -> dict:
    r = row.result
    score = r.geomean_us() if r.status == Status.OK else None
    return {
        "id": row.candidate.id,
        "origin": row.candidate.origin,
        "kind": llm.kind if llm else ("knobs" if row.candidate.knobs else "module"),
        "parent": row.candidate.parent_id,
        "rationale": llm.rationale if llm else "",
        "knobs": json.dumps(row.candidate.knobs) if row.candidate.knobs else "",
        "status": r.status.value,
        "message": r.message[:MESSAGE_CHARS],
        "mismatches": mismatches(r),
        "score": (
            "correct (timed on the interpreter only: no speed to report)"
            if r.interpreted
            else f"{score:.1f} us geometric mean"
        )
        if score is not None
        else "",
    }


def _family(rows: list[EvaluationRow], parent: EvaluationRow | None) -> set[str]:
    """The ids of `parent`'s lineage: its ancestors and everything that descends from them."""
    by_id = {r.candidate.id: r for r in rows}
    family: set[str] = set()
    cid = parent.candidate.id if parent else None
    while cid is not None and cid not in family:
        family.add(cid)
        cid = by_id[cid].candidate.parent_id if cid in by_id else None
    for r in rows:  # in evaluation order, so parents come before their children
        if r.candidate.parent_id in family:
            family.add(r.candidate.id)
    return family


def lineage(rows: list[EvaluationRow], parent: EvaluationRow | None, limit: int) -> list[EvaluationRow]:
    """The last `limit` attempts of `parent`'s lineage (its ancestors and everything that
    descends from them), oldest first; no other lineage's."""
    if limit <= 0:
        return []
    family = _family(rows, parent)
    return [r for r in rows if r.candidate.id in family][-limit:]


def other_attempts(
    rows: list[EvaluationRow], parent: EvaluationRow | None, limit: int
) -> list[EvaluationRow]:
    """The last `limit` attempts outside `parent`'s lineage, oldest first (shown apart from the
    lineage's own, as other kernels' attempts)."""
    if limit <= 0:
        return []
    family = _family(rows, parent)
    return [r for r in rows if r.candidate.id not in family][-limit:]


def screen_rules(problem: Problem) -> dict:
    """The screen's allowlist (sandbox.screen) as the system prompt states it."""
    extras = getattr(problem, "screen_extras", ())
    return {
        "allowed_imports": sorted(screen.ALLOWED_IMPORTS - {"__future__"}),
        "open_modules": list(screen.OPEN_MODULES),
        "triton": sorted(screen.ALLOWED_TRITON),
        "torch": sorted(screen.ALLOWED_TORCH - screen.TORCH_DTYPES) + [e for e in extras if "." in e],
        "attributes": sorted(screen.VALUE_ATTRIBUTES | {e for e in extras if "." not in e}),
        "builtins": sorted(screen.ALLOWED_BUILTINS - {"None", "True", "False", "Ellipsis", "NotImplemented"}),
        "kit": {module: sorted(screen.kit_exports(module)) for module in screen.kit_modules()},
    }


def system_prompt(problem: str, kinds: list[str]) -> str:
    p = get_problem(problem)
    return _ENV.get_template("system.j2").render(
        problem=p, kinds=kinds, rules=screen_rules(p), has_template=p.template is not None
    )


def propose_prompt(
    *,
    problem: str,
    arch: str,
    best: EvaluationRow | None,
    base: Candidate | None,
    attempts: list[EvaluationRow],
    llm_rows: dict[str, LLMProposalRow],
    baselines: dict[str, dict[str, TimingStats]],
    kinds: list[str],
    parent: EvaluationRow | None = None,
    rejected: list[str] | None = None,
    others: list[EvaluationRow] = (),
    left_out: int = 0,
    source_lines: int | None = None,
) -> str:
    """The task of a fresh proposal: improve `parent` (an elite; the best if None), whose source
    is `base`, told the best's score when the parent is another lineage's. `attempts` are the
    recent attempts of the parent's lineage (`lineage`), `others` those of other lineages
    (`other_attempts`), each under a heading of its own. Where the model's context is too small
    for all of it: `left_out` says how many of the lineage's attempts are not shown, and
    `source_lines` shows only the first lines of the kernel."""
    p = get_problem(problem)
    hw = ceilings(arch)
    space = knob_space(problem, base)
    current = current_knobs(space, base) if space is not None else {}
    return _ENV.get_template("propose.j2").render(
        problem=p,
        reference=inspect.getsource(p.reference),
        tolerances={d: t for d, t in p.tolerances.items()},
        check_shapes=[s.describe() for s in p.check_shapes],
        timing_shapes=[_shape_line(p, s, hw) for s in p.timing_shapes],
        hw=hw,
        interpreted=arch == "interpreter",
        best=best,
        best_score=best.result.geomean_us() if best and not best.result.interpreted else None,
        parent=parent or best,
        parent_timings=_timing_lines((parent or best).result, baselines) if parent or best else [],
        base=base,
        shown_source=_first_lines(base.source, source_lines) if base else "",
        knobs=[
            {"name": k.name, "choices": k.choices, "current": current[k.name], "help": k.help}
            for k in (space.knobs if space is not None else ())
        ],
        attempts=[attempt_summary(r, llm_rows.get(r.candidate.id)) for r in attempts],
        others=[attempt_summary(r, llm_rows.get(r.candidate.id)) for r in others],
        left_out=left_out,
        kinds=kinds,
        rejected=rejected or [],
    )


def _first_lines(source: str, lines: int | None) -> str:
    """The source as the prompt shows it: whole, or its first `lines` lines and how many more
    there are."""
    all_lines = source.strip().splitlines()
    if lines is None or lines >= len(all_lines):
        return source.strip()
    rest = len(all_lines) - lines
    note = f"# ... {rest} more lines, not shown: the model's context cannot hold the whole kernel"
    return "\n".join([*all_lines[:lines], note])


def repair_prompt(candidate: Candidate, result: EvalResult, kinds: list[str]) -> str:
    return _ENV.get_template("repair.j2").render(
        candidate=candidate,
        result=result,
        mismatches=mismatches(result),
        log_tail=result.log_tail[-LOG_TAIL_CHARS:].strip(),
        kinds=kinds,
    )


def invalid_prompt(error: str, kinds: list[str]) -> str:
    return _ENV.get_template("invalid.j2").render(error=error, kinds=kinds)
