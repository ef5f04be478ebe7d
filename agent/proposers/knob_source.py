"""Knobs kept in a module's source: a top-level `KNOBS = {"BLOCK_B": 4, ...}` dict of literals,
as every rendered template has and as the LLM is asked to keep in the modules it writes.

This lets the search proposer tune the knobs of a kernel it did not write: the LLM changes the
structure, the search tunes the numbers. Values are replaced in place, so the rest of the
source, comments and formatting included, stays byte for byte the same.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from sandbox.screen import parse_source
from search_space.template import Knob, KnobTemplate, source_hash

KNOBS_NAME = "KNOBS"
_MASK = b"..."


def _literal_spans(source: str) -> dict[str, tuple[Any, int, int]] | None:
    """Knob name -> (value, start byte, end byte) of its value in `source`; None without a
    top-level KNOBS dict of constants."""
    try:
        tree = parse_source(source)
    except SyntaxError:
        return None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == KNOBS_NAME
            and isinstance(node.value, ast.Dict)
        ):
            break
    else:
        return None
    # ast counts columns in UTF-8 bytes.
    line_starts = [0]
    for line in source.encode().splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    spans: dict[str, tuple[Any, int, int]] = {}
    for key, value in zip(node.value.keys, node.value.values, strict=True):
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            return None
        if not isinstance(value, ast.Constant):
            return None  # computed values are the module's business, not a knob
        assert value.end_lineno is not None and value.end_col_offset is not None
        start = line_starts[value.lineno - 1] + value.col_offset
        end = line_starts[value.end_lineno - 1] + value.end_col_offset
        spans[key.value] = (value.value, start, end)
    return spans


def knob_values(source: str) -> dict[str, Any]:
    """The values of the module's KNOBS dict ({} without one)."""
    spans = _literal_spans(source)
    return {name: value for name, (value, _, _) in (spans or {}).items()}


def _splice(source: str, replacements: dict[str, bytes]) -> str:
    spans = _literal_spans(source)
    assert spans is not None
    data = source.encode()
    for name, (_, start, end) in sorted(spans.items(), key=lambda kv: -kv[1][1]):
        if name in replacements:
            data = data[:start] + replacements[name] + data[end:]
    return data.decode()


def structure_key(source: str) -> str:
    """Hash of the source with its knob values masked: the same kernel at other knob values
    has the same key."""
    spans = _literal_spans(source)
    if not spans:
        return source_hash(source)
    return source_hash(_splice(source, {name: _MASK for name in spans}))


def with_knobs(source: str, knobs: dict[str, Any]) -> str:
    """`source` with these knob values written into its KNOBS dict."""
    return _splice(source, {name: repr(value).encode() for name, value in knobs.items()})


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
