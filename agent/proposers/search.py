"""Offline search proposer: Optuna over a template's knobs, no LLM needed.

The store is the memory: each call rebuilds the study from every finished evaluation of the
problem, so a resumed campaign continues the same search without Optuna's own storage.

What it tunes: the template, or, when the current best is a module written outside the
template that keeps the template's knobs in a KNOBS dict (as the LLM is asked to), that
module's knobs. So in a mixed campaign the LLM changes the structure and the search tunes it.
When the best's knobs are exhausted, the search goes on in the spaces of the other elites
(`ProposalRequest.elites`, in their order), each a module of another lineage or the template.
"""

from __future__ import annotations

from typing import Any, Protocol

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from agent.proposers.base import ProposalRequest
from agent.proposers.knob_source import SourceKnobs, knob_values, structure_key
from sandbox.candidate import Candidate
from search_space.template import Knob, KnobTemplate

optuna.logging.set_verbosity(optuna.logging.WARNING)

# Bounded retries when the sampler keeps suggesting invalid or already-seen knob settings.
MAX_ASKS_PER_CANDIDATE = 50


class KnobSpace(Protocol):
    """A template, or the knobs of a module's KNOBS dict (`SourceKnobs`)."""

    @property
    def problem(self) -> str: ...

    @property
    def entry(self) -> str: ...

    @property
    def knobs(self) -> tuple[Knob, ...]: ...

    def defaults(self) -> dict[str, Any]: ...

    def validate(self, knobs: dict[str, Any]) -> dict[str, Any]: ...

    def render(self, knobs: dict[str, Any]) -> str: ...


class SearchProposer:
    kind = "search"

    def __init__(self, template: KnobTemplate, *, sampler: str = "tpe", seed: int = 0) -> None:
        self.template = template
        self.sampler = sampler
        self.seed = seed
        self._exhausted: str | None = None
        self._renders: dict[str, bool] = {}  # candidate id -> is a rendering of the template
        self._structures: dict[str, str] = {}  # candidate id -> structure_key of its source

    @property
    def exhausted(self) -> str | None:
        return self._exhausted

    def paused_until(self) -> float | None:
        return None

    def _is_render(self, c: Candidate) -> bool:
        if c.id not in self._renders:
            try:
                self._renders[c.id] = self.template.render(c.knobs) == c.source
            except (ValueError, KeyError):
                self._renders[c.id] = False
        return self._renders[c.id]

    def _structure(self, c: Candidate) -> str:
        if c.id not in self._structures:
            self._structures[c.id] = structure_key(c.source)
        return self._structures[c.id]

    def space_for(self, best: Candidate | None) -> KnobSpace:
        """The best candidate's own knobs when it is a module written outside the template
        that keeps some of them; the template otherwise."""
        if best is not None and not self._is_render(best):
            own = SourceKnobs(self.template, best.source, best.entry)
            if own.knobs:
                return own
        return self.template

    def propose(self, n: int, request: ProposalRequest) -> list[Candidate]:
        best = request.best.candidate if request.best else None
        starts = [best] + [e.candidate for e in request.elites if best is None or e.candidate.id != best.id]
        out: list[Candidate] = []
        tried: set[str] = set()
        for start in starts:
            if len(out) >= n:
                break
            space = self.space_for(start)
            key = structure_key(space.source) if isinstance(space, SourceKnobs) else ""
            if key in tried:
                continue
            tried.add(key)
            seen = set(request.seen) | {c.id for c in out}
            out += self._propose_in(space, n - len(out), request, seen, start)
        self._exhausted = f"search space of {request.problem} exhausted" if n > 0 and not out else None
        return out

    def _propose_in(
        self, space: KnobSpace, n: int, request: ProposalRequest, seen: set[str], start: Candidate | None
    ) -> list[Candidate]:
        """Up to `n` new points of `space`, told every evaluated point of it; their parent is `start`."""
        if isinstance(space, SourceKnobs):
            key = structure_key(space.source)
            names = {k.name for k in space.knobs}
            history = [
                ({k: v for k, v in knob_values(r.candidate.source).items() if k in names}, r.score_us)
                for r in request.rows
                if self._structure(r.candidate) == key
            ]
        else:
            history = [(r.candidate.knobs, r.score_us) for r in request.rows if self._is_render(r.candidate)]
        return self.suggest(n, history, seen, parent_id=start.id if start else None, space=space)

    def _study(self, history: list[tuple[dict, float | None]], distributions: dict) -> optuna.Study:
        # Seeding by history length makes a resumed search propose what the original would have.
        seed = self.seed + len(history)
        sampler = (
            optuna.samplers.TPESampler(seed=seed, n_startup_trials=6, multivariate=True)
            if self.sampler == "tpe"
            else optuna.samplers.RandomSampler(seed=seed)
        )
        study = optuna.create_study(direction="minimize", sampler=sampler)
        for knobs, score in history:
            params = {k: v for k, v in knobs.items() if k in distributions}
            if len(params) != len(distributions):
                continue  # not a point of this space (another proposer's kernel)
            if score is None:
                study.add_trial(
                    create_trial(params=params, distributions=distributions, state=TrialState.FAIL)
                )
            else:
                study.add_trial(create_trial(params=params, distributions=distributions, value=score))
        return study

    def suggest(
        self,
        n: int,
        history: list[tuple[dict, float | None]],
        seen: set[str],
        parent_id: str | None = None,
        space: KnobSpace | None = None,
    ) -> list[Candidate]:
        """Up to `n` new knob settings of `space` (default: the template); `history` is (knobs,
        score in us or None if it failed) of this space's points."""
        space = space or self.template
        distributions = {k.name: CategoricalDistribution(list(k.choices)) for k in space.knobs}
        out: list[Candidate] = []
        seen = set(seen)
        if not history and n > 0:
            default = self._candidate(space, space.defaults(), parent_id)
            if default.id not in seen:
                out.append(default)
                seen.add(default.id)
        study = self._study(history, distributions)
        asks = 0
        while len(out) < n and asks < MAX_ASKS_PER_CANDIDATE * n:
            asks += 1
            trial = study.ask(distributions)
            try:
                cand = self._candidate(space, trial.params, parent_id)
            except ValueError:  # a constraint: tell the sampler this region is infeasible
                study.tell(trial, state=TrialState.FAIL)
                continue
            if cand.id in seen:
                study.tell(trial, state=TrialState.PRUNED)
                continue
            # Pending until evaluated; the next call rebuilds the study from real scores.
            study.tell(trial, state=TrialState.PRUNED)
            seen.add(cand.id)
            out.append(cand)
        return out

    def _candidate(self, space: KnobSpace, knobs: dict, parent_id: str | None) -> Candidate:
        knobs = space.validate(knobs)
        source = space.render(knobs)
        return Candidate(
            problem=space.problem,
            source=source,
            entry=space.entry,
            # A module's candidates record all of its KNOBS, tuned or not.
            knobs=knobs if space is self.template else knob_values(source),
            origin="template",
            parent_id=parent_id,
        )
