"""The headers of the adversarial cases (tests/sandbox/adversarial): `# key: value` lines; and
the switch that runs the cases of open holes (`# hole:`)."""

from __future__ import annotations

import os

import pytest

# A case of an open hole runs only where asked (each a strict xfail until its hole is closed).
open_holes_only = pytest.mark.skipif(
    os.environ.get("RECFORGE_RUN_HOLES") != "1", reason="open holes: RECFORGE_RUN_HOLES=1 runs them"
)


def header(text: str, key: str, default: str | None = None) -> str:
    """The value of a case's `# key:` line; `default` where it has none (an error without one)."""
    line = next((line for line in text.splitlines() if line.startswith(f"# {key}:")), None)
    if line is None and default is not None:
        return default
    assert line is not None, f"no '# {key}:' header"
    return line.split(":", 1)[1].strip()
