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
