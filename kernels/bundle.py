"""Kernel bundles: a library's accepted kernels in one versioned file that a training job installs.

A bundle is a gzip'd tar holding

    bundle.json     format and version, when and from what it was made, every other file's
                    sha256 and size, and the entries it carries
    manifest.json   the library manifest's entries (with their evidence and provenance)
    kernels/*.py    each entry's source, byte for byte (its content hash names it)
    evidence/...    the library's evidence files, where it has them (kernel changes write them)

`install` checks everything before it writes anything: the format version, that the tar holds
exactly the files bundle.json lists (plain files under safe names, nothing else), each file's
checksum, that the manifest parses and each source hashes to its entry's source_hash. Then it
merges the entries into the target library (the installed package's own by default, which
dispatch reads when RECFORGE_LIBRARY is unset): an entry of the same kernel, architecture and
dtype is replaced, every other entry stays. This module needs only the standard library and
what `kernels` needs (torch): `python -m kernels.bundle install BUNDLE` works in an environment
holding only `recforge[worker]`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import io
import json
import os
import sys
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from kernels.registry import MANIFEST, PACKAGE_LIBRARY, KernelLibrary, LibraryEntry, _atomic_write
from search_space.template import source_hash

FORMAT = "recforge-kernel-bundle"
FORMAT_VERSION = 1
INDEX = "bundle.json"
SOURCES = "kernels"
EVIDENCE = "evidence"
MAX_FILE_BYTES = 64 << 20  # a kernel source or evidence file; anything larger is not a bundle's


class BundleError(ValueError):
    """A bundle cannot be made or installed; the message names the file and the problem."""


@dataclass(frozen=True)
class Installed:
    library: Path
    added: list[str]  # "<kernel_id> <arch> <dtype>" of each entry the bundle brought
    replaced: list[str]  # those among them that replaced an entry of the same key
    kept: int  # entries of the library that the bundle did not touch


def _key(e: LibraryEntry) -> tuple[str, str, str]:
    return (e.kernel_id, e.arch, e.dtype)


def _label(e: LibraryEntry) -> str:
    return f"{e.kernel_id} {e.arch} {e.dtype}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("recforge")
    except Exception:  # not installed as a distribution (a checkout on sys.path)
        return "unknown"


# --- export -------------------------------------------------------------------------------------


def export(library: str | os.PathLike, path: str | os.PathLike, *, include_demoted: bool = False) -> dict:
    """Write the bundle of `library` to `path` (a .tar.gz); returns its index (bundle.json).
    Demoted entries stay behind unless asked for; an entry whose source does not hash to what
    was verified stops the export (a bundle carries only verified text)."""
    lib = KernelLibrary(library)
    entries = [e for e in lib.entries() if include_demoted or e.demoted is None]
    if not entries:
        raise BundleError(f"kernel library {lib.root} has no entries to export")
    files: dict[str, bytes] = {}
    for e in entries:
        try:
            text = (lib.root / e.source_file).read_text()
        except OSError as exc:
            where = lib.root / e.source_file
            raise BundleError(f"{e.kernel_id}: its source {where} cannot be read: {exc}") from None
        if source_hash(text) != e.source_hash:
            raise BundleError(
                f"{e.kernel_id}: its source {lib.root / e.source_file} hashes to {source_hash(text)}, "
                f"not {e.source_hash} as verified: edited since; run `recforge library verify`"
            )
        files[f"{SOURCES}/{e.source_file}"] = text.encode()
    evidence_dir = lib.root / EVIDENCE
    if evidence_dir.is_dir():
        for p in sorted(evidence_dir.rglob("*")):
            if p.is_file() and not p.is_symlink():
                files[f"{EVIDENCE}/{p.relative_to(evidence_dir).as_posix()}"] = p.read_bytes()
    files[MANIFEST] = (
        json.dumps({"version": 1, "kernels": [asdict(e) for e in entries]}, indent=2) + "\n"
    ).encode()
    index = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "recforge": _version(),
        "source_library": str(lib.root.resolve()),
        "entries": [
            {"kernel_id": e.kernel_id, "op": e.op, "arch": e.arch, "dtype": e.dtype, "buckets": e.buckets}
            for e in entries
        ],
        "files": {
            name: {"sha256": _sha256(data), "bytes": len(data)} for name, data in sorted(files.items())
        },
    }
    files[INDEX] = (json.dumps(index, indent=2) + "\n").encode()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for name in [INDEX, *sorted(n for n in files if n != INDEX)]:
            info = tarfile.TarInfo(name)
            info.size = len(files[name])
            info.mode = 0o644
            info.mtime = int(dt.datetime.now(dt.UTC).timestamp())
            tar.addfile(info, io.BytesIO(files[name]))
    os.replace(tmp, out)
    return index


# --- reading and checking -----------------------------------------------------------------------


def _safe_name(name: str) -> bool:
    p = PurePosixPath(name)
    return (
        bool(name)
        and not p.is_absolute()
        and ".." not in p.parts
        and "\\" not in name
        and p.as_posix() == name
    )


def read(path: str | os.PathLike) -> tuple[dict, list[LibraryEntry], dict[str, bytes]]:
    """The bundle at `path`, checked: its index, entries and files (name -> bytes).
    BundleError names the first problem found."""
    path = Path(path)
    if not path.is_file():
        raise BundleError(f"bundle {path} does not exist or is not a file")
    try:
        tar = tarfile.open(path, "r:*")  # noqa: SIM115  (closed by the with below)
    except (tarfile.TarError, OSError) as exc:
        raise BundleError(f"{path} is not a kernel bundle (not a readable tar file: {exc})") from None
    files: dict[str, bytes] = {}
    with tar:
        try:
            members = tar.getmembers()
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise BundleError(f"{path}: the tar file is damaged: {exc}") from None
        for m in members:
            if not _safe_name(m.name):
                raise BundleError(f"{path}: member {m.name!r} is not a safe relative path")
            if not m.isfile():
                raise BundleError(
                    f"{path}: member {m.name!r} is not a plain file (links and devices refused)"
                )
            if m.size > MAX_FILE_BYTES:
                raise BundleError(f"{path}: member {m.name!r} is {m.size} bytes, over {MAX_FILE_BYTES}")
            if m.name in files:
                raise BundleError(f"{path}: member {m.name!r} appears twice")
            handle = tar.extractfile(m)
            assert handle is not None  # a plain file
            files[m.name] = handle.read()
    if INDEX not in files:
        raise BundleError(f"{path} is not a kernel bundle: it has no {INDEX}")
    try:
        index = json.loads(files.pop(INDEX))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path}: {INDEX} is not JSON: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise BundleError(f"{path}: {INDEX} does not describe a {FORMAT}")
    version = index.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise BundleError(f"{path}: {INDEX} has no valid format_version ({version!r})")
    if version > FORMAT_VERSION:
        raise BundleError(
            f"{path}: format version {version} is newer than this recforge reads ({FORMAT_VERSION}); "
            "upgrade recforge to install it"
        )
    listed = index.get("files")
    if not isinstance(listed, dict):
        raise BundleError(f"{path}: {INDEX} lists no files")
    if set(listed) != set(files):
        extra, missing = sorted(set(files) - set(listed)), sorted(set(listed) - set(files))
        raise BundleError(f"{path}: its files do not match {INDEX}: unlisted {extra}, missing {missing}")
    for name, data in sorted(files.items()):
        want = listed[name].get("sha256") if isinstance(listed[name], dict) else None
        if _sha256(data) != want:
            raise BundleError(f"{path}: {name} fails its checksum (sha256 {_sha256(data)}, listed {want})")
    if MANIFEST not in files:
        raise BundleError(f"{path}: the bundle has no {MANIFEST}")
    try:
        entries = [LibraryEntry(**e) for e in json.loads(files[MANIFEST])["kernels"]]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise BundleError(f"{path}: its {MANIFEST} is not a library manifest: {exc}") from None
    for e in entries:
        name = f"{SOURCES}/{e.source_file}"
        if not _safe_name(e.source_file) or "/" in e.source_file or name not in files:
            raise BundleError(f"{path}: entry {e.kernel_id}'s source {e.source_file!r} is not in the bundle")
        try:
            got = source_hash(files[name].decode())
        except UnicodeDecodeError:
            raise BundleError(f"{path}: {name} is not text") from None
        if got != e.source_hash:
            raise BundleError(f"{path}: {name} hashes to {got}, not {e.source_hash} as its entry records")
    return index, entries, files


# --- install ------------------------------------------------------------------------------------


def install(path: str | os.PathLike, into: str | os.PathLike | None = None) -> Installed:
    """Merge the bundle at `path` into the library `into` (default: the installed package's).
    Nothing is written unless the whole bundle checks out."""
    _, incoming, files = read(path)
    lib = KernelLibrary(into if into is not None else PACKAGE_LIBRARY)
    try:
        current = lib.entries()
    except ValueError as exc:
        raise BundleError(f"cannot install into {lib.root}: {exc}") from None
    new_keys = {_key(e) for e in incoming}
    kept = [e for e in current if _key(e) not in new_keys]
    replaced = [_label(e) for e in current if _key(e) in new_keys]
    lib.root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if name.startswith(f"{SOURCES}/"):
            _atomic_write(lib.root / name.removeprefix(f"{SOURCES}/"), data)
        elif name.startswith(f"{EVIDENCE}/"):
            target = lib.root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(target, data)
    # The manifest last: until it is replaced, dispatch sees the library as it was.
    manifest = {
        "version": 1,
        "kernels": [asdict(e) for e in kept + incoming],
    }
    _atomic_write(lib.manifest_path, json.dumps(manifest, indent=2) + "\n")
    return Installed(lib.root, [_label(e) for e in incoming], replaced, len(kept))


def describe(index: dict[str, Any]) -> str:
    lines = [
        f"{FORMAT} v{index['format_version']}, made {index.get('created', '?')} by recforge "
        f"{index.get('recforge', '?')} from {index.get('source_library', '?')}"
    ]
    for e in index.get("entries", []):
        lines.append(f"  {e['kernel_id']}  {e['op']} {e['dtype']} {e['arch']}  {','.join(e['buckets'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernels.bundle", description="Install or inspect a recforge kernel bundle."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_install = sub.add_parser("install", help="check a bundle and merge it into a kernel library")
    p_install.add_argument("bundle", type=Path)
    p_install.add_argument(
        "--into", type=Path, default=None, help=f"library folder (default: {PACKAGE_LIBRARY})"
    )
    p_show = sub.add_parser("show", help="check a bundle and list what it carries")
    p_show.add_argument("bundle", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "show":
            print(describe(read(args.bundle)[0]))
            return 0
        done = install(args.bundle, args.into)
    except BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"installed {len(done.added)} kernels into {done.library} "
        f"({len(done.replaced)} replaced, {done.kept} kept)"
    )
    for label in done.added:
        print(f"  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
