"""The CLI's answers to bad input: one clear sentence and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import time

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
    from agent.store import Store

    result = runner.invoke(app, ["campaign", "resume", "nope", "--home", str(tmp_path / "none")])
    assert result.exit_code == 1 and "no campaigns in" in result.output
    Store(tmp_path / "home" / "store.db")
    result = runner.invoke(app, ["campaign", "resume", "nope", "--home", str(tmp_path / "home")])
    assert result.exit_code == 2 and "no campaign 'nope'" in result.output


def test_read_only_commands_create_no_state(tmp_path) -> None:
    home = tmp_path / "home"
    for args in (["campaign", "list"], ["campaign", "status", "x"], ["campaign", "report", "x"]):
        result = runner.invoke(app, [*args, "--home", str(home)])
        assert "no campaigns in" in result.output, (args, result.output)
    assert not home.exists()


def test_resuming_a_finished_campaign_fails_before_any_progress(tmp_path) -> None:
    from agent.config import parse_config
    from agent.store import Store

    store = Store(tmp_path / "store.db")
    cfg = parse_config(
        {"name": "x", "problems": ["embedding_bag"], "budget": {"max_evaluations": 1, "max_wall_s": 5}}
    )
    store.create_campaign("x-1", "x", cfg.model_dump_json())
    store.set_status("x-1", "finished")
    result = runner.invoke(app, ["campaign", "resume", "x-1", "--home", str(tmp_path)])
    assert result.exit_code == 2 and "already finished" in result.output
    assert "evaluations" not in result.output  # no progress bars were drawn


def test_a_campaign_says_its_id_and_how_to_resume_it_when_stopped(tmp_path, monkeypatch) -> None:
    from agent.campaign import Campaigns

    def interrupted(self, config, events=None, campaign_id=None):
        self.store.create_campaign(campaign_id, config.name, config.model_dump_json())
        raise KeyboardInterrupt

    monkeypatch.setattr(Campaigns, "start", interrupted)
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        'name = "x"\nproblems = ["embedding_bag"]\n[budget]\nmax_evaluations = 1\nmax_wall_s = 5\n'
    )
    result = runner.invoke(app, ["campaign", "run", str(cfg), "--home", str(tmp_path / "h")])
    assert result.exit_code == 130
    [row] = Campaigns(tmp_path / "h").store.campaigns()
    assert f"campaign {row.id} starting" in result.output
    assert f"continue it with: recforge campaign resume {row.id} --home {tmp_path / 'h'}" in result.output


@pytest.mark.parametrize("command", ["campaign", "bench", "eval", "verify"])
def test_a_host_whose_sandbox_cannot_start_is_told_why(tmp_path, monkeypatch, command) -> None:
    """No bubblewrap where the local backend needs it: the reason and how to fix it, no traceback."""
    monkeypatch.setenv("RECFORGE_BWRAP", str(tmp_path / "no-bwrap-here"))
    monkeypatch.setenv("RECFORGE_HOME", str(tmp_path / "h"))
    cfg = tmp_path / "c.toml"
    cfg.write_text('name = "x"\nproblems = ["embedding_bag"]\n[budget]\nmax_evaluations = 1\nmax_wall_s = 1')
    src = tmp_path / "k.py"
    src.write_text(TEMPLATE.render({}))
    args = {
        "campaign": ["campaign", "run", str(cfg)],
        "bench": ["bench", "sandbox", "--candidates", "2"],
        "eval": ["sandbox", "eval", "--problem", "embedding_bag", "--source", str(src)],
        "verify": ["library", "verify", "--library", str(tmp_path / "library")],
    }[command]
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    assert "sandbox cannot run here" in result.output and "no-bwrap-here" in result.output
    assert 'isolation = "none"' in " ".join(result.output.split())
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_campaign_stopped_by_a_signal_says_how_to_resume_it(tmp_path, monkeypatch, signum) -> None:
    from agent.campaign import Campaigns

    def terminated(self, config, events=None, campaign_id=None):
        self.store.create_campaign(campaign_id, config.name, config.model_dump_json())
        os.kill(os.getpid(), signum)  # a scheduler ending the job, a terminal closing
        time.sleep(5)
        raise AssertionError("the signal did not stop the campaign")

    monkeypatch.setattr(Campaigns, "start", terminated)
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        'name = "x"\nproblems = ["embedding_bag"]\n[budget]\nmax_evaluations = 1\nmax_wall_s = 5\n'
    )
    before = signal.getsignal(signum)
    result = runner.invoke(app, ["campaign", "run", str(cfg), "--home", str(tmp_path / "h")])
    assert result.exit_code == 128 + signum, result.output
    [row] = Campaigns(tmp_path / "h").store.campaigns()
    name = signal.Signals(signum).name
    assert f"stopped by {name}; continue it with: recforge campaign resume {row.id}" in result.output
    assert signal.getsignal(signum) == before  # the handler is the caller's again


def test_library_list_names_the_library_the_last_campaign_registered_into(tmp_path) -> None:
    from agent.config import parse_config
    from agent.store import Store

    home, registered = tmp_path / "home", tmp_path / "runs" / "library"
    home.mkdir()
    store = Store(home / "store.db")
    cfg = parse_config(
        {"name": "x", "problems": ["embedding_bag"], "budget": {"max_evaluations": 1, "max_wall_s": 5}}
    )
    for campaign in ("older", "newer"):
        store.create_campaign(campaign, "x", cfg.model_dump_json())
    store.add_accepted("older", "embedding_bag", "cand1", "k1", str(tmp_path / "elsewhere"))
    store.add_accepted("newer", "embedding_bag", "cand2", "k2", str(registered))
    result = runner.invoke(app, ["library", "list", "--home", str(home)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert f"the last campaign, newer, registered into {registered}" in result.output
    assert f"recforge library list --library {registered}" in result.output
    # Listing that library itself, or a home with no campaigns (none made), says nothing of it.
    quiet = runner.invoke(app, ["library", "list", "--home", str(tmp_path / "none")], terminal_width=200)
    assert "the last campaign" not in quiet.output and not (tmp_path / "none").exists()


def test_library_list_empty_and_corrupt(tmp_path) -> None:
    result = runner.invoke(app, ["library", "list", "--library", str(tmp_path)])
    assert result.exit_code == 0 and "no accepted kernels yet" in result.output
    (tmp_path / "manifest.json").write_text("{not json")
    result = runner.invoke(app, ["library", "list", "--library", str(tmp_path)])
    assert result.exit_code == 2 and "unreadable" in result.output


def test_campaign_list_keeps_ids_whole_at_80_columns(tmp_path, monkeypatch) -> None:
    from agent import cli
    from agent.config import parse_config
    from agent.store import Store

    store = Store(tmp_path / "store.db")
    cfg = parse_config(
        {"name": "x", "problems": ["embedding_bag"], "budget": {"max_evaluations": 1, "max_wall_s": 5}}
    )
    long_id = "embedding-bag-demo-20261203-010203-ab12"
    store.create_campaign(long_id, "embedding-bag-demo", cfg.model_dump_json())
    store.set_status(long_id, "finished", "max_evaluations reached after a long night of search")
    monkeypatch.setattr(cli.console, "width", 80)
    result = runner.invoke(app, ["campaign", "list", "--home", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "…" not in result.output and max(len(line) for line in result.output.splitlines()) <= 80
    first_cells = [line.split("│")[1].strip() for line in result.output.splitlines() if line.count("│") > 2]
    assert long_id in "".join(first_cells)  # the id, folded over lines, every character kept


def test_an_error_naming_a_config_section_keeps_its_brackets(tmp_path) -> None:
    config = tmp_path / "no_llm.toml"
    config.write_text(
        'name = "x"\nproblems = ["embedding_bag"]\n[budget]\nmax_evaluations = 1\nmax_wall_s = 10\n'
    )
    result = runner.invoke(app, ["llm", "check", str(config)])
    assert result.exit_code == 2, result.output
    assert "has no [llm] section: nothing to check" in result.output, result.output
