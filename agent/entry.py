"""The `recforge` command's entry point: the command line, or, where only the worker is
installed (`pip install 'recforge[worker]'`), one line saying what to install."""

from __future__ import annotations

import importlib.util
import sys

# The import name of each of the agent's dependencies that the command line needs to start.
AGENT_MODULES = ("typer", "rich", "jinja2", "pydantic", "optuna", "langgraph", "openai", "tenacity")


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a finder that knows it is not there
        return True


def missing() -> list[str]:
    return [name for name in AGENT_MODULES if _absent(name)]


def main() -> None:
    absent = missing()
    if absent:
        sys.exit(
            f"recforge: the agent's dependencies are not installed ({', '.join(absent)} missing); "
            "this install has the sandbox worker and kernels only. For the command line: "
            "pip install 'recforge[agent]'"
        )
    from agent.cli import app

    app(prog_name="recforge")
