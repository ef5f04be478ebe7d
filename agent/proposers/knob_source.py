"""Knobs kept in a module's source: a top-level `KNOBS = {"BLOCK_B": 4, ...}` dict of literals,
as every rendered template has and as the LLM is asked to keep in the modules it writes.

This lets the search proposer tune the knobs of a kernel it did not write: the LLM changes the
structure, the search tunes the numbers. Values are replaced in place, so the rest of the
source, comments and formatting included, stays byte for byte the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from search_space.template import (
    KNOBS_NAME,
    Knob,
    KnobTemplate,
    knob_values,
    structure_key,
    with_knobs,
)

__all__ = ["KNOBS_NAME", "SourceKnobs", "knob_values", "structure_key", "with_knobs"]


@dataclass(frozen=True)
class SourceKnobs:
    """The knob space of a module written outside the template: the template's knobs that its
    KNOBS dict also has, with the template's choices and constraint (the constraint sees the
    template's defaults for knobs the module does not have)."""

    template: KnobTemplate
    source: str
    entry: str

    @property
    def problem(self) -> str:
        return self.template.problem

    @property
    def knobs(self) -> tuple[Knob, ...]:
        """The template's knobs the module keeps at one of the template's choices (a value
        outside them, e.g. BLOCK_D = 96, stays as the module has it)."""
        values = knob_values(self.source)
        return tuple(
            k
            for k in self.template.knobs
            if k.name in values
            and any(type(values[k.name]) is type(c) and values[k.name] == c for c in k.choices)
        )

    def defaults(self) -> dict[str, Any]:
        values = knob_values(self.source)
        return {k.name: values[k.name] for k in self.knobs}

    def validate(self, knobs: dict[str, Any]) -> dict[str, Any]:
        names = {k.name for k in self.knobs}
        unknown = sorted(set(knobs) - names)
        if unknown:
            raise ValueError(f"unknown knob(s) {unknown}; this kernel's knobs are {sorted(names)}")
        full = self.template.validate(self.defaults() | dict(knobs))
        return {name: full[name] for name in names}

    def render(self, knobs: dict[str, Any]) -> str:
        return with_knobs(self.source, self.validate(knobs))
