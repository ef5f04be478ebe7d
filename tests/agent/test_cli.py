"""The CLI's answers to bad input: one clear sentence and a non-zero exit, never a traceback."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from agent.cli import app
from search_space.embedding_bag import TEMPLATE

runner = CliRunner()


def test_sandbox_eval_missing_file(tmp_path) -> None:
    result = runner.invoke(
        app, ["sandbox", "eval", "--problem", "embedding_bag", "--source", str(tmp_path / "x.py")]
    )
    assert result.exit_code == 2
    assert "does not exist" in result.output and "Traceback" not in result.output


def test_sandbox_eval_unknown_problem(tmp_path) -> None:
    src = tmp_path / "k.py"
    src.write_text("x = 1\n")
    result = runner.invoke(app, ["sandbox", "eval", "--problem", "nope", "--source", str(src)])
    assert result.exit_code == 2
    assert "unknown problem 'nope'" in result.output


def test_sandbox_eval_rejected_source_is_reported_as_json(tmp_path) -> None:
    src = tmp_path / "k.py"
    src.write_text("import os\n" + TEMPLATE.render({}))
    result = runner.invoke(
        app, ["sandbox", "eval", "--problem", "embedding_bag", "--source", str(src), "--json"]
    )
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert payload["status"] == "static_rejected" and "line 1" in payload["message"]


@pytest.mark.slow
def test_sandbox_eval_source_that_does_not_import(tmp_path) -> None:
    src = tmp_path / "k.py"
    src.write_text(TEMPLATE.render({}) + "\nraise RuntimeError('broken at import')\n")
    result = runner.invoke(
        app, ["sandbox", "eval", "--problem", "embedding_bag", "--source", str(src), "--json"]
    )
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert payload["status"] == "compile_error" and "broken at import" in payload["message"]


def test_campaign_run_bad_config_names_the_field(tmp_path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        'name = "x"\nproblems = ["embedding_bag"]\n[budget]\nmax_evaluations = -1\nmax_wall_s = 5\n'
    )
    result = runner.invoke(app, ["campaign", "run", str(cfg), "--home", str(tmp_path / "h")])
    assert result.exit_code == 2
    assert "budget.max_evaluations" in result.output and "Traceback" not in result.output


def test_campaign_resume_unknown_id(tmp_path) -> None:
    result = runner.invoke(app, ["campaign", "resume", "nope", "--home", str(tmp_path)])
    assert result.exit_code == 2 and "no campaign 'nope'" in result.output


def test_library_list_empty_and_corrupt(tmp_path) -> None:
    result = runner.invoke(app, ["library", "list", "--library", str(tmp_path)])
    assert result.exit_code == 0 and "no accepted kernels yet" in result.output
    (tmp_path / "manifest.json").write_text("{not json")
    result = runner.invoke(app, ["library", "list", "--library", str(tmp_path)])
    assert result.exit_code == 2 and "unreadable" in result.output
