"""Kernel changes for review, in a real git repository: a change is a branch with one commit (the
kernel, its manifest entry, a generated regression test that runs, its evidence), opened without
touching the user's working tree or branch; list, show, reject (recorded, with the reason) and
approve (re-verified, then merged into the library branch, two changes off one tip included)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gh_helpers import PR_URL, gh_calls, install_gh
from typer.testing import CliRunner

from agent import review
from agent.cli import app
from agent.incumbents import default_candidate
from kernels.registry import LibraryEntry
from sandbox.result import DeviceInfo, EvalResult, ShapeTiming, Status, TimingStats
from search_space.embedding_bag import TEMPLATE

REPO = Path(__file__).resolve().parents[2]
GPU = DeviceInfo(name="H200", arch="sm_90", torch="t", triton="t", python="p", interpreted=False)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *review.IDENTITY, *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A user's checkout: one commit on main, and an uncommitted edit in the working tree."""
    root = tmp_path / "checkout"
    root.mkdir()
    _git(root, "init", "-q", "-b", "main")
    (root / "README.md").write_text("project\n")
    _git(root, "add", "README.md")
    _git(root, "commit", "-q", "-m", "start")
    (root / "README.md").write_text("project, being edited\n")
    return root


def _timing(us: float, shape: str = "b64k-d64") -> ShapeTiming:
    stats = TimingStats(median_us=us, p20_us=us, p80_us=us, reps=20)
    return ShapeTiming(
        shape=shape,
        dtype="fp32",
        bucket="d64-long",
        candidate=stats,
        baselines={"torch.embedding_bag": TimingStats(median_us=200.0, p20_us=200.0, p80_us=200.0, reps=20)},
        flops=1e6,
        bytes=1e9,
        achieved_gbps=1e9 / (us * 1e-6) / 1e9,
        roofline_fraction=0.1,
    )


def _entry(block_l: int) -> tuple[LibraryEntry, str]:
    source = TEMPLATE.render({"BLOCK_L": block_l})
    entry = LibraryEntry(
        kernel_id="",
        op="embedding_bag",
        entry=TEMPLATE.entry,
        source_file="",
        source_hash="",
        arch="sm_90",
        dtype="fp32",
        buckets=["d64-long"],
        median_us=50.0,
        interpreted=False,
        provenance={"candidate": f"cand{block_l}", "proposer": "template", "knobs": {"BLOCK_L": block_l}},
    )
    return entry, source


def _open(repo: Path, block_l: int) -> review.Change:
    entry, source = _entry(block_l)
    result = EvalResult(
        status=Status.OK,
        problem="embedding_bag",
        candidate_id=f"cand{block_l}",
        timings=[_timing(50.0)],
        device=GPU,
    )
    previous = EvalResult(
        status=Status.OK, problem="embedding_bag", candidate_id="held", timings=[_timing(100.0)], device=GPU
    )
    headline, message = review.describe(
        entry=entry, result=result, previous=previous, campaign="c1", lineage=[f"cand{block_l}", "held"]
    )
    return review.open_change(
        repo,
        entry=entry,
        source=source,
        description=message,
        evidence={"headline": headline, "evaluation": result.model_dump(mode="json")},
    )


def test_a_change_is_one_commit_on_its_own_branch_and_the_checkout_is_untouched(repo: Path) -> None:
    change = _open(repo, 8)
    assert change.status == "open" and change.id == "embedding_bag/fp32/cand8"
    assert (
        change.branch == "recforge/kernel/embedding_bag/fp32/d64-long/cand8"
    )  # op, dtype, buckets, candidate
    assert change.headline == "2.00x over the previous best"
    # The user's branch and working tree are as they were.
    assert _git(repo, "branch", "--show-current").strip() == "main"
    assert (repo / "README.md").read_text() == "project, being edited\n"
    assert _git(repo, "status", "--porcelain").strip() == "M README.md"
    assert _git(repo, "worktree", "list").count("\n") == 1
    files = _git(repo, "show", "--name-only", "--format=", change.branch).split()
    assert sorted(files) == sorted(
        [
            f"kernels/library/{change.kernel_id}.py",
            "kernels/library/manifest.json",
            "kernels/library/evidence/embedding_bag-fp32-cand8.json",
            f"tests/library/test_{change.kernel_id}_fp32.py",
        ]
    )
    message = _git(repo, "log", "-1", "--format=%B", change.branch)
    assert message.startswith("kernel: embedding_bag fp32 d64-long: 2.00x over the previous best")
    assert "| b64k-d64 | serve | 50 | 100 | 2.00x | 200 |" in message and '{"BLOCK_L": 8}' in message
    with pytest.raises(review.ReviewError, match="exists"):
        _open(repo, 8)


def test_branch_names_carry_the_buckets_a_change_serves() -> None:
    assert review.branch_name("op", "bf16", ["d16", "d64"], "c1") == "recforge/kernel/op/bf16/d16+d64/c1"
    label = review.bucket_label(["a/b", "n<=64", "x", "y", "z"])
    assert label == "a-b+n-64+x+2-more"
    for bad in ("..", "/", "@{", " "):
        assert bad not in label
    assert review.bucket_label([]) == "all"


@pytest.fixture
def gh(tmp_path: Path, monkeypatch) -> Path:
    return install_gh(tmp_path, monkeypatch)


def test_a_change_becomes_a_pull_request_where_gh_is_logged_in(repo: Path, tmp_path: Path, gh: Path) -> None:
    remote = tmp_path / "remote.git"
    _git(tmp_path, "init", "-q", "--bare", str(remote))
    change = _open(repo, 8)
    with pytest.raises(review.ReviewError, match="no remote 'origin'"):
        review.open_pull_request(repo, change)
    _git(repo, "remote", "add", "origin", str(remote))

    assert review.open_pull_request(repo, change) == PR_URL
    # Both branches are on the remote, as committed; the pull request carries the description.
    for branch in (change.branch, review.LIBRARY_BRANCH):
        assert _git(remote, "rev-parse", branch) == _git(repo, "rev-parse", branch)
    message = _git(repo, "log", "-1", "--format=%B", change.branch)
    title, _, body = message.partition("\n")
    create = gh_calls(gh)[-1]
    assert create == [
        "pr", "create", "--base", review.LIBRARY_BRANCH, "--head", change.branch,
        "--title", title, "--body", body.strip() + "\n",
    ]  # fmt: skip
    assert "| b64k-d64 | serve | 50 | 100 | 2.00x | 200 |" in create[-1]


def test_without_a_logged_in_gh_there_is_no_pull_request(
    repo: Path, tmp_path: Path, gh: Path, monkeypatch
) -> None:
    _git(tmp_path, "init", "-q", "--bare", str(tmp_path / "remote.git"))
    _git(repo, "remote", "add", "origin", str(tmp_path / "remote.git"))
    change = _open(repo, 8)
    monkeypatch.setenv("GH_AUTH", "1")
    assert "not authenticated" in review.gh_ready(repo) and "not logged into" in review.gh_ready(repo)
    with pytest.raises(review.ReviewError, match="not authenticated"):
        review.open_pull_request(repo, change)
    assert all(call[:2] == ["auth", "status"] for call in gh_calls(gh))
    assert _git(tmp_path / "remote.git", "branch", "--list").strip() == ""  # nothing pushed
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert review.gh_ready(repo) == "gh is not installed"


@pytest.mark.slow
def test_the_generated_regression_test_runs_and_fails_on_a_tampered_kernel(
    repo: Path, tmp_path: Path
) -> None:
    change = _open(repo, 8)
    tree = tmp_path / "tree"
    _git(repo, "worktree", "add", "-q", "--detach", str(tree), change.branch)
    test = tree / "tests" / "library" / f"test_{change.kernel_id}_fp32.py"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-k",
                "dim-48 or weighted",
                str(test),
            ],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    done = run()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
    kernel = tree / "kernels" / "library" / f"{change.kernel_id}.py"
    kernel.write_text(kernel.read_text().replace("return out\n", "return out * 1.01\n"))
    done = run()
    assert done.returncode != 0 and "failed" in done.stdout


def test_list_show_reject_and_the_reason_is_kept(repo: Path) -> None:
    change = _open(repo, 8)
    [listed] = review.list_changes(repo)
    assert listed == change
    shown, patch, source, evidence = review.show(repo, "cand")
    assert shown == change and "manifest.json" in patch and source == TEMPLATE.render({"BLOCK_L": 8})
    assert evidence["entry"]["kernel_id"] == change.kernel_id
    with pytest.raises(review.ReviewError, match="needs a reason"):
        review.reject(repo, change.id, " ")
    rejected, library = review.reject(repo, change.id, "slower on the long-bag shapes we care about")
    assert library is None  # the change names no library its campaign registered it into
    assert rejected.status == "rejected" and rejected.reason == "slower on the long-bag shapes we care about"
    assert review.rejections(repo, "embedding_bag") == ["slower on the long-bag shapes we care about"]
    with pytest.raises(review.ReviewError, match="is rejected, not open"):
        review.approve(repo, change.id, lambda source, entry: None)
    with pytest.raises(review.ReviewError, match="no change with id 'nope'"):
        review.find(repo, "nope")


def test_approve_reverifies_then_merges_two_changes_off_one_tip(repo: Path) -> None:
    first, second = _open(repo, 8), _open(repo, 16)
    seen = []

    def verify(source: str, entry: LibraryEntry) -> str | None:
        seen.append(entry.provenance["candidate"])
        return "wrong on dim-48" if entry.provenance["candidate"] == "cand16" and len(seen) == 2 else None

    assert review.approve(repo, first.id, verify).status == "approved"
    with pytest.raises(review.ReviewError, match="failed re-verification: wrong on dim-48"):
        review.approve(repo, second.id, verify)
    assert review.find(repo, second.id).status == "open"
    assert review.approve(repo, second.id, verify).status == "approved"  # verified again: fine now
    manifest = _git(repo, "show", f"{review.LIBRARY_BRANCH}:kernels/library/manifest.json")
    assert first.kernel_id in manifest and second.kernel_id in manifest
    assert _git(repo, "branch", "--show-current").strip() == "main"


def test_the_review_commands(repo: Path) -> None:
    runner = CliRunner()
    change = _open(repo, 8)
    listed = runner.invoke(app, ["review", "list", "--repo", str(repo)], env={"COLUMNS": "80"})
    assert listed.exit_code == 0, listed.output
    assert "cand8" in listed.output and "2.00x" in listed.output
    shown = runner.invoke(app, ["review", "show", change.id, "--repo", str(repo)])
    assert shown.exit_code == 0 and "def embedding_bag_forward" in shown.output
    assert "evidence: 2.00x over the previous best" in shown.output
    timing_row = next(line for line in shown.output.splitlines() if "b64k-d64" in line and "d64-long" in line)
    assert "50.0" in timing_row and "200.0" in timing_row  # the kernel, and torch.embedding_bag
    done = runner.invoke(app, ["review", "reject", change.id, "--repo", str(repo), "--reason", "no"])
    assert done.exit_code == 0 and "rejected" in done.output
    missing = runner.invoke(app, ["review", "show", "zzz", "--repo", str(repo)])
    assert missing.exit_code == 1 and "no change with id 'zzz'" in missing.output


@pytest.mark.slow
def test_approve_through_the_cli_re_verifies_in_the_sandbox(repo: Path) -> None:
    """The command's re-verification is a real sandbox evaluation on this machine's device: a
    correct kernel merges; one edited on its branch after it was accepted is refused."""
    runner = CliRunner()
    good, bad = _open(repo, 8), _open(repo, 16)
    tree = repo.parent / "edit"
    _git(repo, "worktree", "add", "-q", str(tree), bad.branch)
    kernel = tree / "kernels" / "library" / f"{bad.kernel_id}.py"
    kernel.write_text(kernel.read_text().replace("    return out\n", "    return out * 2\n"))
    _git(tree, "commit", "-q", "-am", "tamper")
    _git(repo, "worktree", "remove", "--force", str(tree))
    done = runner.invoke(app, ["review", "approve", good.id, "--repo", str(repo)])
    assert done.exit_code == 0, done.output
    assert review.find(repo, good.id).status == "approved"
    done = runner.invoke(app, ["review", "approve", bad.id, "--repo", str(repo)])
    # Its source no longer is what the evidence recorded: refused before any evaluation.
    assert done.exit_code == 1 and "does not hash to its entry's source_hash" in done.output, done.output
    assert review.find(repo, bad.id).status == "open"


def _evaluated(us: float, device: DeviceInfo = GPU) -> EvalResult:
    return EvalResult(
        status=Status.OK, problem="embedding_bag", candidate_id="x", timings=[_timing(us)], device=device
    )


@pytest.mark.parametrize(
    ("arch", "recheck_us", "refusal"),
    [
        # Slower than its evidence's 50 us (another run), still faster than the default beside it.
        ("sm_90", 58.0, None),
        ("sm_90", 80.0, "the default kernel is faster on its buckets on this GPU: 60.0 us against 80.0 us"),
        ("sm_100", 50.0, "accepted for sm_90, and this machine is sm_100"),  # another GPU says nothing
        ("sm_90", None, "the default kernel, timed beside it, did not run (runtime_error: crashed)"),
        ("interpreter", 5000.0, None),  # correctness only: interpreted timings decide nothing
    ],
)
def test_approval_times_the_kernel_beside_the_default_on_a_gpu_of_the_entrys_architecture(
    arch: str, recheck_us: float | None, refusal: str | None
) -> None:
    entry, source = _entry(8)
    entry = dataclasses.replace(entry, evidence={"evaluation": _evaluated(50.0).model_dump(mode="json")})
    device = GPU if arch != "interpreter" else GPU.model_copy(update={"arch": arch, "interpreted": True})
    evaluated = []

    def evaluate(candidate):
        evaluated.append(candidate)
        if candidate.source == source:
            return _evaluated(50.0 if recheck_us is None else recheck_us, device)
        if recheck_us is None:  # the default crashes on this GPU
            return EvalResult(
                status=Status.RUNTIME_ERROR, problem="embedding_bag", candidate_id="d", message="crashed"
            )
        return _evaluated(60.0, device)

    why = review.reverify(source, entry, evaluate, arch)
    assert why == refusal if refusal is None else refusal in why, why
    default = default_candidate("embedding_bag").source
    expected = {"sm_100": [], "interpreter": [source]}.get(arch, [source, default])
    assert [c.source for c in evaluated] == expected
