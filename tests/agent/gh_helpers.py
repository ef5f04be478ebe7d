"""A recording `gh` on PATH for the pull-request tests: it logs each call's arguments (NUL after
each, RS after each call); `auth status` answers GH_AUTH (0: logged in); `pr create` prints a URL."""

from __future__ import annotations

import os
from pathlib import Path

GH = """#!/bin/sh
for arg in "$@"; do printf '%s\\0' "$arg"; done >> "$GH_LOG"
printf '\\036' >> "$GH_LOG"
case "$1 $2" in
  "auth status")
    [ "${GH_AUTH:-0}" = 0 ] || echo "You are not logged into any GitHub hosts" >&2
    exit "${GH_AUTH:-0}" ;;
  "pr create") echo "https://github.example/acme/models/pull/7" ;;
esac
"""
PR_URL = "https://github.example/acme/models/pull/7"


def install_gh(tmp_path: Path, monkeypatch) -> Path:
    """Put the recording `gh` first on PATH; returns its log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gh").write_text(GH)
    (bin_dir / "gh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("GH_LOG", str(tmp_path / "gh.log"))
    return tmp_path / "gh.log"


def gh_calls(log: Path) -> list[list[str]]:
    calls = log.read_text().split("\x1e")[:-1] if log.exists() else []
    return [call.split("\0")[:-1] for call in calls]
