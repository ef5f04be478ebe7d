"""`recforge library verify`: every entry of this machine's architecture checked and timed again
in the sandbox, beside its op's default kernel, and demoted where it fails or is no longer
faster.

An entry is demoted (kept in the manifest with the reason, out of dispatch) when the sandbox
no longer accepts it, or, on a GPU, when on the buckets it serves the default kernel is faster
than it by more than either's timing noise. On the interpreter timings decide nothing: only the
checks count. Entries of other architectures are left alone (listed as such)."""

from __future__ import annotations

from dataclasses import dataclass
from statistics import geometric_mean

from agent.incumbents import default_candidate
from agent.population import beats, serving_us
from kernels.registry import KernelLibrary, LibraryEntry
from sandbox.backend import Backend
from sandbox.candidate import Candidate
from sandbox.result import EvalResult, Status


@dataclass(frozen=True)
class Verified:
    entry: LibraryEntry
    outcome: str  # kept, demoted, other arch, refused
    detail: str


def _served_us(result: EvalResult, entry: LibraryEntry) -> float | None:
    times = [serving_us(result, entry.dtype, b) for b in entry.buckets]
    times = [t for t in times if t is not None]
    return geometric_mean(times) if times else None


def verify_library(library: KernelLibrary, backend: Backend, arch: str, trials: int = 2) -> list[Verified]:
    out: list[Verified] = []
    defaults: dict[str, EvalResult] = {}
    for entry in library.entries():
        if entry.arch != arch:
            out.append(Verified(entry, "other arch", f"registered for {entry.arch}, this machine is {arch}"))
            continue
        if entry.demoted:
            out.append(Verified(entry, "demoted", f"already: {entry.demoted}"))
            continue
        refused = library.refusal(entry)
        if refused is not None:
            out.append(Verified(entry, "refused", refused))
            continue
        source = (library.root / entry.source_file).read_text()
        candidate = Candidate(problem=entry.op, source=source, entry=entry.entry, origin="library")
        result = backend.evaluate(candidate, timing=True, trials=trials)
        if result.status != Status.OK:
            reason = f"re-verification {result.status.value}: {result.message}"[:500]
            out.append(Verified(library.demote(entry, reason), "demoted", reason))
            continue
        if result.interpreted:
            out.append(Verified(entry, "kept", "correct on every check shape (interpreted: not timed)"))
            continue
        if entry.op not in defaults:
            defaults[entry.op] = backend.evaluate(default_candidate(entry.op), timing=True, trials=trials)
        base = defaults[entry.op]
        mine, theirs = _served_us(result, entry), _served_us(base, entry)
        if mine is not None and theirs is not None and beats(theirs, base, mine, result, (entry.dtype,)):
            reason = f"the default kernel is faster on its buckets ({theirs:.1f} us against {mine:.1f} us)"
            out.append(Verified(library.demote(entry, reason), "demoted", reason))
            continue
        detail = (
            "correct"
            if mine is None or theirs is None
            else f"{mine:.1f} us against the default's {theirs:.1f}"
        )
        out.append(Verified(entry, "kept", detail))
    return out
