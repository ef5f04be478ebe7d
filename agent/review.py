"""Kernel changes for review, in git.

Each kernel a campaign accepts becomes a change `<op>/<dtype>/<candidate>`: a branch
`recforge/kernel/<op>/<dtype>/<buckets>/<candidate>` (the shape buckets it serves) with one commit
on the library branch (`recforge/library`, made from the current HEAD the first time). The commit
adds the kernel's source and its manifest entry to the repository's library folder, a generated
regression test (the problem's check shapes against the reference, on CPU or GPU) and an evidence
file (the evaluation, the timings against eager, torch.compile and the previous best, lineage,
proposer and prompt hash); its message is the change's description.

Everything happens in a temporary worktree: the user's working tree and current branch are never
touched. The state of a change is in git as well: merged into the library branch (approved), or
tagged `recforge/rejected/<id>` with the reason as the tag's message (rejected), else open.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import geometric_mean
from typing import Any

from agent.incumbents import default_candidate
from agent.library_verify import served_us
from agent.population import beats
from kernels.registry import KernelLibrary, LibraryEntry
from sandbox.candidate import Candidate
from sandbox.hardware import bound_by
from sandbox.result import EvalResult, Status, ratio
from search_space.template import source_hash

LIBRARY_BRANCH = "recforge/library"
BRANCH_PREFIX = "recforge/kernel/"
REJECTED_PREFIX = "recforge/rejected/"
LIBRARY_DIR = "kernels/library"  # inside the repository
TESTS_DIR = "tests/library"
EVIDENCE_DIR = f"{LIBRARY_DIR}/evidence"
# The committer when the repository's git has none configured (a fresh CI machine).
IDENTITY = ("-c", "user.name=recforge", "-c", "user.email=recforge@localhost")


class ReviewError(RuntimeError):
    """A change cannot be opened, found, approved or rejected; the message says why."""


@dataclass(frozen=True)
class Change:
    id: str  # <op>/<dtype>/<candidate>: a change holds one accepted kernel for one dtype
    branch: str
    op: str
    dtype: str
    buckets: list[str]
    kernel_id: str
    headline: str
    status: str  # open, approved, rejected
    reason: str | None = None


# --- git ---------------------------------------------------------------------------------------


def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["git", *IDENTITY, *args], cwd=repo, capture_output=True, text=True, timeout=120)
    if check and done.returncode != 0:
        raise ReviewError(
            f"git {' '.join(args)} failed in {repo}: {done.stderr.strip() or done.stdout.strip()}"
        )
    return done


def repository(path: str | os.PathLike) -> Path:
    """The top of the git repository holding `path`."""
    path = Path(path).resolve()
    if not path.exists():
        raise ReviewError(f"{path} does not exist")
    done = _git(path, "rev-parse", "--show-toplevel", check=False)
    if done.returncode != 0:
        raise ReviewError(f"{path} is not inside a git repository: kernel changes need one")
    return Path(done.stdout.strip())


def _has_ref(repo: Path, ref: str) -> bool:
    return _git(repo, "rev-parse", "--verify", "--quiet", ref, check=False).returncode == 0


def _ensure_library_branch(repo: Path) -> None:
    if not _has_ref(repo, f"refs/heads/{LIBRARY_BRANCH}"):
        if not _has_ref(repo, "HEAD"):
            raise ReviewError(f"{repo} has no commit to start the library branch from")
        _git(repo, "branch", LIBRARY_BRANCH, "HEAD")


@contextlib.contextmanager
def _worktree(repo: Path, ref: str) -> Iterator[Path]:
    """A detached worktree of `ref` in a temporary folder, removed afterwards."""
    parent = Path(tempfile.mkdtemp(prefix="recforge-review-"))
    tree = parent / "tree"
    _git(repo, "worktree", "add", "--detach", str(tree), ref)
    try:
        yield tree
    finally:
        _git(repo, "worktree", "remove", "--force", str(tree), check=False)
        shutil.rmtree(parent, ignore_errors=True)


def review_repo(config: Any) -> Path:
    """The repository kernel changes of a campaign (its CampaignConfig) go to: its `[review]
    repo`, else this checkout."""
    return config.review.repo if config.review.repo is not None else Path(__file__).resolve().parents[1]


def campaign_repo(config: Any) -> Path | None:
    """The repository a campaign opens kernel changes in, or None where it opens none: off in
    its `[review]`, or by default on the interpreter."""
    from agent.incumbents import campaign_arch

    enabled = config.review.changes
    if enabled is None:
        enabled = campaign_arch() != "interpreter"
    return review_repo(config) if enabled else None


def bucket_label(buckets: list[str]) -> str:
    """The buckets a change serves, as one branch-name component (`d16+d64`, `d16+d64+3-more`)."""
    shown = [re.sub(r"[^A-Za-z0-9._-]+", "-", b).strip(".-") or "bucket" for b in buckets[:3]]
    more = f"+{len(buckets) - 3}-more" if len(buckets) > 3 else ""
    return ("+".join(shown) or "all") + more


def branch_name(op: str, dtype: str, buckets: list[str], candidate: str) -> str:
    return f"{BRANCH_PREFIX}{op}/{dtype}/{bucket_label(buckets)}/{candidate}"


def _change_id(branch: str) -> str:
    """op/dtype/candidate, from a change's branch (with or without its buckets part: changes
    opened before branches named their buckets have none)."""
    parts = branch.removeprefix(BRANCH_PREFIX).split("/")
    return "/".join(parts[:2] + parts[-1:])


# --- opening a change ---------------------------------------------------------------------------


def open_change(
    repo: str | os.PathLike,
    *,
    entry: LibraryEntry,
    source: str,
    evidence: dict[str, Any],
    description: str,
) -> Change:
    """Commit `entry` (with `source`) as a change on its own branch off the library branch."""
    root = repository(repo)
    _ensure_library_branch(root)
    candidate = str(entry.provenance.get("candidate") or entry.source_hash)
    branch = branch_name(entry.op, entry.dtype, entry.buckets, candidate)
    same = [b for b in _branches(root) if _change_id(b) == f"{entry.op}/{entry.dtype}/{candidate}"]
    if same:
        raise ReviewError(f"a change for candidate {candidate} ({entry.op} {entry.dtype}) exists: {same[0]}")
    with _worktree(root, LIBRARY_BRANCH) as tree:
        _git(tree, "checkout", "-q", "-b", branch)
        library = KernelLibrary(tree / LIBRARY_DIR)
        added = library.add(source=source, **_add_arguments(entry))
        test = tree / TESTS_DIR / f"test_{added.kernel_id}_{added.dtype}.py"
        test.parent.mkdir(parents=True, exist_ok=True)
        test.write_text(regression_test(added))
        record = tree / _evidence_path(entry.op, entry.dtype, candidate)
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"entry": asdict(added), **evidence}, indent=2, default=str) + "\n")
        _git(tree, "add", "--", LIBRARY_DIR, TESTS_DIR)
        _commit(tree, description)
    return next(c for c in list_changes(root) if c.branch == branch)


def gh_ready(repo: str | os.PathLike) -> str | None:
    """None when `gh` can open pull requests for `repo` (installed and authenticated), else why not."""
    gh = shutil.which("gh")
    if gh is None:
        return "gh is not installed"
    done = subprocess.run([gh, "auth", "status"], cwd=repo, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return f"gh is not authenticated ({(done.stderr or done.stdout).strip().splitlines()[-1:] or '?'})"
    return None


def open_pull_request(repo: str | os.PathLike, change: Change, *, remote: str = "origin") -> str:
    """Push the change's branch (and the library branch, its base) to `remote` and open a pull
    request with the change's description through `gh`; returns what gh printed (its URL)."""
    root = repository(repo)
    why = gh_ready(root)
    if why is not None:
        raise ReviewError(f"no pull request for {change.id}: {why}")
    if _git(root, "remote", "get-url", remote, check=False).returncode != 0:
        raise ReviewError(f"no pull request for {change.id}: {root} has no remote {remote!r}")
    _git(root, "push", "-q", remote, LIBRARY_BRANCH, change.branch)
    message = _git(root, "log", "-1", "--format=%B", change.branch).stdout
    title, _, body = message.partition("\n")
    done = subprocess.run(
        [shutil.which("gh") or "gh", "pr", "create", "--base", LIBRARY_BRANCH, "--head", change.branch,
         "--title", title.strip(), "--body", body.strip() + "\n"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        raise ReviewError(f"gh pr create failed for {change.id}: {(done.stderr or done.stdout).strip()}")
    return done.stdout.strip()


def _add_arguments(entry: LibraryEntry) -> dict[str, Any]:
    """The entry's fields that KernelLibrary.add takes (it derives the others: id, file, hash,
    time), to record the same entry in the repository's library."""
    taken = inspect.signature(KernelLibrary.add).parameters
    return {k: v for k, v in asdict(entry).items() if k in taken and k != "source"}


def _commit(tree: Path, message: str) -> None:
    done = subprocess.run(
        ["git", *IDENTITY, "commit", "-q", "-F", "-"], cwd=tree, input=message, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        raise ReviewError(f"git commit failed in {tree}: {done.stderr.strip() or done.stdout.strip()}")


def regression_test(entry: LibraryEntry) -> str:
    """A pytest module checking the entry against its problem's reference at every check shape of
    its dtype, two trials each (the second twice on the same inputs), on the GPU when there is
    one and in the Triton interpreter otherwise."""
    return f'''"""Regression test of library kernel {entry.kernel_id} ({entry.op}, {entry.dtype}; buckets
{", ".join(entry.buckets)}): the problem's check shapes against its reference. Generated when
the kernel was accepted."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

from kernels.registry import KernelLibrary  # noqa: E402
from sandbox.protocol import check_shape  # noqa: E402
from search_space import get_problem  # noqa: E402

KERNEL_ID, DTYPE = {entry.kernel_id!r}, {entry.dtype!r}
LIBRARY = Path(__file__).resolve().parents[2] / {LIBRARY_DIR!r}
PROBLEM = get_problem({entry.op!r})
SHAPES = [s for s in PROBLEM.check_shapes if s.dtype == DTYPE]


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_the_kernel_matches_the_reference(shape) -> None:
    library = KernelLibrary(LIBRARY)
    [entry] = [e for e in library.entries() if e.kernel_id == KERNEL_ID and e.dtype == DTYPE]
    fn = library.load(entry)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for trial in (0, 1):
        result = check_shape(PROBLEM, fn, shape, trial, device, repeat=trial == 0)
        assert result.ok, result.message
'''


# --- reading changes -----------------------------------------------------------------------------


def _branches(repo: Path) -> list[str]:
    out = _git(repo, "for-each-ref", "--format=%(refname:short)", f"refs/heads/{BRANCH_PREFIX}").stdout
    return [line for line in out.splitlines() if line]


def _evidence_path(op: str, dtype: str, candidate: str) -> str:
    return f"{EVIDENCE_DIR}/{op}-{dtype}-{candidate}.json"


def _evidence_of(repo: Path, branch: str) -> dict[str, Any]:
    """The evidence a change's branch holds (found by the branch's name: op, dtype, candidate)."""
    op, dtype, candidate = _change_id(branch).split("/")
    shown = _git(repo, "show", f"{branch}:{_evidence_path(op, dtype, candidate)}", check=False)
    if shown.returncode != 0:
        raise ReviewError(f"branch {branch} holds no evidence file {_evidence_path(op, dtype, candidate)}")
    return json.loads(shown.stdout)


def list_changes(repo: str | os.PathLike) -> list[Change]:
    root = repository(repo)
    changes = []
    for branch in _branches(root):
        record = _evidence_of(root, branch)
        entry = record["entry"]
        change_id = _change_id(branch)
        status, reason = "open", None
        tag = f"refs/tags/{REJECTED_PREFIX}{change_id}"
        if _has_ref(root, tag):
            status = "rejected"
            reason = _git(
                root, "tag", "-l", "--format=%(contents)", f"{REJECTED_PREFIX}{change_id}"
            ).stdout.strip()
        elif _has_ref(root, f"refs/heads/{LIBRARY_BRANCH}") and (
            _git(root, "merge-base", "--is-ancestor", branch, LIBRARY_BRANCH, check=False).returncode == 0
        ):
            status = "approved"
        changes.append(
            Change(
                id=change_id,
                branch=branch,
                op=entry["op"],
                dtype=entry["dtype"],
                buckets=entry["buckets"],
                kernel_id=entry["kernel_id"],
                headline=record.get("headline", ""),
                status=status,
                reason=reason,
            )  # fmt: skip
        )
    return changes


def find(repo: str | os.PathLike, change_id: str) -> Change:
    changes = list_changes(repo)
    # By its whole id, or by a prefix of its candidate id where that names one change.
    exact = [c for c in changes if c.id == change_id]
    matches = exact or [c for c in changes if c.id.rsplit("/", 1)[1].startswith(change_id)]
    if len(matches) != 1:
        known = ", ".join(c.id for c in changes) or "none"
        what = "no change" if not matches else f"{len(matches)} changes"
        raise ReviewError(f"{what} with id {change_id!r}; changes: {known}")
    return matches[0]


def show(repo: str | os.PathLike, change_id: str) -> tuple[Change, str, str, dict[str, Any]]:
    """(change, its commit message and diff, the kernel's source, its evidence)."""
    root = repository(repo)
    change = find(root, change_id)
    patch = _git(root, "show", "--stat", "--patch", change.branch).stdout
    source = _git(root, "show", f"{change.branch}:{LIBRARY_DIR}/{change.kernel_id}.py").stdout
    return change, patch, source, _evidence_of(root, change.branch)


def rejections(repo: str | os.PathLike, op: str) -> list[str]:
    """The reasons reviewers gave for rejecting kernels of `op`, oldest first."""
    return [c.reason or "" for c in list_changes(repo) if c.op == op and c.status == "rejected"]


# --- decisions ---------------------------------------------------------------------------------


def reject(repo: str | os.PathLike, change_id: str, reason: str) -> tuple[Change, Path | None]:
    """Record the rejection of a change with its reason (the next proposals for the op are shown
    it), and take its kernel out of dispatch in the library its campaign registered it into,
    where that library is still there: (the change, that library, or None)."""
    if not reason.strip():
        raise ReviewError("a rejection needs a reason (the next proposals for the op are shown it)")
    root = repository(repo)
    change = find(root, change_id)
    if change.status != "open":
        raise ReviewError(f"change {change.id} is {change.status}, not open")
    _git(root, "tag", "-a", f"{REJECTED_PREFIX}{change.id}", "-m", reason.strip(), change.branch)
    record = _evidence(root, change, _git(root, "rev-parse", change.branch).stdout.strip())
    registered = record.get("library")
    if registered is None or not (Path(registered) / "manifest.json").is_file():
        return find(root, change.id), None
    entry = LibraryEntry(**record["entry"])
    try:
        KernelLibrary(registered).demote(entry, f"rejected in review: {reason.strip()}")
    except ValueError:  # no longer there (replaced since)
        return find(root, change.id), None
    return find(root, change.id), Path(registered)


def _evidence(root: Path, change: Change, tip: str) -> dict:
    """The evidence file of `change` at commit `tip`."""
    path = _evidence_path(change.op, change.dtype, change.id.rsplit("/", 1)[1])
    return json.loads(_git(root, "show", f"{tip}:{path}").stdout)


def reverify(
    source: str, entry: LibraryEntry, evaluate: Callable[[Candidate], EvalResult], arch: str
) -> str | None:
    """Why `entry` (of `source`) does not hold up on this machine of `arch`, or None: it must be
    correct on fresh inputs and, on a GPU, not be slower on the buckets it serves than its op's
    default kernel, timed beside it in the same session, by more than either's noise (the rule
    `library verify` keeps entries by). Its evidence's own times came from another run (another
    draw of inputs, another state of the machine): on an H100 the same kernel read 677, 840 and
    574 us on one bucket in three runs minutes apart, so they are shown, not compared. A GPU of
    another architecture cannot speak for it; the interpreter checks correctness only."""
    if arch != "interpreter" and entry.arch != arch:
        return (
            f"it was accepted for {entry.arch}, and this machine is {arch}: approve it on a {entry.arch} host"
        )
    result = evaluate(Candidate(problem=entry.op, source=source, entry=entry.entry, origin="human"))
    if result.status != Status.OK:
        return f"{result.status.value}: {result.message}"
    if result.interpreted:
        return None
    default = evaluate(default_candidate(entry.op))
    if default.status != Status.OK:
        return (
            f"the default kernel, timed beside it, did not run ({default.status.value}: "
            f"{default.message}): nothing to compare it with on this GPU"
        )[:2000]
    mine, theirs = served_us(result, entry), served_us(default, entry)
    if mine is not None and theirs is not None and beats(theirs, default, mine, result, (entry.dtype,)):
        return (
            f"the default kernel is faster on its buckets on this GPU: {theirs:.1f} us against "
            f"{mine:.1f} us, timed in the same session"
        )
    return None


def approve(
    repo: str | os.PathLike, change_id: str, verify: Callable[[str, LibraryEntry], str | None]
) -> Change:
    """Merge the change into the library branch once `verify(source, entry)` (which re-checks and
    re-times the kernel on this machine's device) returns None; its message otherwise refuses."""
    root = repository(repo)
    change = find(root, change_id)
    if change.status != "open":
        raise ReviewError(f"change {change.id} is {change.status}, not open")
    # The commit verified is the commit merged, whatever the branch does meanwhile.
    tip = _git(root, "rev-parse", change.branch).stdout.strip()
    entry = LibraryEntry(**_evidence(root, change, tip)["entry"])
    source = _git(root, "show", f"{tip}:{LIBRARY_DIR}/{entry.source_file}").stdout
    if source_hash(source) != entry.source_hash:
        raise ReviewError(f"change {change.id}: its kernel's source does not hash to its entry's source_hash")
    why = verify(source, entry)
    if why is not None:
        raise ReviewError(f"change {change.id} failed re-verification: {why}")
    _ensure_library_branch(root)
    listing = _git(root, "worktree", "list", "--porcelain").stdout
    if f"branch refs/heads/{LIBRARY_BRANCH}\n" in listing + "\n":
        raise ReviewError(f"{LIBRARY_BRANCH} is checked out in a worktree; switch it to another branch first")
    with _worktree(root, LIBRARY_BRANCH) as tree:
        merged = _git(tree, "merge", "--no-ff", "--no-commit", tip, check=False)
        if merged.returncode != 0:
            # Two changes off the same library tip both add to the manifest: keep both entries.
            _git(tree, "checkout", "--ours", "--", f"{LIBRARY_DIR}/manifest.json", check=False)
            library = KernelLibrary(tree / LIBRARY_DIR)
            library.add(source=source, **_add_arguments(entry))
            unresolved = _git(tree, "diff", "--name-only", "--diff-filter=U").stdout.split()
            if [f for f in unresolved if f != f"{LIBRARY_DIR}/manifest.json"]:
                raise ReviewError(f"change {change.id} does not merge into {LIBRARY_BRANCH}: {unresolved}")
            _git(tree, "add", "--", f"{LIBRARY_DIR}/manifest.json")
        _commit(
            tree,
            f"Approve kernel change {change.id}: {change.op} {change.dtype} {','.join(change.buckets)}\n",
        )
        head = _git(tree, "rev-parse", "HEAD").stdout.strip()
        base = _git(tree, "rev-parse", "HEAD^1").stdout.strip()
    _git(root, "update-ref", f"refs/heads/{LIBRARY_BRANCH}", head, base)  # fails if it moved meanwhile
    return find(root, change.id)


# --- the description ---------------------------------------------------------------------------


def _what_changed(knobs: dict, previous_knobs: dict | None, rationale: str) -> list[str]:
    """The lines of a change's description that say what it does differently and why."""
    lines = []
    if previous_knobs is not None and knobs:
        moved = [
            f"{k} {previous_knobs.get(k)} -> {v}"
            for k, v in sorted(knobs.items())
            if previous_knobs.get(k) != v
        ]
        lines.append(f"Against the previous best: {', '.join(moved) if moved else 'the same knobs'}.")
    elif previous_knobs is not None:
        lines.append("Against the previous best: new kernel source (no knobs to compare).")
    if rationale.strip():
        lines.append(f"Why it should be faster, as proposed: {rationale.strip()}")
    return lines


def describe(
    *,
    entry: LibraryEntry,
    result: Any,
    previous: Any | None,
    campaign: str,
    lineage: list[str],
    prompt_hash: str | None = None,
    previous_knobs: dict | None = None,
    rationale: str = "",
) -> tuple[str, str]:
    """(headline, commit message) of a change: what the kernel is and what it changes against
    the previous best (its knobs against `previous_knobs`, the proposer's `rationale`), the
    bottleneck before and after (the ceiling that bounds each timing shape, achieved bandwidth
    and roofline fraction) and its numbers per timing shape against the previous best (what
    dispatch ran) and the baselines. `result` and `previous` are the kernel's and the previous
    best's EvalResults."""
    mine = [t for t in result.timings if t.dtype == entry.dtype and t.bucket in entry.buckets]
    before = {(t.shape, t.dtype): t for t in (previous.timings if previous is not None else [])}
    ratios = [
        before[(t.shape, t.dtype)].candidate.median_us / t.candidate.median_us
        for t in mine
        if (t.shape, t.dtype) in before and t.candidate.median_us > 0
    ]
    interpreted = bool(result.interpreted)
    if interpreted:
        headline = "interpreted: correct on every check shape (timings say nothing on a CPU)"
    elif ratios:
        headline = f"{ratio(geometric_mean(ratios))} over the previous best"
    else:
        headline = "no previous best timed"
    knobs = entry.provenance.get("knobs") or {}
    lines = [
        f"kernel: {entry.op} {entry.dtype} {','.join(entry.buckets)}: {headline}",
        "",
        f"Accepted by campaign {campaign}: {entry.kernel_id}, entry `{entry.entry}`, proposed by "
        f"{entry.provenance.get('proposer', '?')}"
        + (f" with knobs {json.dumps(knobs, sort_keys=True)}" if knobs else "")
        + ".",
        f"Lineage: {' <- '.join(lineage) or 'a root'}."
        + (f" Prompt hash {prompt_hash}." if prompt_hash else ""),
        "Serves: "
        + ", ".join(entry.buckets)
        + (
            ""
            if entry.train_buckets is None
            else f" (training steps: {', '.join(entry.train_buckets) or 'none'})"
        )
        + ".",
        *_what_changed(knobs, previous_knobs, rationale),
        "",
    ]
    if mine:
        arch = result.device.arch if result.device else "?"

        def bound(t) -> str | None:
            return bound_by(arch, t.flops, t.bytes)

        lines.append(
            f"Bottleneck, per timing shape (the ceiling that bounds it on {arch}; achieved GB/s and "
            "fraction of the roofline, before -> after):"
        )
        header = (
            "| shape | graph | us | previous us | speedup | eager us | torch.compile us | bound by | GB/s "
            "| roofline |"
        )
        lines += [header, "|" + "---|" * 10]
        for t in mine:
            old = before.get((t.shape, t.dtype))
            eager = next(
                (b for n, b in t.baselines.items() if n not in ("reference", "reference.compile")), None
            )
            compiled = t.baselines.get("reference.compile")
            roof = "" if t.roofline_fraction is None else f"{t.roofline_fraction:.2f}"
            if old is not None and old.roofline_fraction is not None and roof:
                roof = f"{old.roofline_fraction:.2f} -> {roof}"
            gbps = (
                f"{t.achieved_gbps:.0f}"
                if old is None
                else f"{old.achieved_gbps:.0f} -> {t.achieved_gbps:.0f}"
            )
            lines.append(
                f"| {t.shape} | {t.graph} | {t.candidate.median_us:.4g} | "
                f"{'' if old is None else f'{old.candidate.median_us:.4g}'} | "
                f"{'' if old is None else ratio(old.candidate.median_us / t.candidate.median_us)} | "
                f"{'' if eager is None else f'{eager.median_us:.4g}'} | "
                f"{'' if compiled is None else f'{compiled.median_us:.4g}'} | {bound(t) or ''} | "
                f"{gbps} | {roof} |"
            )
        lines.append("")
    checks = [c for c in result.checks if c.trial >= 0]
    lines.append(
        f"Checks: {sum(c.ok for c in checks)} of {len(checks)} passed on fresh inputs"
        f"{' (interpreted)' if interpreted else ''}; device {result.device.name if result.device else '?'}."
    )
    return headline, "\n".join(lines) + "\n"
