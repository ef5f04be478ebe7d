"""`recforge library verify`: every entry of this machine's architecture checked and timed again
in the sandbox, beside its op's default kernel and the other entries of its key, and demoted
where it fails or is no longer the one to run.

An entry is demoted (kept in the manifest with the reason, out of dispatch) when the sandbox
no longer accepts it, or, on a GPU, when on the buckets it serves the default kernel is faster
than it by more than either's timing noise, or another entry is, on every bucket it serves. The
times of the entries kept are written back, so that dispatch ranks them by today's figures; what
dispatch runs for each (op, dtype, bucket) before and after is reported beside the outcomes. On
the interpreter timings decide nothing: only the checks count. Entries of other architectures are
left alone (listed as such). An entry that dispatch refuses because it was built on another kit
(kernels/kit) is verified with this one, and dispatched again if it passes."""

from __future__ import annotations

from dataclasses import dataclass
from statistics import geometric_mean

from agent.incumbents import default_candidate
from agent.population import beats, serving_us
from kernels.registry import KernelLibrary, LibraryEntry, kit_refusal
from sandbox.backend import Backend
from sandbox.candidate import Candidate
from sandbox.result import EvalResult, Status


@dataclass(frozen=True)
class Verified:
    entry: LibraryEntry
    outcome: str  # kept, demoted, other arch, refused
    detail: str


@dataclass(frozen=True)
class Choice:
    """What dispatch runs for one key (serving calls), by kernel id (None: the default kernel)."""

    op: str
    dtype: str
    bucket: str
    before: str | None
    after: str | None


def served_us(result: EvalResult, entry: LibraryEntry) -> float | None:
    """Geometric mean of `result`'s serving times over the buckets `entry` serves (its dtype)."""
    times = [serving_us(result, entry.dtype, b) for b in entry.buckets]
    times = [t for t in times if t is not None]
    return geometric_mean(times) if times else None


def _choices(library: KernelLibrary, arch: str) -> dict[tuple[str, str, str], str | None]:
    keys = {(e.op, e.dtype, b) for e in library.entries() if e.arch == arch for b in e.buckets}
    return {
        (op, dtype, bucket): getattr(library.best(op, arch, dtype, bucket), "kernel_id", None)
        for op, dtype, bucket in sorted(keys)
    }


def verify_library(
    library: KernelLibrary, backend: Backend, arch: str, trials: int = 2
) -> tuple[list[Verified], list[Choice]]:
    """(each entry's outcome, what dispatch runs per key before and after, where that changed)."""
    before = _choices(library, arch)
    out: list[Verified] = []
    defaults: dict[str, EvalResult] = {}
    timed: list[tuple[LibraryEntry, EvalResult]] = []  # entries kept on a GPU, with their times
    for entry in library.entries():
        if entry.arch != arch:
            out.append(Verified(entry, "other arch", f"registered for {entry.arch}, this machine is {arch}"))
            continue
        if entry.demoted:
            out.append(Verified(entry, "demoted", f"already: {entry.demoted}"))
            continue
        refused = library.refusal(entry)
        new_kit = refused is not None and refused == kit_refusal(entry)
        if refused is not None and not new_kit:  # its source was edited: nothing to verify
            out.append(Verified(entry, "refused", refused))
            continue
        source = (library.root / entry.source_file).read_text()
        candidate = Candidate(problem=entry.op, source=source, entry=entry.entry, origin="library")
        result = backend.evaluate(candidate, timing=True, trials=trials)
        if result.status != Status.OK:
            reason = f"re-verification {result.status.value}: {result.message}"[:500]
            out.append(Verified(library.demote(entry, reason), "demoted", reason))
            continue
        if new_kit:  # correct with this kit: dispatch takes it again, timed below like the rest
            entry = library.rekit(entry)
        if result.interpreted:
            out.append(Verified(entry, "kept", "correct on every check shape (interpreted: not timed)"))
            continue
        if entry.op not in defaults:
            defaults[entry.op] = backend.evaluate(default_candidate(entry.op), timing=True, trials=trials)
        base = defaults[entry.op]
        mine, theirs = served_us(result, entry), served_us(base, entry)
        if mine is not None and theirs is not None and beats(theirs, base, mine, result, (entry.dtype,)):
            reason = f"the default kernel is faster on its buckets ({theirs:.1f} us against {mine:.1f} us)"
            out.append(Verified(library.demote(entry, reason), "demoted", reason))
            continue
        per_bucket = {b: us for b in entry.buckets if (us := serving_us(result, entry.dtype, b)) is not None}
        entry = library.retime(
            entry, mine if mine is not None else entry.median_us, per_bucket or entry.bucket_us
        )
        timed.append((entry, result))
        if mine is None:  # kept as it was: nothing to time it on
            detail = (
                f"correct; not timed: none of {entry.op}'s {entry.dtype} timing shapes falls in its "
                f"buckets ({', '.join(entry.buckets)}), so dispatch may never choose it"
            )
        elif theirs is None:
            why = "" if base.status == Status.OK else f" ({base.status.value}: {base.message})"
            detail = f"{mine:.1f} us; the default kernel was not timed on its buckets{why}"[:500]
        else:
            detail = f"{mine:.1f} us against the default's {theirs:.1f}"
        out.append(Verified(entry, "kept", detail))
    outdone = _outdone(timed)
    out = [
        Verified(library.demote(v.entry, why), "demoted", why)
        if v.outcome == "kept" and (why := outdone.get((v.entry.kernel_id, v.entry.dtype))) is not None
        else v
        for v in out
    ]
    after = _choices(library, arch)
    changed = [
        Choice(*key, before.get(key), after.get(key)) for key in after if before.get(key) != after.get(key)
    ]
    return out, changed


def _outdone(timed: list[tuple[LibraryEntry, EvalResult]]) -> dict[tuple[str, str], str]:
    """The entries (kernel id, dtype) that another entry of their op and dtype beats, beyond the
    noise, on every bucket they serve, with why."""
    out = {}
    for entry, result in timed:
        winners = []
        for bucket in entry.buckets:
            mine = serving_us(result, entry.dtype, bucket)
            better = [
                other
                for other, theirs in timed
                if other is not entry
                and other.op == entry.op
                and other.dtype == entry.dtype
                and bucket in other.buckets
                and mine is not None
                and (us := serving_us(theirs, entry.dtype, bucket)) is not None
                and beats(us, theirs, mine, result, (entry.dtype, bucket))
            ]
            if not better:
                break
            winners.append(better[0].kernel_id)
        else:
            if winners:
                faster = ", ".join(sorted(set(winners)))
                out[(entry.kernel_id, entry.dtype)] = (
                    f"another entry is faster on every bucket it serves ({faster})"
                )
    return out
