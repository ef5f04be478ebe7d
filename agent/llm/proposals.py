"""What the model may propose, as typed structured output, and how a proposal becomes a
candidate. Everything here is validated before anything is evaluated; a `ProposalError`'s
message goes back to the model as it is, so it says what was wrong and what to do instead.

The kinds:
- `knobs`: values for the knobs of the kernel shown (checked by the template's choices and
  constraint): rendered by the template where that kernel is a rendering of it, else written
  into the kernel's own `KNOBS` dict (an LLM-written module keeps the template's knobs there);
- `module`: a complete new kernel module;
- `edit`: search/replace blocks over the current kernel (the best one, or in a repair turn the
  one that failed); each search block must occur exactly once.

A fused variant is an op of its own (its problem declares what it fuses, as the embedding
backward fused with its optimizer does), searched with these same kinds.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from agent.proposers.knob_source import SourceKnobs
from sandbox.candidate import Candidate
from sandbox.screen import parse_source
from search_space import get_problem
from search_space.template import KnobTemplate

KnobValue = bool | int | float | str


class ProposalError(ValueError):
    """A reply that cannot become a candidate; the message is shown to the model."""


class _Proposal(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rationale: str = Field("", description="why this should be faster or fix the failure, briefly")


class KnobsProposal(_Proposal):
    kind: Literal["knobs"]
    knobs: dict[str, KnobValue] = Field(..., description="knob name -> value, among its choices")


class ModuleProposal(_Proposal):
    kind: Literal["module"]
    source: str = Field(..., min_length=1, description="the complete Python source of the kernel module")


class SearchReplace(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: str = Field(..., min_length=1, description="lines copied exactly from the current kernel")
    replace: str = Field(..., description="what replaces them")


class EditProposal(_Proposal):
    kind: Literal["edit"]
    edits: list[SearchReplace] = Field(..., min_length=1)


Proposal = Annotated[KnobsProposal | ModuleProposal | EditProposal, Field(discriminator="kind")]
PROPOSAL = TypeAdapter(Proposal)
KINDS = ("knobs", "module", "edit")


def proposal_schema() -> dict:
    """JSON schema of a reply, sent as response_format where the server takes one: one flat
    object (a `kind` and the fields of every kind, all but `kind` optional), with no top-level
    oneOf, no $ref and no discriminator, the form the structured-output backends of vLLM and
    SGLang (xgrammar, outlines) accept. Which fields a kind needs is checked after the reply, by
    the proposal models themselves (parse_proposal)."""
    value = {"type": ["boolean", "integer", "number", "string"]}
    knobs = {
        "type": "object",
        "additionalProperties": value,
        "description": KnobsProposal.model_fields["knobs"].description,
    }
    edit = {
        "type": "object",
        "properties": {
            name: {"type": "string", "description": f.description}
            for name, f in SearchReplace.model_fields.items()
        },
        "required": ["search", "replace"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "kind": {"type": "string", "enum": list(KINDS)},
            "rationale": {"type": "string", "description": _Proposal.model_fields["rationale"].description},
            "knobs": knobs,
            "source": {"type": "string", "description": ModuleProposal.model_fields["source"].description},
            "edits": {"type": "array", "items": edit, "minItems": 1},
        },
        "required": ["kind"],
        "additionalProperties": False,
    }


# Reasoning models think aloud before they answer, in a <think> block (DeepSeek-R1, Qwen3 and
# their servers) that may hold code fences and braces of its own; an unclosed one (a reply cut
# at max_tokens, or a server that strips the opening tag) runs to the end of the text.
_THINKING = re.compile(r"<(think|thinking|reasoning)>.*?(</\1>|\Z)", re.DOTALL | re.IGNORECASE)
_CLOSING_ONLY = re.compile(r"^.*?</(think|thinking|reasoning)>", re.DOTALL | re.IGNORECASE)
_PYTHON_FENCE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)\n?```", re.DOTALL)
_DECODER = json.JSONDecoder()
_OPENING = re.compile(r'\{\s*"kind"\s*:')


def _answer(text: str) -> str:
    """The reply without its reasoning: <think> blocks removed, and, where a server sent only
    the closing tag, everything before it."""
    text = _THINKING.sub("", text)
    return _CLOSING_ONLY.sub("", text, count=1) if _CLOSING_ONLY.match(text) else text


def _json_objects(text: str) -> list[tuple[int, object]]:
    """Every top-level JSON object in `text` (prose, fences and all around it), with where it
    starts: decoded at each "{" not inside an object already found."""
    found, i = [], text.find("{")
    while i >= 0:
        try:
            value, end = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        if isinstance(value, dict):
            found.append((i, value))
        i = text.find("{", end)
    return found


def _with_fenced_source(data: dict, answer: str, at: int) -> dict:
    """A module proposal whose source came as a ```python block beside its JSON header (the
    form models fall into when escaping a whole module in a JSON string goes wrong)."""
    if data.get("kind") != "module" or (isinstance(data.get("source"), str) and data["source"].strip()):
        return data
    blocks = [m for m in _PYTHON_FENCE.finditer(answer) if not m.start() <= at < m.end()]
    return {**data, "source": blocks[-1].group(1) + "\n"} if blocks else data


def parse_proposal(text: str) -> Proposal:
    """The proposal in a reply: the last JSON object in it that validates against the proposal
    schema, bare or fenced, with prose, reasoning blocks and other JSON around it; a module's
    source may come as a ```python block beside the JSON. Where none validates, the error of the
    last candidate object (or why no JSON was found) says what to fix."""
    answer = _answer(text)
    objects = _json_objects(answer)
    errors = []  # last object first
    for at, data in reversed(objects):
        try:
            return PROPOSAL.validate_python(_with_fenced_source(data, answer, at))
        except ValidationError as exc:
            errors.append((isinstance(data, dict) and "kind" in data, exc))
    # None validates. Where the proposal itself starts ({"kind": ...}, else the first brace) and
    # does not decode, that is what to fix, whatever braces inside its broken text decode as.
    opening = _OPENING.search(answer)
    start = opening.start() if opening else answer.find("{")
    if start >= 0 and all(at != start for at, _ in objects):
        try:
            _DECODER.raw_decode(answer, start)
        except json.JSONDecodeError as exc:
            raise ProposalError(
                f"the reply is not valid JSON ({exc.msg}: line {exc.lineno}, column {exc.colno}); "
                "reply with exactly one JSON object, with newlines in strings escaped as \\n"
            ) from None
    if not objects:
        raise ProposalError("the reply holds no JSON object; reply with exactly one JSON object")
    # What the proposal itself got wrong: the last object that names a kind, else the last one.
    last_error = next((exc for has_kind, exc in errors if has_kind), errors[0][1])
    problems = "; ".join(f"{_where(e)}: {e['msg']}" for e in last_error.errors())
    raise ProposalError(f"the JSON does not match the proposal schema: {problems}")


def _where(error: dict) -> str:
    if error["loc"]:
        return ".".join(str(p) for p in error["loc"])
    # A bad or missing "kind" is reported at the top level by the discriminated union.
    return "kind" if error["type"].startswith("union_tag") else "(top level)"


def _renders_template(template: KnobTemplate, candidate: Candidate) -> bool:
    try:
        return template.render(candidate.knobs) == candidate.source
    except (ValueError, KeyError):
        return False


def knob_space(problem: str, base: Candidate | None) -> KnobTemplate | SourceKnobs | None:
    """What a knobs reply tunes: the kernel shown (`base`). The template where that kernel is a
    rendering of it (the default kernel, a search's point) or there is none yet; else the
    template's knobs the kernel keeps in its own KNOBS dict (an LLM-written module); None where
    the problem has no template or the kernel keeps none of its knobs (no knobs reply then)."""
    if get_problem(problem).template is None:
        return None
    from search_space.template import get_template

    template = get_template(problem)
    if base is None or _renders_template(template, base):
        return template
    own = SourceKnobs(template, base.source, base.entry)
    return own if own.knobs else None


def current_knobs(space: KnobTemplate | SourceKnobs, base: Candidate | None) -> dict:
    """The values the kernel shown has for the knobs of `space`: what a knobs reply leaves as
    they are for the knobs it does not name."""
    if isinstance(space, SourceKnobs):
        return space.defaults()
    return space.validate(base.knobs) if base is not None else space.defaults()


def allowed_kinds(problem: str, base: Candidate | None) -> list[str]:
    """The kinds that make sense for `problem` now: knobs need knobs in the kernel shown (or
    the template, before any), edits a kernel to edit."""
    kinds = []
    if knob_space(problem, base) is not None:
        kinds.append("knobs")
    kinds.append("module")
    if base is not None:
        kinds.append("edit")
    return kinds


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def apply_edits(source: str, edits: list[SearchReplace]) -> str:
    """Apply search/replace blocks in order; each search block must occur exactly once in the
    text as edited so far."""
    for number, edit in enumerate(edits, 1):
        count = source.count(edit.search)
        first_line = edit.search.strip().splitlines()[0] if edit.search.strip() else edit.search
        if count == 0:
            squeezed = " ".join(edit.search.split())
            hint = (
                " (it matches if whitespace is ignored: copy the indentation and line breaks exactly)"
                if squeezed and squeezed in " ".join(source.split())
                else ""
            )
            raise ProposalError(
                f"edit {number}: search block not found in the kernel{hint}; it starts with "
                f"{first_line[:80]!r}; copy the lines exactly from the kernel shown"
            )
        if count > 1:
            lines, start = [], 0
            while (index := source.find(edit.search, start)) >= 0:
                lines.append(_line_of(source, index))
                start = index + 1
            raise ProposalError(
                f"edit {number}: search block occurs {count} times (lines {', '.join(map(str, lines))}); "
                "include more surrounding lines so that it matches exactly once"
            )
        source = source.replace(edit.search, edit.replace, 1)
    return source


def _check_module(source: str, entry: str) -> None:
    """What can be known without running it: it parses and defines the entry point."""
    try:
        tree = parse_source(source)
    except SyntaxError as exc:
        raise ProposalError(
            f"the kernel module does not parse: line {exc.lineno}: {exc.msg}; send valid Python"
        ) from None
    if not any(isinstance(n, ast.FunctionDef) and n.name == entry for n in tree.body):
        raise ProposalError(f"the kernel module defines no top-level function {entry!r}, the entry point")


def _render(space: KnobTemplate | SourceKnobs, knobs: dict, what: str) -> str:
    try:
        return space.render(knobs)
    except ValueError as exc:
        raise ProposalError(f"{what}: {exc}") from None


def to_candidate(
    proposal: Proposal,
    *,
    problem: str,
    base: Candidate | None,
    parent_id: str | None,
    knobs_of: Callable[[str], dict] = lambda source: {},
) -> Candidate:
    """The candidate a proposal describes. `base` is the kernel shown, which an edit applies to
    and a knobs reply tunes (`knob_space`: knobs the reply does not name keep the kernel's
    values); `knobs_of` reads the knob values a module keeps (recorded with the candidate for
    the search)."""
    p = get_problem(problem)
    kinds = allowed_kinds(problem, base)
    if proposal.kind not in kinds:
        raise ProposalError(
            f"kind {proposal.kind!r} is not available for this problem now; use one of {kinds}"
        )
    if isinstance(proposal, KnobsProposal):
        space = knob_space(problem, base)
        assert space is not None
        knobs = current_knobs(space, base) | proposal.knobs
        source = _render(space, knobs, "knobs")
        if isinstance(space, SourceKnobs):
            # The kernel shown with other values in its KNOBS dict, at its own entry point.
            entry, knobs = space.entry, knobs_of(source)
        else:
            entry, knobs = space.entry, space.validate(knobs)
    else:
        if isinstance(proposal, ModuleProposal):
            source, entry = proposal.source, p.entry
        else:
            assert base is not None
            source = apply_edits(base.source, proposal.edits)
            if source == base.source:
                raise ProposalError("the edits leave the kernel unchanged; change something")
            # An edit keeps the kernel's own entry point (the default embedding-bag kernel's is
            # embedding_bag_forward, not the problem's name).
            entry = base.entry
        _check_module(source, entry)
        knobs = knobs_of(source)
    return Candidate(
        problem=problem, source=source, entry=entry, knobs=knobs, origin="llm", parent_id=parent_id
    )
