"""What a campaign keeps of a problem's evaluations: the best overall, the best per (dtype, shape
bucket), and a few diverse elites for the proposers to start from.

A kernel can be fastest on small shapes and slow on large ones, so the overall best (geometric
mean over every timing shape) is not the only winner worth keeping: each (dtype, bucket) has its
own, and registration gives each bucket to its winner (see `agent.nodes._winners`).

Elites keep the search from collapsing on one lineage. A lineage is everything descending from
one root (a candidate without a parent: an incumbent, a first proposal, a complete module
written before there was a best), following the `parent` links the store records. The elites
are at most K correct candidates, no two from the same lineage: the overall best first, then
the per-bucket winners, then the rest by their geometric mean; each lineage is represented by
the first of its members in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from statistics import geometric_mean

from agent.incumbents import ORIGIN as INCUMBENT
from agent.store import EvaluationRow
from sandbox.result import EvalResult, Status

# A new best must beat the old by more than the timing noise, and never by less than this.
MIN_IMPROVEMENT = 0.01


def bucket_key(dtype: str, bucket: str) -> str:
    """How a (dtype, shape bucket) is named in the campaign state: `fp32/d64`."""
    return f"{dtype}/{bucket}"


def buckets(rows: Iterable[EvaluationRow]) -> list[tuple[str, str]]:
    """The (dtype, bucket) pairs the correct rows were timed on."""
    return sorted({(t.dtype, t.bucket) for r in rows if r.score_us is not None for t in r.result.timings})


def bucket_us(
    result: EvalResult, dtype: str, bucket: str | None = None, graph: str | None = None
) -> float | None:
    """Geometric mean of the candidate's median times over its timing shapes of `dtype` (and of
    `bucket`, and of calls of `graph`, if given); None for an incorrect result or one not timed
    there."""
    if result.status != Status.OK:
        return None
    times = [
        t.candidate.median_us
        for t in result.timings
        if t.dtype == dtype and bucket in (None, t.bucket) and graph in (None, t.graph)
    ]
    return geometric_mean(times) if times else None


def serving_us(result: EvalResult, dtype: str, bucket: str | None = None) -> float | None:
    """bucket_us over the serving-form timings where there are any (a softmax forward's training
    form, which also returns its statistics, is decided on apart: agent.nodes._training_buckets),
    else over all of them (gradient problems are timed in their training form alone)."""
    us = bucket_us(result, dtype, bucket, "serve")
    return us if us is not None else bucket_us(result, dtype, bucket)


def noise(
    result: EvalResult, dtype: str | None = None, bucket: str | None = None, graph: str | None = None
) -> float:
    """The largest relative spread (p80 - p20) / median among the timings (of `dtype`, `bucket`,
    `graph`)."""
    return max(
        (
            t.candidate.spread
            for t in result.timings
            if dtype in (None, t.dtype) and bucket in (None, t.bucket) and graph in (None, t.graph)
        ),
        default=0.0,
    )


def margin(new: EvalResult, old: EvalResult, where: tuple = ()) -> float:
    """By how much (relative) `new` must be faster than `old` to count: more than either's timing
    noise (over `where`: dtype and bucket, if given), and at least MIN_IMPROVEMENT."""
    return max(MIN_IMPROVEMENT, noise(new, *where), noise(old, *where))


def beats(new_us: float, new: EvalResult, old_us: float, old: EvalResult, where: tuple = ()) -> bool:
    """`new` (`new_us`) is faster than `old` (`old_us`) by more than `margin`."""
    return new_us < old_us * (1 - margin(new, old, where))


def first_correct_proposal(
    rows: Iterable[EvaluationRow], score: Callable[[EvaluationRow], float | None] = lambda r: r.score_us
) -> EvaluationRow | None:
    """In evaluation order, the first proposal (not a kernel dispatch ran at the campaign's
    start) that `score` finds correct: what the interpreter's timings leave to choose, the same
    in every run of a campaign."""
    return next(
        (
            r
            for r in sorted(rows, key=lambda r: r.seq)
            if r.candidate.origin != INCUMBENT and score(r) is not None
        ),
        None,
    )


def pick_best(
    rows: list[EvaluationRow], incumbent_id: str | None = None, *, bucket: tuple[str, str] | None = None
) -> EvaluationRow | None:
    """Going through `rows` in order from the incumbent (if any), each correct row replaces the
    best so far only if it is faster by more than either's timing noise: over every timing
    shape, or over those of one (dtype, bucket).

    On the interpreter timings decide nothing (the same kernel measures 17 ms in one run and
    34 ms in the next): the best is the first correct proposal, the one registration takes
    (`agent.nodes._winners`), else the first correct row."""

    def score(row: EvaluationRow) -> float | None:
        return row.score_us if bucket is None else bucket_us(row.result, *bucket)

    ordered = sorted(rows, key=lambda r: r.seq)
    if any(r.result.interpreted for r in ordered if score(r) is not None):
        first = first_correct_proposal(ordered, score)
        return first or next(r for r in ordered if score(r) is not None)
    incumbent = next((r for r in rows if r.candidate.id == incumbent_id and score(r) is not None), None)
    for row in ordered:
        if row is incumbent or (s := score(row)) is None:
            continue
        if incumbent is None:
            incumbent = row
            continue
        best_s = score(incumbent)
        assert best_s is not None
        if beats(s, row.result, best_s, incumbent.result, bucket or ()):
            incumbent = row
    return incumbent


def pick_bucket_bests(
    rows: list[EvaluationRow], incumbents: Mapping[str, str] | None = None
) -> dict[str, str]:
    """`bucket_key` -> candidate id of the best on that (dtype, bucket), kept by `pick_best`'s
    margin from `incumbents` (the same mapping, from the previous selection)."""
    incumbents = incumbents or {}
    out = {}
    for dtype, bucket in buckets(rows):
        key = bucket_key(dtype, bucket)
        best = pick_best(rows, incumbents.get(key), bucket=(dtype, bucket))
        if best is not None:
            out[key] = best.candidate.id
    return out


def lineage_root(candidate_id: str, parents: Mapping[str, str | None]) -> str:
    """The first ancestor of `candidate_id` without a known parent (itself if it has none)."""
    path = {candidate_id}
    cid = candidate_id
    while (parent := parents.get(cid)) is not None and parent not in path:
        path.add(parent)
        cid = parent
    return cid


def elites(
    rows: list[EvaluationRow], k: int, *, best_id: str | None = None, bucket_best: Iterable[str] = ()
) -> list[EvaluationRow]:
    """At most `k` correct rows, no two of the same lineage: the best (`best_id`) first, then the
    per-bucket winners (`bucket_best`, candidate ids), then the others by geometric mean."""
    parents = {r.candidate.id: r.candidate.parent_id for r in rows}
    correct = {r.candidate.id: r for r in rows if r.score_us is not None}
    ranked = sorted(correct.values(), key=lambda r: (r.score_us, r.seq))
    first = [correct[cid] for cid in (best_id, *bucket_best) if cid in correct]
    out: list[EvaluationRow] = []
    roots: set[str] = set()
    for row in first + ranked:
        if len(out) >= k:
            break
        root = lineage_root(row.candidate.id, parents)
        if root not in roots:
            roots.add(root)
            out.append(row)
    return out


def primary_baseline(problem: str) -> str:
    """The production baseline progress and plots compare with: the problem's first eager op."""
    from search_space import get_problem

    return next(iter(get_problem(problem).baselines), "reference")


def beaten_on_recheck(
    recheck: EvalResult, beside: list[tuple[str, EvalResult]], served: dict[str, list[str]]
) -> str | None:
    """Why a winner's re-verification does not bear out its win, or None: on a GPU, on each
    served (dtype, bucket), none of what dispatch runs today (`beside`: (name, its evaluation),
    timed in the same session on the same kind of device) may be faster than it by more than
    either's noise. Times from another run are not compared: on an H100 one kernel read 677,
    840 and 574 us on one bucket in three runs minutes apart."""
    if recheck.interpreted:
        return None
    for dtype, dtype_buckets in served.items():
        for bucket in dtype_buckets:
            mine = serving_us(recheck, dtype, bucket)
            for name, other in beside:
                if other.interpreted or other.kind != recheck.kind:
                    continue
                theirs = serving_us(other, dtype, bucket)
                if mine is None or theirs is None:
                    continue
                if beats(theirs, other, mine, recheck, (dtype, bucket)):
                    return (
                        f"re-verification timed {dtype} {bucket} at {mine:.1f} us, and {name} (what "
                        f"dispatch runs today) at {theirs:.1f} us beside it"
                    )
    return None
