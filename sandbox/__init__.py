"""Evaluation: the worker that compiles, checks and times a candidate in an isolated process,
the correctness and timing protocol, and the backends that run workers."""

from sandbox.candidate import Candidate, source_hash
from sandbox.local import LocalBackend
from sandbox.result import EvalResult, Status

__all__ = ["Candidate", "EvalResult", "LocalBackend", "Status", "source_hash"]
