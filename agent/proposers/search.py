"""Offline search proposer: Optuna over a template's knobs, no LLM needed.

The store is the memory: each call rebuilds the study from every finished evaluation of the
problem, so a resumed campaign continues the same search without Optuna's own storage.
"""

from __future__ import annotations

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from sandbox.candidate import Candidate
from search_space.template import KnobTemplate

optuna.logging.set_verbosity(optuna.logging.WARNING)

# Bounded retries when the sampler keeps suggesting invalid or already-seen knob settings.
MAX_ASKS_PER_CANDIDATE = 50


class SearchProposer:
    name = "search"

    def __init__(self, template: KnobTemplate, *, sampler: str = "tpe", seed: int = 0) -> None:
        self.template = template
        self.sampler = sampler
        self.seed = seed
        self.distributions = {k.name: CategoricalDistribution(list(k.choices)) for k in template.knobs}

    def _study(self, history: list[tuple[dict, float | None]]) -> optuna.Study:
        # Seeding by history length makes a resumed search propose what the original would have.
        seed = self.seed + len(history)
        sampler = (
            optuna.samplers.TPESampler(seed=seed, n_startup_trials=6, multivariate=True)
            if self.sampler == "tpe"
            else optuna.samplers.RandomSampler(seed=seed)
        )
        study = optuna.create_study(direction="minimize", sampler=sampler)
        for knobs, score in history:
            params = {k: v for k, v in knobs.items() if k in self.distributions}
            if len(params) != len(self.distributions):
                continue  # not a point of this space (another proposer's kernel)
            if score is None:
                study.add_trial(
                    create_trial(params=params, distributions=self.distributions, state=TrialState.FAIL)
                )
            else:
                study.add_trial(create_trial(params=params, distributions=self.distributions, value=score))
        return study

    def propose(
        self, n: int, history: list[tuple[dict, float | None]], seen: set[str], parent_id: str | None = None
    ) -> list[Candidate]:
        """Up to `n` new candidates; `history` is (knobs, score in us or None if it failed)."""
        out: list[Candidate] = []
        seen = set(seen)
        if not history and n > 0:
            default = self._candidate(self.template.defaults(), parent_id)
            if default.id not in seen:
                out.append(default)
                seen.add(default.id)
        study = self._study(history)
        asks = 0
        while len(out) < n and asks < MAX_ASKS_PER_CANDIDATE * n:
            asks += 1
            trial = study.ask(self.distributions)
            try:
                cand = self._candidate(trial.params, parent_id)
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

    def _candidate(self, knobs: dict, parent_id: str | None) -> Candidate:
        knobs = self.template.validate(knobs)
        return Candidate(
            problem=self.template.problem,
            source=self.template.render(knobs),
            entry=self.template.entry,
            knobs=knobs,
            origin="template",
            parent_id=parent_id,
        )
