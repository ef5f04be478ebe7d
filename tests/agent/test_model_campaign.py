"""Campaigns that plan from the model: the profile chooses the problems and their turns, the
progress and the report say why, and the report measures the model's step with the library at
the start and at the end. Evaluations run on the quick in-process backend; the model's profile
and step are real (the tiny model, interpreted on a CPU)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from quick_backend import QuickBackend

import agent.campaign
from agent import review
from agent.campaign import Campaigns
from agent.config import ConfigError, parse_config
from agent.model_plan import LIBRARY_AT_START, ModelPlan, expected_gains, model_dir, problems_from_profile

GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t"}
GIT_ENV |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def _profile(rows: list[tuple[str, float, float | None]], step_ms: float = 10.0) -> dict:
    return {
        "graph": "train",
        "config": "test",
        "device": "test",
        "steps": 1,
        "step_ms": step_ms,
        "rows": [
            {"op": op, "bucket": "b", "dtype": "bfloat16", "implementations": ["default"], "ms": ms,
             "fraction": fraction,
             "gain_ms": ms * (1 - fraction) if fraction is not None else ms}
            for op, ms, fraction in rows
        ] + [{"op": "torch (rest)", "bucket": "-", "dtype": "-", "implementations": [], "ms": 1.0,
              "fraction": None, "gain_ms": 1.0}],
    }  # fmt: skip


def test_the_plan_chooses_by_gain_left() -> None:
    profile = _profile(
        [("embedding_bag", 4.0, 0.5), ("jagged_attention", 3.0, 0.1), ("target_attention", 1.0, None)]
    )
    gains = expected_gains(profile)
    assert gains["embedding_bag"].gain_ms == pytest.approx(2.0)
    assert gains["jagged_attention"].gain_ms == pytest.approx(2.7)
    assert gains["target_attention"].fraction is None and gains["target_attention"].gain_ms == 1.0
    assert "torch (rest)" not in gains
    plan = ModelPlan(profile, ["embedding_bag", "jagged_attention", "target_attention"])
    problem, reason = plan.choose({}, batch_size=4)
    assert problem == "jagged_attention"
    assert reason.startswith(
        "jagged_attention: 3.000 ms of the 10.000 ms train step (at 10% of its roofline)"
    )
    # Two turns of jagged attention leave it 0.9 ms a turn: embedding_bag's 2.0 goes first.
    assert plan.choose({"jagged_attention": 8}, batch_size=4)[0] == "embedding_bag"
    assert problems_from_profile(profile, searchable_only=False) == [
        "jagged_attention", "embedding_bag", "target_attention"
    ]  # fmt: skip


def test_a_campaign_needs_problems_or_a_model() -> None:
    base = {"name": "x", "budget": {"max_evaluations": 1, "max_wall_s": 10}}
    with pytest.raises(ConfigError, match="name the problems to work on, or a \\[model\\]"):
        parse_config(base)
    with pytest.raises(ConfigError, match="model.config: Value error, no model config at absent.toml"):
        parse_config({**base, "model": {"config": "absent.toml"}})
    with pytest.raises(ConfigError, match="model.graph"):
        parse_config({**base, "model": {"config": "tiny", "graph": "eval"}})
    assert parse_config({**base, "model": {"config": "tiny"}}).problems == []


class _Events:
    def __init__(self) -> None:
        self.plans: list[str] = []
        self.messages: list[str] = []

    def evaluated(self, result, best_speedup) -> None:
        pass

    def progress(self, progress) -> None:
        if progress.plan is not None:
            self.plans.append(progress.plan)

    def message(self, text: str) -> None:
        self.messages.append(text)


@pytest.mark.slow
def test_a_campaign_plans_from_the_model_and_reports_its_step(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(agent.campaign, "make_backend", lambda *a, **k: QuickBackend())
    repo = tmp_path / "repo"
    repo.mkdir()
    for args in (["init", "-q", "-b", "main"], ["commit", "-q", "--allow-empty", "-m", "start"]):
        subprocess.run(["git", *args], cwd=repo, check=True, env=GIT_ENV)
    # The tiny model serving fewer and shorter requests: fourteen interpreted serving steps.
    model = tmp_path / "tiny.toml"
    model.write_text(
        'size = "tiny"\n[data]\nserve_requests = 2\nserve_candidates = 8\n'
        "[history]\nmedian_len = 6\nmax_len = 24\n"
    )
    config = parse_config(
        {
            "name": "model",
            "output_dir": str(tmp_path / "out"),
            "library": str(tmp_path / "library"),
            "review": {"changes": True, "repo": str(repo), "pull_requests": False},
            "model": {
                "config": str(model),
                "graph": "serve",
                "device": "cpu",
                "profile_steps": 1,
                "measure_steps": 1,
            },
            "proposer": {"batch_size": 2, "seed": 1, "kinds": ["search"]},
            "budget": {"max_evaluations": 4, "max_wall_s": 600},
        }
    )
    events = _Events()
    outcome = Campaigns(tmp_path / "home").start(config, events)

    report_dir = tmp_path / "out" / outcome.campaign_id
    profile = json.loads((model_dir(report_dir) / "profile.json").read_text())
    assert profile["graph"] == "serve" and profile["config"] == "tiny"
    stored = Campaigns(tmp_path / "home").store.campaign(outcome.campaign_id)
    problems = json.loads(stored.config_json)["problems"]
    # The serving step's ops that have a knob template, most time first.
    assert set(problems) == {
        "embedding_bags",
        "history_gather",
        "jagged_attention",
        "layer_norm_gate",
        "target_attention",
        "wukong_fm",
    }
    assert problems == problems_from_profile(profile, searchable_only=True)
    assert len(events.plans) == 2 and all("ms of the" in p and "serve step" in p for p in events.plans)
    assert (model_dir(report_dir) / LIBRARY_AT_START).is_dir()
    step = json.loads((model_dir(report_dir) / "step.json").read_text())
    assert set(step["step_ms"]) == {"start", "end"} and step["rounds"] == 1 and step["speedup"] > 0
    assert set(step["implementations"]["start"]) >= {"embedding_bags", "jagged_attention", "target_attention"}
    report = outcome.report.read_text()
    assert "## Model" in report and "with the library as the campaign found it" in report
    assert "not in the problem's timing shapes" in report
    html = outcome.report.with_name("report.html").read_text()
    assert 'id="model-gains"' in html and 'id="model-step"' in html
    # Each kernel change carries the model's step with and without it, in its evidence and message.
    changes = review.list_changes(repo)
    assert changes and len(changes) == len(outcome.registered)
    for change in changes:
        _, message, _, evidence = review.show(repo, change.id)
        step = evidence["model_step"]
        assert set(step["step_ms"]) == {"start", "now"} and step["graph"] == "serve", step
        assert "Model step (tiny serve" in message and "as it is with this kernel" in message
