"""Evaluation: a trusted judge that checks and times each candidate, an untrusted runner that
imports it in a sandbox of its own, the protocol between them, and the backends that run them.

Names below load on first use: the runner imports `sandbox.runner` inside its sandbox, where
neither pydantic nor the problems are needed (nor, for the runner's own modules, mounted)."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Candidate": "sandbox.candidate",
    "source_hash": "sandbox.candidate",
    "LocalBackend": "sandbox.local",
    "EvalResult": "sandbox.result",
    "Status": "sandbox.result",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
