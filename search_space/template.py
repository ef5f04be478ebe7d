"""Kernel templates: a module source with knob placeholders, its knob space and constraints.

A template renders to the complete source of a self-contained candidate module (imports only
torch, triton, triton.language and math), so a rendered template and a kernel written by an
LLM or a person go through exactly the same screen, sandbox and registry.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import string
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

# CPython 3.11 keeps the AST constructor's recursion depth in state shared by every thread: a
# parse that another thread's parse interrupts (a finalizer run by the garbage collector hands
# over the GIL) fails with "SystemError: AST constructor recursion depth mismatch". A parallel
# LocalBackend screens its candidates in threads, campaigns render knobs into sources beside it:
# every parse of candidate or template source goes through this one lock.
_PARSE_LOCK = threading.Lock()


def parse_source(source: str) -> ast.Module:
    """`ast.parse(source)`, one thread at a time (see _PARSE_LOCK); raises SyntaxError. A parse
    that a library's own parse in another thread (Triton parses its kernels) interrupted anyway
    is tried again: the error is the interpreter's, not the source's."""
    with _PARSE_LOCK:
        for _ in range(2):
            try:
                return ast.parse(source)
            except SystemError as error:
                if "recursion depth mismatch" not in str(error):
                    raise
        return ast.parse(source)


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
    """Either `template_file` (under search_space/templates) with `$KNOB` placeholders, or
    `source_module`: a self-contained kernel module (the op's default kernel, one source for
    both) whose top-level `KNOBS = {...}` dict of literals holds the knobs, rendered by writing
    the values into that dict. With `base_module`, a template file's rendered text follows that
    module's source, verbatim: the template is then an entry point that launches the module's
    kernels with the knobs' configuration (the module is read as text, not imported, and must
    itself pass the screen)."""

    problem: str
    entry: str
    knobs: tuple[Knob, ...]
    constraint: Callable[[dict[str, Any]], str | None]
    template_file: str | None = None
    source_module: str | None = None
    base_module: str | None = None

    def __post_init__(self) -> None:
        if (self.template_file is None) == (self.source_module is None):
            raise ValueError(f"template {self.problem!r}: give exactly one of template_file, source_module")

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
            if not _is_choice(value, by_name[name].choices):
                raise ValueError(f"knob {name}={value!r} is not one of {by_name[name].choices}")
        reason = self.constraint(full)
        if reason is not None:
            raise ValueError(f"knobs violate a constraint: {reason}")
        return full

    def restricted(self, allowed: dict[str, list[Any]]) -> KnobTemplate:
        """This template with each knob named in `allowed` limited to those of its choices (in
        the order given; the knob's default stays where allowed, else the first value);
        ValueError naming an unknown knob or a value that is not one of its choices."""
        by_name = {k.name: k for k in self.knobs}
        unknown = sorted(set(allowed) - set(by_name))
        if unknown:
            raise ValueError(
                f"unknown knob(s) {unknown} for template {self.problem!r}; knobs are {sorted(by_name)}"
            )
        knobs = []
        for knob in self.knobs:
            if knob.name not in allowed:
                knobs.append(knob)
                continue
            values = allowed[knob.name]
            if not values:
                raise ValueError(f"knob {knob.name}: no values allowed")
            for value in values:
                if not _is_choice(value, knob.choices):
                    raise ValueError(f"knob {knob.name}={value!r} is not one of {knob.choices}")
            default = knob.default if knob.default in values else values[0]
            knobs.append(dataclasses.replace(knob, choices=tuple(values), default=default))
        return dataclasses.replace(self, knobs=tuple(knobs))

    def source_template(self) -> str:
        if self.source_module is not None:
            return _module_source(self.source_module)
        return resources.files("search_space").joinpath("templates", self.template_file).read_text()

    def base_source(self) -> str:
        return "" if self.base_module is None else _module_source(self.base_module)

    def render(self, knobs: dict[str, Any]) -> str:
        """Complete module source for these knob values (validated first)."""
        full = self.validate(knobs)
        if self.source_module is not None:
            return with_knobs(self.source_template(), full)
        entry = string.Template(self.source_template()).substitute({k: repr(v) for k, v in full.items()})
        return self.base_source() + entry


def _is_choice(value: Any, choices: tuple[Any, ...]) -> bool:
    """Type and value match a choice exactly: 1.0 == 1 and 0 == False would render as different
    source."""
    return any(type(value) is type(c) and value == c for c in choices)


@functools.cache
def _module_source(name: str) -> str:
    """A module's source text, read once per process (every proposal renders the template)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ValueError(f"no module {name!r} for a template to build on")
    return Path(spec.origin).read_text()


# The most characters of kernel source a proposal's prompt shows as its starting point: what a
# model reads and must return whole within its output budget. Every template's rendering stays
# within it (the attention families' kernels build on the kit, kernels/kit, for that).
PROMPT_SOURCE_BOUND = 25_000

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
    """`source` with these knob values written into its KNOBS dict; a value the dict holds
    already keeps its text (so the defaults render the source byte for byte)."""
    current = knob_values(source)
    changed = {
        name: repr(value).encode()
        for name, value in knobs.items()
        if not (name in current and type(current[name]) is type(value) and current[name] == value)
    }
    return _splice(source, changed)


def source_hash(source: str) -> str:
    """Content hash identifying a candidate's source everywhere (store, cache, library)."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def get_template(problem: str) -> KnobTemplate:
    """The knob template of `problem`: its module's TEMPLATE (or TEMPLATES[problem], where a
    module declares several problems)."""
    from search_space.problem import problem_module  # late: problem modules import this one

    module = problem_module(problem)
    templates = getattr(module, "TEMPLATES", {})
    template = templates.get(problem) if templates else getattr(module, "TEMPLATE", None)
    if template is None:
        raise ValueError(f"problem {problem!r} has no knob template")
    return template
