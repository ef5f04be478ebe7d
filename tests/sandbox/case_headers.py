"""The headers of the adversarial cases (tests/sandbox/adversarial): `# key: value` lines."""

from __future__ import annotations


def header(text: str, key: str, default: str | None = None) -> str:
    """The value of a case's `# key:` line; `default` where it has none (an error without one)."""
    line = next((line for line in text.splitlines() if line.startswith(f"# {key}:")), None)
    if line is None and default is not None:
        return default
    assert line is not None, f"no '# {key}:' header"
    return line.split(":", 1)[1].strip()
