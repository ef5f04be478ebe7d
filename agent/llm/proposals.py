"""What the model may propose, as typed structured output, and how a proposal becomes a
candidate. Everything here is validated before anything is evaluated; a `ProposalError`'s
message goes back to the model as it is, so it says what was wrong and what to do instead.

The kinds:
- `knobs`: values for the problem's knob template (checked by the template's choices and
  constraint), rendered by the template;
- `fusion`: one of the fused variants a problem module offers in `FUSIONS` (name -> knob
  template), with its knobs;
- `module`: a complete new kernel module;
- `edit`: search/replace blocks over the current kernel (the best one, or in a repair turn the
  one that failed); each search block must occur exactly once.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

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


class FusionProposal(_Proposal):
    kind: Literal["fusion"]
    fusion: str = Field(..., description="name of one of the fused variants offered")
    knobs: dict[str, KnobValue] = Field(default_factory=dict)


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


Proposal = Annotated[
    KnobsProposal | FusionProposal | ModuleProposal | EditProposal, Field(discriminator="kind")
]
PROPOSAL = TypeAdapter(Proposal)
KINDS = ("knobs", "fusion", "module", "edit")


def proposal_schema() -> dict:
    """JSON schema of a reply (sent as response_format where the server takes one)."""
    return PROPOSAL.json_schema()


_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)\n?```", re.DOTALL)


def parse_proposal(text: str) -> Proposal:
    """The proposal in a reply: one JSON object, bare or in a ```json fence, possibly with
    prose around it."""
    fenced = _FENCE.search(text)
    body = fenced.group(1) if fenced else text
    start, end = body.find("{"), body.rfind("}")
    if start < 0:
        raise ProposalError("the reply holds no JSON object; reply with exactly one JSON object")
    try:
        data = json.loads(body[start : end + 1] if end > start else body[start:])
    except json.JSONDecodeError as exc:
        raise ProposalError(
            f"the reply is not valid JSON ({exc.msg}: line {exc.lineno}, column {exc.colno}); "
            "reply with exactly one JSON object, with newlines in strings escaped as \\n"
        ) from None
    try:
        return PROPOSAL.validate_python(data)
    except ValidationError as exc:
        problems = "; ".join(f"{_where(e)}: {e['msg']}" for e in exc.errors())
        raise ProposalError(f"the JSON does not match the proposal schema: {problems}") from None


def _where(error: dict) -> str:
    if error["loc"]:
        return ".".join(str(p) for p in error["loc"])
    # A bad or missing "kind" is reported at the top level by the discriminated union.
    return "kind" if error["type"].startswith("union_tag") else "(top level)"


def fusion_templates(problem: str) -> dict[str, KnobTemplate]:
    """Fused variants a problem offers: `FUSIONS` (name -> knob template) in its module."""
    get_problem(problem)
    try:
        module = importlib.import_module(f"search_space.{problem}")
    except ModuleNotFoundError:  # a problem defined in a module of another name offers none
        return {}
    return dict(getattr(module, "FUSIONS", {}) or {})


def allowed_kinds(problem: str, has_base: bool) -> list[str]:
    """The kinds that make sense for `problem` now: knobs need a template, fusions a fused
    variant, edits a kernel to edit."""
    p = get_problem(problem)
    kinds = []
    if p.template is not None:
        kinds.append("knobs")
    if fusion_templates(problem):
        kinds.append("fusion")
    kinds.append("module")
    if has_base:
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


def _render(template: KnobTemplate, knobs: dict, what: str) -> tuple[str, dict]:
    try:
        full = template.validate(knobs)
    except ValueError as exc:
        raise ProposalError(f"{what}: {exc}") from None
    return template.render(full), full


def to_candidate(
    proposal: Proposal,
    *,
    problem: str,
    base: Candidate | None,
    parent_id: str | None,
    knobs_of: Callable[[str], dict] = lambda source: {},
) -> Candidate:
    """The candidate a proposal describes. `base` is the kernel an edit applies to; `knobs_of`
    reads the knob values a module keeps (recorded with the candidate for the search)."""
    p = get_problem(problem)
    kinds = allowed_kinds(problem, base is not None)
    if proposal.kind not in kinds:
        raise ProposalError(
            f"kind {proposal.kind!r} is not available for this problem now; use one of {kinds}"
        )
    if isinstance(proposal, KnobsProposal):
        from search_space.template import get_template

        template = get_template(problem)
        source, knobs = _render(template, proposal.knobs, "knobs")
        entry = template.entry
    elif isinstance(proposal, FusionProposal):
        fusions = fusion_templates(problem)
        if proposal.fusion not in fusions:
            raise ProposalError(f"unknown fusion {proposal.fusion!r}; offered: {sorted(fusions)}")
        template = fusions[proposal.fusion]
        source, knobs = _render(template, proposal.knobs, f"fusion {proposal.fusion}")
        knobs = {"fusion": proposal.fusion, **knobs}
        entry = template.entry
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
