"""What a campaign measures first: the kernels dispatch runs today."""

from __future__ import annotations

from pathlib import Path

from agent.incumbents import incumbents
from kernels.registry import KernelLibrary
from sandbox.screen import screen_candidate
from search_space.template import get_template


def test_an_op_incumbent_is_its_default_kernel(tmp_path: Path) -> None:
    (only,) = incumbents("gdpa", KernelLibrary(tmp_path / "lib"), "interpreter")
    assert only.entry == "gdpa_forward" and "def gdpa_forward(" in only.source


def test_a_gradient_problem_incumbent_is_its_template_at_the_defaults(tmp_path: Path) -> None:
    """Gradients are dispatched inside an op's backward, whose default reads the forward's saved
    statistics: the library's kernels at their default launch configuration, going from inputs
    to gradients, are what a proposal has to beat."""
    template = get_template("jagged_attention_grad")
    (only,) = incumbents("jagged_attention_grad", KernelLibrary(tmp_path / "lib"), "interpreter")
    assert only.source == template.render(template.defaults()) and only.origin == "library"
    assert screen_candidate(only) is None
