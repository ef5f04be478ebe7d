"""What a campaign measures first: the kernels dispatch runs today."""

from __future__ import annotations

from pathlib import Path

import kernels.embedding_bag as embedding_bag_kernels
from agent.incumbents import incumbents
from kernels.registry import KernelLibrary
from sandbox.screen import screen_candidate
from search_space import problem_names
from search_space.template import get_template


def test_every_problems_incumbent_is_a_candidate_the_screen_admits(tmp_path: Path) -> None:
    """What a campaign measures first must be evaluable, or nothing is ever registered for its
    problem: the attention ops' default functions wrap the kit's launchers and are no candidate,
    so every problem with a template starts from its template at the default knobs."""
    for problem in problem_names():
        (only,) = incumbents(problem, KernelLibrary(tmp_path / "lib"), "interpreter")
        assert screen_candidate(only) is None, (problem, screen_candidate(only).message)
        assert only.origin == "library"


def test_an_incumbent_is_the_default_kernel_as_it_launches_today(tmp_path: Path) -> None:
    """Gradients are dispatched inside an op's backward, whose default reads the forward's saved
    statistics: the library's kernels at their default launch configuration, going from inputs
    to gradients, are what a proposal has to beat. The embedding bag's template is its default
    kernel's own module; a problem without a template starts from its default kernel's module."""
    for problem in ("jagged_attention_grad", "gdpa"):
        template = get_template(problem)
        (only,) = incumbents(problem, KernelLibrary(tmp_path / "lib"), "interpreter")
        assert only.source == template.render(template.defaults()) and only.entry == template.entry
    (bag,) = incumbents("embedding_bag", KernelLibrary(tmp_path / "lib"), "interpreter")
    assert (
        bag.source == Path(embedding_bag_kernels.__file__).read_text()
        and bag.entry == "embedding_bag_forward"
    )
    (backward,) = incumbents("embedding_bag_backward", KernelLibrary(tmp_path / "lib"), "interpreter")
    assert backward.entry == "embedding_bag_backward" and backward.source == bag.source


def test_nothing_is_registered_when_what_dispatch_runs_cannot_be_evaluated(
    tmp_path: Path, monkeypatch
) -> None:
    """A library kernel that dispatch runs today fails in the campaign (here: wrong): proposals
    then have no bar to clear, so none is registered, and the campaign and its report say why."""
    from quick_backend import QuickBackend

    import agent.campaign
    from agent.campaign import Campaigns
    from agent.config import parse_config
    from search_space.embedding_bag import TEMPLATE

    library = KernelLibrary(tmp_path / "library")
    broken = TEMPLATE.render({"BLOCK_L": 8}).replace(
        "        **cfg,\n    )\n    return out\n", "        **cfg,\n    )\n    return out.zero_()\n"
    )
    assert broken != TEMPLATE.render({})
    library.add(
        op="embedding_bag", entry=TEMPLATE.entry, source=broken, arch="interpreter", dtype="fp32",
        buckets=["d64"], median_us=None, interpreted=True, evidence={},
        provenance={"test": "broken incumbent"},
    )  # fmt: skip
    monkeypatch.setattr(agent.campaign, "make_backend", lambda *a, **k: QuickBackend())
    messages: list[str] = []

    class Events:
        def evaluated(self, result, best_speedup) -> None: ...
        def progress(self, progress) -> None: ...
        def message(self, text: str) -> None:
            messages.append(text)

    config = parse_config(
        {
            "name": "bar",
            "problems": ["embedding_bag"],
            "output_dir": str(tmp_path / "out"),
            "library": str(tmp_path / "library"),
            "proposer": {"batch_size": 1, "seed": 5},
            "budget": {"max_evaluations": 4, "max_wall_s": 600},
        }
    )
    outcome = Campaigns(tmp_path / "home").start(config, Events())
    rows = Campaigns(tmp_path / "home").store.evaluations(outcome.campaign_id)
    statuses = [(r.candidate.origin, r.result.status.value, r.result.message[:80]) for r in rows]
    assert ("library", "wrong") in [s[:2] for s in statuses], statuses
    assert any(r.candidate.origin != "library" and r.result.status.value == "ok" for r in rows)
    assert [e.provenance for e in KernelLibrary(tmp_path / "library").entries()] == [
        {"test": "broken incumbent"}
    ]
    assert any("nothing registered: what dispatch runs today could not be evaluated" in m for m in messages)
    assert "embedding_bag: nothing registered." in outcome.report.read_text()
