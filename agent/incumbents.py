"""Incumbents: the kernels dispatch runs today, evaluated in the campaign beside the proposals.

A campaign's winner is registered only if it beats them on the same kind of device, in the same
campaign, by more than the timing noise; otherwise the library would take a slower kernel. They
are measured first as the campaign's first candidates, and again on every other kind of device
that measures proposals (a Ray cluster of several GPU models), beside the first proposal that
lands there (sandbox.backend.Alongside).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from agent.store import EvaluationRow, Store
from kernels import ops  # noqa: F401 - registers each op's default kernel with the dispatcher
from kernels.registry import DISPATCHER, KernelLibrary, device_arch
from sandbox.backend import Alongside
from sandbox.candidate import Candidate
from search_space.template import get_template

ORIGIN = "library"


def campaign_arch() -> str:
    """Architecture the local backend's workers run on (the GPU of this host, if any)."""
    return device_arch(torch.device("cuda")) if torch.cuda.is_available() else "interpreter"


def default_candidate(problem: str) -> Candidate:
    """The default kernel of `problem` as a candidate: its template at the default knobs, the
    candidate form of the library's kernels as they launch today (a default kernel's own module
    may be no candidate: the attention ops' wrap the kit's launchers and the backward's, and an
    op's gradients read the statistics the forward saved). A problem without a template: its
    default kernel's module, whole."""
    try:
        template = get_template(problem)
    except ValueError:
        from kernels import ops

        ops.op(problem)  # defined (and known to dispatch) on first use, a gradient op too
        default = DISPATCHER.default(problem)
        source, entry = Path(inspect.getsourcefile(default)).read_text(), default.__name__
    else:
        source, entry = template.render(template.defaults()), template.entry
    return Candidate(problem=problem, source=source, entry=entry, origin=ORIGIN)


def incumbents(problem: str, library: KernelLibrary, arch: str) -> list[Candidate]:
    """The default kernel of `problem` (default_candidate) and every kernel the library
    dispatches for `arch`."""
    default = default_candidate(problem)
    sources = [(default.source, default.entry)]
    sources += [
        ((library.root / e.source_file).read_text(), e.entry)
        for e in library.entries()
        if e.op == problem and e.arch == arch and e.demoted is None and library.refusal(e) is None
    ]
    out: dict[str, Candidate] = {}
    for source, entry in sources:
        c = Candidate(problem=problem, source=source, entry=entry, origin=ORIGIN)
        out.setdefault(c.id, c)
    return list(out.values())


def unmeasured_incumbents(rows) -> str | None:
    """Why a campaign's proposals for a problem have no bar to clear, or None: an incumbent (what
    dispatch runs today) that the campaign could not evaluate. Then nothing is registered for
    the problem: a proposal would replace kernels it was never compared with."""
    failed = [r for r in rows if r.candidate.origin == ORIGIN and r.result.status.value != "ok"]
    if not failed:
        return None
    named = "; ".join(
        f"{r.candidate.entry} {r.candidate.id} {r.result.status.value}: {r.result.message[:200]}"
        for r in failed
    )
    return f"what dispatch runs today could not be evaluated ({named})"


def measurements(
    store: Store, campaign_id: str, problem: str, rows: list[EvaluationRow]
) -> list[EvaluationRow]:
    """Every measurement of the campaign's incumbents of `problem`: their evaluations among `rows`
    (the problem's) and their measurements on other kinds of device."""
    held = [r for r in rows if r.candidate.origin == ORIGIN]
    return held + store.incumbent_evaluations(campaign_id, problem)


def to_measure(problem: str, library: KernelLibrary, measured: list[EvaluationRow]) -> Alongside:
    """The incumbents to measure beside a batch of proposals on each kind of device that has not
    measured them all (`measured`: every measurement of them so far): per architecture, what
    dispatch runs there."""
    arches = sorted({e.arch for e in library.entries() if e.op == problem})
    out = Alongside(
        by_arch={arch: incumbents(problem, library, arch) for arch in arches},
        default=[default_candidate(problem)],
    )
    ids: dict[str, set[str]] = {}
    arch_of: dict[str, str] = {}
    for r in measured:
        if (device := r.result.device) is not None:
            ids.setdefault(device.kind, set()).add(r.candidate.id)
            arch_of[device.kind] = device.arch
    out.held_on = sorted(k for k, got in ids.items() if {c.id for c in out.kernels(arch_of[k])} <= got)
    return out


def on_kind(rows: list[EvaluationRow], kind: str | None) -> list[EvaluationRow]:
    """The rows measured on `kind` of device (DeviceInfo.kind)."""
    return [r for r in rows if r.result.kind == kind]
