"""The model package sits on the kernel library alone: it imports torch, kernels and itself (and
the standard library), never the search space, the sandbox or the agent."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import model
import model.config
from search_space import workload

ALLOWED = {"torch", "kernels", "model"}


def test_model_imports_only_torch_and_kernels() -> None:
    found = {}
    for path in sorted(Path(model.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                if root not in ALLOWED and root not in sys.stdlib_module_names:
                    found.setdefault(path.name, set()).add(root)
    assert found == {}


def test_synthetic_lengths_follow_the_workloads_pooling_factors() -> None:
    """The model's own copy of the workload's length law: the same exponent."""
    assert model.config.DataConfig().length_alpha == workload.BAG_LENGTH_ALPHA
