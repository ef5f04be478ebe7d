"""Compiled artifacts of evaluated candidates, kept by the candidate's content hash.

A campaign evaluates the same source more than once: the incumbents at every start, the
winner's re-verification in a fresh worker, a suspicious result's re-measurement, the
evaluations redone after a resume. Each worker has its own Triton cache in its scratch
directory; after an evaluation that compiled, the backend keeps a copy of that cache under the
candidate's hash, and the next worker for the same source starts with it, so Triton loads the
binaries instead of compiling again.

The cache was written by the candidate's worker, so it is copied as data: regular files and
directories only (no links, which could point anywhere on the host), within a size bound, and
only ever handed back to a worker for the very same source.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

MAX_ARTIFACT_BYTES = 256 * 1024**2


def _plain_tree_size(root: Path) -> int | None:
    """Total bytes of the regular files under `root`; None if anything else is there."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                return None
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                return None
            total += os.path.getsize(path)
    return total


class ArtifactCache:
    """A directory of `<content hash>/` trees, each a worker's Triton cache after it compiled
    that source. Writes are atomic (copied aside, then renamed into place)."""

    def __init__(self, root: str | os.PathLike, *, max_bytes: int = MAX_ARTIFACT_BYTES) -> None:
        self.root = Path(root).resolve()
        self.max_bytes = max_bytes

    def _path(self, key: str) -> Path:
        if not key.isalnum():
            raise ValueError(f"artifact key must be alphanumeric (a content hash), got {key!r}")
        return self.root / key

    def restore(self, key: str, into: Path) -> bool:
        """Copy the artifacts kept for `key` to `into` (which must not exist); False if none."""
        source = self._path(key)
        if not source.is_dir():
            return False
        shutil.copytree(source, into)
        return True

    def save(self, key: str, source: Path) -> bool:
        """Keep `source` (a worker's cache directory) for `key`, unless it holds anything but
        plain files, is larger than the bound, is empty, or `key` is already kept."""
        target = self._path(key)
        if target.exists() or not source.is_dir():
            return False
        size = _plain_tree_size(source)
        if size is None or size == 0 or size > self.max_bytes:
            return False
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=self.root))
        try:
            shutil.copytree(source, staging / "tree", symlinks=True)
            try:
                (staging / "tree").rename(target)
            except OSError:  # another worker kept the same source first
                return False
            return True
        finally:
            shutil.rmtree(staging, ignore_errors=True)
