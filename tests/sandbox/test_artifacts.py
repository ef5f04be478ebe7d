"""Compiled artifacts are kept by content hash, handed back only for the same source, and
copied as plain data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandbox.artifacts import ArtifactCache
from sandbox.candidate import Candidate
from sandbox.local import LocalBackend, WorkerBackend
from sandbox.result import EvalResult, Status
from search_space.embedding_bag import TEMPLATE


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_save_then_restore_round_trip(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "artifacts")
    source = _tree(tmp_path / "runner", {"ab/kernel.cubin": b"\x7fELF", "ab/kernel.json": b"{}"})
    assert cache.save("abc123", source)
    assert not cache.save("abc123", source), "a kept key is never overwritten"
    assert cache.restore("abc123", tmp_path / "next")
    assert (tmp_path / "next" / "ab" / "kernel.cubin").read_bytes() == b"\x7fELF"
    assert not cache.restore("other", tmp_path / "none")
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("what", ["file link", "dir link", "empty", "too large"])
def test_untrusted_trees_are_not_kept(tmp_path: Path, what: str) -> None:
    cache = ArtifactCache(tmp_path / "artifacts", max_bytes=1000)
    source = tmp_path / "runner"
    source.mkdir()
    if what == "file link":
        _tree(source, {"ok.bin": b"1"})
        os.symlink("/etc/passwd", source / "passwd")
    elif what == "dir link":
        _tree(source, {"ok.bin": b"1"})
        os.symlink("/etc", source / "etc")
    elif what == "too large":
        _tree(source, {"big.bin": b"x" * 1001})
    assert not cache.save("abc", source)
    assert not (tmp_path / "artifacts" / "abc").exists()
    leftovers = list((tmp_path / "artifacts").iterdir()) if (tmp_path / "artifacts").exists() else []
    assert leftovers == [], "no staging directory is left behind"


def test_keys_must_be_content_hashes(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)
    with pytest.raises(ValueError, match="alphanumeric"):
        cache.restore("../escape", tmp_path / "x")


class _RecordingBackend(WorkerBackend):
    """Runs no judge: records whether the runner's scratch directory came with artifacts, and
    compiles (writes a cache file there) with the status it is told to end with."""

    def __init__(self, root: Path, status: Status) -> None:
        self.scratch_root = root / "scratch"
        self.keep_scratch = False
        self.artifacts = ArtifactCache(root / "artifacts")
        self.status = status
        self.saw_artifacts: list[bool] = []

    def _run(self, candidate, scratch, request) -> EvalResult:
        triton = Path(request.runner_dir) / "triton"
        assert Path(request.runner_dir).parent == scratch  # the runner's part of the evaluation's directory
        self.saw_artifacts.append((triton / "k.bin").exists())
        _tree(triton, {"k.bin": b"compiled " + candidate.id.encode()})
        return EvalResult(status=self.status, problem=candidate.problem, candidate_id=candidate.id)


def _candidate(**knobs) -> Candidate:
    settings = {**TEMPLATE.defaults(), **knobs}
    return Candidate(problem="embedding_bag", source=TEMPLATE.render(settings), entry=TEMPLATE.entry)


def test_backend_reuses_artifacts_of_the_same_source_only(tmp_path: Path) -> None:
    backend = _RecordingBackend(tmp_path, Status.OK)
    a, b = _candidate(), _candidate(num_warps=4)
    first = backend.evaluate(a)
    again = backend.evaluate(a)
    other = backend.evaluate(b)
    assert (first.artifacts_reused, again.artifacts_reused, other.artifacts_reused) == (False, True, False)
    assert backend.saw_artifacts == [False, True, False]
    assert (tmp_path / "artifacts" / a.id / "k.bin").read_bytes() == b"compiled " + a.id.encode()


def test_backend_keeps_nothing_from_a_crashed_runner(tmp_path: Path) -> None:
    backend = _RecordingBackend(tmp_path, Status.RUNTIME_ERROR)
    candidate = _candidate()
    backend.evaluate(candidate)
    assert not (tmp_path / "artifacts" / candidate.id).exists()
    assert not backend.evaluate(candidate).artifacts_reused


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_reevaluation_loads_compiled_kernels(tmp_path: Path) -> None:
    backend = LocalBackend(scratch_root=tmp_path / "scratch", artifact_root=tmp_path / "artifacts")
    candidate = _candidate()
    first = backend.evaluate(candidate, timing=False)
    again = backend.evaluate(candidate, timing=False)
    assert first.status == again.status == Status.OK, (first.message, again.message)
    assert not first.artifacts_reused and again.artifacts_reused
    kept = [p for p in (tmp_path / "artifacts" / candidate.id).rglob("*") if p.suffix == ".cubin"]
    assert kept, "the first evaluation's compiled kernels were kept"
