"""`pip install 'recforge[worker]'`: the base install, which the sandbox worker and the kernels
need and nothing of the agent's. A worker host evaluates candidates, and calls the public ops,
with every one of the agent's dependencies (and the agent, evals and model packages) absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sandbox import isolation

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The import name of each distribution of the agent extra (a new one must be named here).
IMPORTS = {
    "typer": "typer",
    "rich": "rich",
    "jinja2": None,  # torch's own dependency, so on every worker host anyway
    "matplotlib": "matplotlib",
    "optuna": "optuna",
    "langgraph": "langgraph",
    "langgraph-checkpoint-sqlite": "langgraph",
    "ray": "ray",
    "docker": "docker",
    "openai": "openai",
    "tenacity": "tenacity",
}

# Imported first in the worker's processes (sitecustomize): refuses every module of the agent.
BLOCKER = """
import importlib.abc, sys

BLOCKED = {blocked!r}


class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on a worker host)", name=name)
        return None


sys.meta_path.insert(0, _Absent())
"""

WORKER = """
import json, torch
from sandbox import Candidate, LocalBackend
from search_space.embedding_bag import TEMPLATE
import kernels.ops as ops

candidate = Candidate(problem="embedding_bag", source=TEMPLATE.render({}), entry=TEMPLATE.entry)
result = LocalBackend(timeout_s=240, isolation=ISOLATION).evaluate(candidate, timing=False)
weight = torch.randn(10, 4)
out = ops.embedding_bag(weight, torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]))
expected = torch.stack([weight[1], weight[2] + weight[3]])
print(json.dumps({"status": result.status.value, "message": result.message,
                  "op": bool(torch.allclose(out, expected))}))
"""


def _without(tmp_path: Path, blocked: list[str]) -> dict[str, str]:
    """The environment of a process in which every module of `blocked` is refused at import."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(blocked=blocked))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


AGENT = sorted({m for m in IMPORTS.values() if m} | {"agent", "evals", "model"})


def _name(requirement: str) -> str:
    for stop in "<>=!~[; ":
        requirement = requirement.split(stop, 1)[0]
    return requirement.lower()


def test_the_base_install_is_the_workers_and_the_agent_is_an_extra() -> None:
    base = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert base == {"torch", "triton", "numpy", "pydantic"}, base
    assert extras["worker"] == [], "the worker is the base install, by name"
    agent = {_name(r) for r in extras["agent"]}
    assert agent <= set(IMPORTS), f"name the import of {agent - set(IMPORTS)} in IMPORTS"
    assert not agent & base


@pytest.mark.slow
def test_a_worker_host_evaluates_and_runs_the_ops_without_the_agent(tmp_path: Path) -> None:
    env = _without(tmp_path, AGENT)
    # Where bubblewrap runs, the runner is sandboxed as on any host; elsewhere a plain process.
    iso = "bwrap" if isolation.bwrap_works() is None else "none"
    done = subprocess.run(
        [sys.executable, "-c", f"ISOLATION = {iso!r}\n" + WORKER],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"status": "ok", "message": report["message"], "op": True}, report


def test_without_the_agent_the_command_says_what_to_install(tmp_path: Path) -> None:
    env = _without(tmp_path, ["typer", "optuna"])
    done = subprocess.run(
        [sys.executable, "-m", "agent", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert "typer, optuna missing" in done.stderr and "pip install 'recforge[agent]'" in done.stderr


@pytest.mark.parametrize("module", ["sandbox.judge", "sandbox.runner", "kernels.ops"])
def test_worker_modules_import_nothing_of_the_agent(tmp_path: Path, module: str) -> None:
    env = _without(tmp_path, AGENT)
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
