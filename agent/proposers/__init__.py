"""Proposers: where candidates come from."""

from agent.proposers.search import SearchProposer

__all__ = ["SearchProposer"]
