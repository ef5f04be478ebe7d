"""Kernel bundles: what `export` writes is what `install` merges, and `install` refuses any bundle
that is not exactly what was exported (checksums, source hashes, member names, format version)
before it writes a byte."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.cli import app
from kernels import bundle
from kernels.registry import ARCH_INTERPRETER, KernelLibrary
from search_space.embedding_bag import TEMPLATE

ROOT = Path(__file__).resolve().parents[2]
SOURCE = TEMPLATE.render({"BLOCK_D": 32, "BLOCK_L": 8, "BLOCK_B": 2})
OTHER = TEMPLATE.render({"BLOCK_D": 64, "BLOCK_L": 16, "BLOCK_B": 4})


def _add(lib: KernelLibrary, source: str = SOURCE, *, op: str = "embedding_bag", **fields):
    args = {
        "op": op,
        "entry": "embedding_bag_forward" if op == "embedding_bag" else "embedding_bag_backward",
        "source": source,
        "arch": ARCH_INTERPRETER,
        "dtype": "fp32",
        "buckets": ["d32-long", "d32-short"],
        "median_us": 12.5,
        "interpreted": True,
        "evidence": {"evaluation": {"status": "ok"}},
        "provenance": {"campaign": "c1"},
        **fields,
    }
    return lib.add(**args)


@pytest.fixture
def library(tmp_path: Path) -> KernelLibrary:
    lib = KernelLibrary(tmp_path / "lib")
    _add(lib)
    _add(lib, op="embedding_bag_backward")
    (lib.root / "evidence" / "embedding_bag" / "fp32").mkdir(parents=True)
    (lib.root / "evidence" / "embedding_bag" / "fp32" / "c1.json").write_text('{"speedup": 1.5}\n')
    return lib


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def _write(path: Path, members: dict[str, bytes], extra: list[tarfile.TarInfo] = ()) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info)
    return path


def _relisted(members: dict[str, bytes]) -> dict[str, bytes]:
    """The members with bundle.json's checksums recomputed: a forger's consistent bundle."""
    index = json.loads(members["bundle.json"])
    index["files"] = {
        n: {"sha256": hashlib.sha256(d).hexdigest(), "bytes": len(d)}
        for n, d in members.items()
        if n != "bundle.json"
    }
    return {**members, "bundle.json": json.dumps(index).encode()}


def test_install_brings_every_entry_source_and_evidence_file(library: KernelLibrary, tmp_path: Path) -> None:
    index = bundle.export(library.root, tmp_path / "b.tar.gz")
    assert index["format"] == bundle.FORMAT and index["format_version"] == bundle.FORMAT_VERSION
    assert sorted(e["op"] for e in index["entries"]) == ["embedding_bag", "embedding_bag_backward"]

    done = bundle.install(tmp_path / "b.tar.gz", tmp_path / "job")
    installed = KernelLibrary(tmp_path / "job")
    assert [e.kernel_id for e in installed.entries()] == [e.kernel_id for e in library.entries()]
    assert installed.entries() == library.entries()
    for e in installed.entries():
        assert (installed.root / e.source_file).read_text() == (library.root / e.source_file).read_text()
        assert installed.refusal(e) is None
        # Dispatch over the installed library chooses the bundle's kernel.
        assert installed.best(e.op, ARCH_INTERPRETER, "fp32", "d32-short") == e
    assert (installed.root / "evidence/embedding_bag/fp32/c1.json").read_text() == '{"speedup": 1.5}\n'
    assert len(done.added) == 2 and done.replaced == [] and done.kept == 0


def test_install_merges_replacing_only_entries_of_the_same_key(
    library: KernelLibrary, tmp_path: Path
) -> None:
    bundle.export(library.root, tmp_path / "b.tar.gz")
    job = KernelLibrary(tmp_path / "job")
    other = _add(job, OTHER)  # another kernel of the same op: stays
    stale = _add(job, median_us=99.0)  # the bundle's forward with older evidence: replaced
    done = bundle.install(tmp_path / "b.tar.gz", job.root)
    by_id = {e.kernel_id: e for e in job.entries()}
    assert set(by_id) == {other.kernel_id, *(e.kernel_id for e in library.entries())}
    assert by_id[stale.kernel_id].median_us == 12.5
    assert done.replaced == [f"{stale.kernel_id} {ARCH_INTERPRETER} fp32"] and done.kept == 1


def test_demoted_entries_stay_behind_unless_asked_for(library: KernelLibrary, tmp_path: Path) -> None:
    forward = next(e for e in library.entries() if e.op == "embedding_bag")
    library.demote(forward, "no longer faster")
    assert [e["op"] for e in bundle.export(library.root, tmp_path / "a.tgz")["entries"]] == [
        "embedding_bag_backward"
    ]
    carried = bundle.export(library.root, tmp_path / "b.tgz", include_demoted=True)
    assert len(carried["entries"]) == 2


def test_export_refuses_a_source_edited_since_it_was_verified(library: KernelLibrary, tmp_path: Path) -> None:
    entry = library.entries()[0]
    with open(library.root / entry.source_file, "a") as f:
        f.write("\n# edited\n")
    with pytest.raises(bundle.BundleError, match=f"{entry.kernel_id}.*edited since"):
        bundle.export(library.root, tmp_path / "b.tgz")
    assert not (tmp_path / "b.tgz").exists()
    with pytest.raises(bundle.BundleError, match="no entries"):
        bundle.export(tmp_path / "empty", tmp_path / "c.tgz")


def _tampered(members: dict[str, bytes], name: str) -> dict[str, bytes]:
    return {**members, name: members[name] + b"\nimport os  # added\n"}


BAD = {
    "a source changed after export": (
        lambda m: _tampered(m, next(n for n in m if n.startswith("kernels/"))),
        "fails its checksum",
    ),
    "a source changed and the checksums recomputed": (
        lambda m: _relisted(_tampered(m, next(n for n in m if n.startswith("kernels/")))),
        "hashes to",
    ),
    "the manifest changed": (lambda m: _tampered(m, "manifest.json"), "manifest.json fails its checksum"),
    "an unlisted file": (
        lambda m: {**m, "kernels/extra.py": b"x = 1\n"},
        "unlisted \\['kernels/extra.py'\\]",
    ),
    "a listed file missing": (
        lambda m: {n: d for n, d in m.items() if not n.startswith("evidence/")},
        "missing \\['evidence/",
    ),
    "a path outside the library": (lambda m: {**m, "../escape.py": b"x = 1\n"}, "not a safe relative path"),
    "an absolute path": (lambda m: {**m, "/tmp/escape.py": b"x = 1\n"}, "not a safe relative path"),
    "no index": (lambda m: {n: d for n, d in m.items() if n != "bundle.json"}, "has no bundle.json"),
    "a newer format": (
        lambda m: {
            **m,
            "bundle.json": m["bundle.json"].replace(b'"format_version": 1', b'"format_version": 9'),
        },
        "format version 9 is newer",
    ),
    "another format": (
        lambda m: {**m, "bundle.json": m["bundle.json"].replace(bundle.FORMAT.encode(), b"zip")},
        "does not describe",
    ),
    "an index that is not JSON": (lambda m: {**m, "bundle.json": b"{"}, "not JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_install_refuses_a_bundle_that_is_not_what_was_exported(
    library: KernelLibrary, tmp_path: Path, case: str
) -> None:
    change, message = BAD[case]
    bundle.export(library.root, tmp_path / "b.tgz")
    bad = _write(tmp_path / "bad.tgz", change(_members(tmp_path / "b.tgz")))
    job = KernelLibrary(tmp_path / "job")
    kept = _add(job, OTHER)
    before = {p.name: p.read_bytes() for p in job.root.iterdir()}
    with pytest.raises(bundle.BundleError, match=message):
        bundle.install(bad, job.root)
    # Nothing written: the library is as it was, and nothing landed beside it.
    assert {p.name: p.read_bytes() for p in job.root.iterdir()} == before
    assert job.entries() == [kept] and not (tmp_path / "escape.py").exists()


def test_install_refuses_links_and_files_that_are_not_tar(library: KernelLibrary, tmp_path: Path) -> None:
    bundle.export(library.root, tmp_path / "b.tgz")
    link = tarfile.TarInfo("kernels/link.py")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    bad = _write(tmp_path / "bad.tgz", _members(tmp_path / "b.tgz"), [link])
    with pytest.raises(bundle.BundleError, match="not a plain file"):
        bundle.install(bad, tmp_path / "job")
    (tmp_path / "junk.tgz").write_bytes(b"not a tar at all")
    with pytest.raises(bundle.BundleError, match="not a kernel bundle"):
        bundle.install(tmp_path / "junk.tgz", tmp_path / "job")
    with pytest.raises(bundle.BundleError, match="does not exist"):
        bundle.install(tmp_path / "absent.tgz", tmp_path / "job")
    assert not (tmp_path / "job").exists()


def test_the_commands_export_and_import(library: KernelLibrary, tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(app, ["library", "export", str(tmp_path / "b.tgz"), "--library", str(library.root)])
    assert done.exit_code == 0, done.output
    assert "wrote" in done.output and library.entries()[0].kernel_id in done.output
    done = runner.invoke(
        app, ["library", "import", str(tmp_path / "b.tgz"), "--library", str(tmp_path / "job")]
    )
    assert done.exit_code == 0, done.output
    assert "installed 2 kernels" in done.output
    assert KernelLibrary(tmp_path / "job").entries() == library.entries()

    (tmp_path / "junk.tgz").write_bytes(b"junk")
    done = runner.invoke(
        app, ["library", "import", str(tmp_path / "junk.tgz"), "--library", str(tmp_path / "j")]
    )
    assert done.exit_code == 2 and "not a kernel bundle" in done.output and "Traceback" not in done.output


@pytest.mark.slow
def test_the_module_installs_and_names_what_is_wrong(library: KernelLibrary, tmp_path: Path) -> None:
    bundle.export(library.root, tmp_path / "b.tgz")
    run = [sys.executable, "-m", "kernels.bundle"]
    done = subprocess.run(
        [*run, "install", str(tmp_path / "b.tgz"), "--into", str(tmp_path / "job")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "installed 2 kernels" in done.stdout
    done = subprocess.run([*run, "show", str(tmp_path / "b.tgz")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and "embedding_bag_backward" in done.stdout
    done = subprocess.run(
        [*run, "install", str(tmp_path / "absent.tgz"), "--into", str(tmp_path / "j")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2 and "does not exist" in done.stderr and "Traceback" not in done.stderr
