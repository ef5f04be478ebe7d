"""Kernel templates: a module source with knob placeholders, its knob space and constraints.

A template renders to the complete source of a self-contained candidate module (imports only
torch, triton, triton.language and math), so a rendered template and a kernel written by an
LLM or a person go through exactly the same screen, sandbox and registry.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import string
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Knob:
    name: str
    choices: tuple[Any, ...]
    default: Any
    help: str = ""

    def __post_init__(self) -> None:
        assert self.default in self.choices, f"default of knob {self.name} not among its choices"


@dataclass(frozen=True, kw_only=True)
class KnobTemplate:
    """`template_file` (under search_space/templates) with `$KNOB` placeholders; with
    `base_module`, the rendered text follows that module's source, verbatim: the template is then
    an entry point that launches the module's kernels with the knobs' configuration (the module
    is read as text, not imported, and must itself pass the screen)."""

    problem: str
    template_file: str
    entry: str
    knobs: tuple[Knob, ...]
    constraint: Callable[[dict[str, Any]], str | None]
    base_module: str | None = None

    def defaults(self) -> dict[str, Any]:
        return {k.name: k.default for k in self.knobs}

    def validate(self, knobs: dict[str, Any]) -> dict[str, Any]:
        """Knob values completed with defaults; ValueError naming the offending knob."""
        by_name = {k.name: k for k in self.knobs}
        unknown = sorted(set(knobs) - set(by_name))
        if unknown:
            raise ValueError(
                f"unknown knob(s) {unknown} for template {self.problem!r}; knobs are {sorted(by_name)}"
            )
        # numpy scalars (from samplers) become Python values; then type and value must match a
        # choice exactly, since 1.0 == 1 and 0 == False would render as different source.
        full = {k: getattr(v, "item", lambda v=v: v)() for k, v in (self.defaults() | dict(knobs)).items()}
        for name, value in full.items():
            if not any(type(value) is type(c) and value == c for c in by_name[name].choices):
                raise ValueError(f"knob {name}={value!r} is not one of {by_name[name].choices}")
        reason = self.constraint(full)
        if reason is not None:
            raise ValueError(f"knobs violate a constraint: {reason}")
        return full

    def source_template(self) -> str:
        return resources.files("search_space").joinpath("templates", self.template_file).read_text()

    def base_source(self) -> str:
        return "" if self.base_module is None else _module_source(self.base_module)

    def render(self, knobs: dict[str, Any]) -> str:
        """Complete module source for these knob values (validated first)."""
        full = self.validate(knobs)
        entry = string.Template(self.source_template()).substitute({k: repr(v) for k, v in full.items()})
        return self.base_source() + entry


@functools.cache
def _module_source(name: str) -> str:
    """A module's source text, read once per process (every proposal renders the template)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ValueError(f"no module {name!r} for a template to build on")
    return Path(spec.origin).read_text()


def source_hash(source: str) -> str:
    """Content hash identifying a candidate's source everywhere (store, cache, library)."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def get_template(problem: str) -> KnobTemplate:
    from search_space.problem import get_problem  # late: problem modules import this one

    get_problem(problem)  # clear error for unknown names
    module = importlib.import_module(f"search_space.{problem}")
    return module.TEMPLATE
