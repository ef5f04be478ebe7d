"""The GPU-seconds budget (stops the campaign, counts across a resume) and the CLI's progress
display, on campaigns evaluated by the quick in-process backend."""

from __future__ import annotations

import io
import sqlite3
import textwrap
from pathlib import Path

import pytest
from quick_backend import QuickBackend
from rich.console import Console, Group
from typer.testing import CliRunner

import agent.campaign
from agent.campaign import Campaigns
from agent.cli import _CampaignProgress, app
from agent.config import BudgetSpent, ConfigError, parse_config
from agent.state import CampaignProgress, ProblemProgress
from agent.store import device_seconds

# Device seconds of one correct evaluation: check and timing count, the import does not.
PHASES = {"load": 5.0, "check": 0.4, "timing": 0.6}


def _config(tmp_path: Path, **budget):
    return parse_config(
        {
            "name": "gpu",
            "problems": ["embedding_bag"],
            "output_dir": str(tmp_path / "out"),
            "library": str(tmp_path / "library"),
            "proposer": {"batch_size": 1, "seed": 5},
            "budget": {"max_evaluations": 20, "max_wall_s": 600, **budget},
        }
    )


class _Interrupt:
    """Events that stop the campaign the way Ctrl-C does, after `after` evaluations."""

    def __init__(self, after: int) -> None:
        self.after, self.seen = after, 0
        self.progress_reports: list[CampaignProgress] = []

    def evaluated(self, result, best_speedup) -> None:
        self.seen += 1
        if self.seen == self.after:
            raise KeyboardInterrupt

    def progress(self, progress: CampaignProgress) -> None:
        self.progress_reports.append(progress)

    def message(self, text: str) -> None:
        pass


def test_gpu_seconds_budget_stops_the_campaign_and_survives_resume(tmp_path: Path, monkeypatch) -> None:
    backend = QuickBackend(phase_s=PHASES)
    monkeypatch.setattr(agent.campaign, "make_backend", lambda *a, **k: backend)
    events = _Interrupt(after=2)
    with pytest.raises(KeyboardInterrupt):
        Campaigns(tmp_path / "home").start(_config(tmp_path, max_gpu_s=3.5), events)
    # What the loop reported as it went: the budget spent so far, from the store.
    assert [r.spent.gpu_s for r in events.progress_reports] == pytest.approx([0.0, 0.0, 1.0, 1.0])
    campaigns = Campaigns(tmp_path / "home")  # a new process's view: only the store remembers
    [row] = campaigns.store.campaigns()
    assert row.status == "interrupted" and campaigns.store.device_seconds(row.id) == pytest.approx(2.0)

    outcome = campaigns.resume(row.id)

    # 1 s per evaluation: the fourth reaches 3.5 s only with the two before the interrupt counted.
    assert outcome.stop_reason == "GPU-seconds budget reached (4.0 s of 3.5 s)"
    rows = campaigns.store.evaluations(row.id)
    assert len(rows) == 4
    assert campaigns.store.device_seconds(row.id) == pytest.approx(
        sum(device_seconds(r.result) for r in rows)
    )
    budgets = outcome.report.read_text()
    assert "| GPU seconds | 3.5 | 4.0 | 0.0 |" in budgets


def test_budget_reached_names_the_first_budget_used_up() -> None:
    budget = _config(Path("."), max_gpu_s=10, max_llm_tokens=100).budget
    spent = dict(evaluations=1, wall_s=1.0, gpu_s=1.0, llm_tokens=1)
    assert budget.reached(BudgetSpent(**spent)) is None
    assert budget.reached(BudgetSpent(**spent | {"gpu_s": 10.0})).startswith("GPU-seconds budget reached")
    assert budget.reached(BudgetSpent(**spent | {"gpu_s": 10.0, "evaluations": 20})).startswith("evaluation")
    assert budget.reached(BudgetSpent(**spent | {"llm_tokens": 100})).startswith("LLM token budget")
    with pytest.raises(ConfigError, match="budget.max_gpu_s"):
        _config(Path("."), max_gpu_s=0)


def _render(progress: _CampaignProgress) -> str:
    out = Console(file=io.StringIO(), width=160)
    out.print(Group(*progress.get_renderables()))
    return out.file.getvalue()


def test_progress_shows_budgets_left_and_the_best_per_problem() -> None:
    config = parse_config(
        {
            "name": "p",
            "problems": ["embedding_bag", "gdpa"],
            "proposer": {"kinds": ["llm"]},
            "llm": {"base_url": "http://127.0.0.1:9/v1", "model": "m"},
            "budget": {
                "max_evaluations": 40,
                "max_wall_s": 3600,
                "max_gpu_s": 100,
                "max_llm_tokens": 5000,
                "max_llm_cost": 2.0,
            },
        }
    )
    progress = _CampaignProgress(config, console=Console(file=io.StringIO()))
    spent = BudgetSpent(evaluations=10, wall_s=120.0, gpu_s=25.5, llm_tokens=1200, llm_cost=0.5)
    progress.report(
        CampaignProgress(
            spent=spent,
            problems={
                "embedding_bag": ProblemProgress(
                    evaluations=7, best_speedup=1.5, baseline="torch.embedding_bag", interpreted=False
                ),
                "gdpa": ProblemProgress(
                    evaluations=3, best_speedup=None, baseline="torch.padded", interpreted=False
                ),
            },
        )
    )
    text = _render(progress)
    for needed in (
        "10 of 40 (30 left)",
        "25.5 of 100.0 s (74.5 s left)",
        "1200 of 5000 (3800 left)",
        "0.5000 of 2.0000 (1.5000 left)",
        "best 1.50x over torch.embedding_bag",
        "no correct candidate yet",
    ):
        assert needed in text, (needed, text)
    # Wall time runs on between reports (120 s reported, a moment ago).
    assert "120 of 3600 s (3480 s left)" in text or "121 of 3600 s" in text


def test_campaign_run_draws_budget_bars(tmp_path: Path, monkeypatch) -> None:
    backend = QuickBackend(phase_s=PHASES)
    monkeypatch.setattr(agent.campaign, "make_backend", lambda *a, **k: backend)
    toml = tmp_path / "c.toml"
    toml.write_text(
        textwrap.dedent(f"""
        name = "bars"
        problems = ["embedding_bag"]
        output_dir = "{tmp_path / "out"}"
        library = "{tmp_path / "library"}"
        [proposer]
        batch_size = 2
        [budget]
        max_evaluations = 3
        max_wall_s = 600
        max_gpu_s = 50
    """)
    )
    result = CliRunner().invoke(app, ["campaign", "run", str(toml), "--home", str(tmp_path / "home")])
    assert result.exit_code == 0, result.output
    for needed in (
        "evaluations",
        "3 of 3 (0 left)",
        "GPU seconds",
        "3.0 of 50.0 s (47.0 s left)",
        "wall time",
    ):
        assert needed in result.output, (needed, result.output)
    # On the interpreter the progress shows no speed figure, only that timings were interpreted.
    assert "embedding_bag" in result.output and "interpreted timings: no speed figure" in result.output
    assert "report.html" in result.output
    # The best it names is the kernel registered: on the interpreter, the first correct proposal.
    store = Campaigns(tmp_path / "home").store
    [row] = store.campaigns()
    [(_, registered, _, _)] = store.accepted(row.id)
    said = " ".join(result.output.split())  # the console folds long lines
    named = f"best embedding_bag: candidate {registered} (first correct proposal; interpreted timings"
    assert named in said, said


def test_a_campaign_from_the_reference_evaluates_proposals_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(agent.campaign, "make_backend", lambda *a, **k: QuickBackend())
    config = _config(tmp_path, max_evaluations=3).model_copy(
        update={"start_from": "reference", "register_kernels": False}
    )
    outcome = Campaigns(tmp_path / "home").start(config, _Interrupt(after=0))
    rows = Campaigns(tmp_path / "home").store.evaluations(outcome.campaign_id)
    assert len(rows) == 3
    assert {r.candidate.origin for r in rows} == {"template"}, "no incumbent from the library"
    # The default starts with what dispatch runs today.
    outcome = Campaigns(tmp_path / "home2").start(_config(tmp_path, max_evaluations=3), _Interrupt(after=0))
    rows = Campaigns(tmp_path / "home2").store.evaluations(outcome.campaign_id)
    assert rows[0].candidate.origin == "library"


def test_starting_from_the_reference_needs_registration_off(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="register_kernels = false"):
        parse_config(
            {
                "name": "x",
                "problems": ["embedding_bag"],
                "start_from": "reference",
                "budget": {"max_evaluations": 1, "max_wall_s": 60},
            }
        )


def test_resume_after_a_kill_past_the_last_step_finishes_the_bookkeeping(tmp_path: Path, monkeypatch) -> None:
    """SIGKILL after the graph's last step but before the store marked the campaign finished:
    resume completes it instead of refusing a campaign that is 'running' forever."""
    monkeypatch.setattr(agent.campaign, "make_backend", lambda *a, **k: QuickBackend())
    campaigns = Campaigns(tmp_path / "home")
    done = campaigns.start(_config(tmp_path, max_evaluations=2), _Interrupt(after=0))
    campaigns.store.set_status(done.campaign_id, "running")  # the state such a kill leaves

    again = Campaigns(tmp_path / "home").resume(done.campaign_id)

    assert again.status == "finished" and again.stop_reason == done.stop_reason
    assert again.best == done.best
    row = Campaigns(tmp_path / "home").store.campaign(done.campaign_id)
    assert row.status == "finished"
    with pytest.raises(agent.campaign.CampaignError, match="already finished"):
        Campaigns(tmp_path / "home").resume(done.campaign_id)


def test_resume_after_a_kill_before_a_steps_checkpoint_was_saved_goes_on(tmp_path: Path, monkeypatch) -> None:
    """LangGraph saves a step's checkpoint while the next step runs: a kill can leave a step's
    writes saved and no checkpoint after them. Resume goes on from there to the end, instead of
    taking a campaign with nothing `next` for finished."""
    monkeypatch.setattr(agent.campaign, "make_backend", lambda *a, **k: QuickBackend())
    campaigns = Campaigns(tmp_path / "home")
    done = campaigns.start(_config(tmp_path, max_evaluations=2))
    # What such a kill leaves after the last select step (step 7: plan, propose, evaluate and
    # select for each evaluation): its writes, and no checkpoint after them.
    with sqlite3.connect(tmp_path / "home" / "checkpoints.db") as db:
        db.execute("DELETE FROM checkpoints WHERE json_extract(CAST(metadata AS TEXT), '$.step') > 7")
    campaigns.store.set_status(done.campaign_id, "running")

    again = Campaigns(tmp_path / "home").resume(done.campaign_id)

    assert again.stop_reason == done.stop_reason == "evaluation budget reached (2 of 2)"
    assert again.best == done.best
