"""Training: the loss falls and AUC rises on the synthetic traffic, a resumed run continues
exactly where it stopped, and the command line trains, serves and profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from agent.cli import app
from kernels.registry import DISPATCHER
from model.config import config_from_dict
from model.training import Trainer

runner = CliRunner()


@pytest.fixture
def references():
    with DISPATCHER.references_only():
        yield


def _config(**train):
    return config_from_dict({"size": "tiny", "train": {"eval_every": 20, "checkpoint_every": 10, **train}})


@pytest.mark.usefixtures("references")
@pytest.mark.slow
def test_the_tiny_model_learns_the_hidden_model() -> None:
    trainer = Trainer(_config(steps=60))
    history = trainer.fit()
    first, last = history.evals[0], history.evals[-1]
    assert first.step == 0 and last.step == 60
    assert last.auc["ctr"] > 0.6 and last.auc["ctr"] > first.auc["ctr"] + 0.05, history.evals
    assert last.log_loss["ctr"] < first.log_loss["ctr"]
    assert all(s.examples_per_s > 0 and s.mfu is None for s in history.steps)  # no peak on a CPU


@pytest.mark.slow
def test_the_fused_embedding_update_trains_as_the_unfused_one() -> None:
    """Two steps on the library's kernels: the tables stepped in their backward (one fused
    update per step, every lookup's gradient joined: a candidate's item row is a feature, a
    token and a history event at once) against a dense gradient and the optimizer's step."""

    def config(update: str):
        return config_from_dict(
            {"size": "tiny", "data": {"requests_per_batch": 6}, "train": {"embedding_update": update}}
        )

    fused, unfused = Trainer(config("fused")), Trainer(config("unfused"))
    start = fused.model.sparse.embeddings.weights.clone()
    assert fused.sparse_optimizer is None and unfused.model.sparse.embeddings.weights.requires_grad
    losses = {}
    # The embedding ops on their kernels; attention, most of an interpreted step's time and no
    # part of the tables' update, on its reference.
    with DISPATCHER.references_only("jagged_attention", "target_attention"):
        for name, trainer in (("fused", fused), ("unfused", unfused)):
            losses[name] = [
                trainer.train_step(trainer.traffic.batch(i).to(trainer.device)).item() for i in range(3)
            ]
    assert DISPATCHER.last["jagged_attention"] == "reference"
    assert DISPATCHER.last["embedding_bags_update"] != "reference"
    assert losses["fused"] == pytest.approx(losses["unfused"], rel=1e-5)
    tables = fused.model.sparse.embeddings.weights, unfused.model.sparse.embeddings.weights.detach()
    assert not torch.equal(tables[0], start)  # they moved
    torch.testing.assert_close(tables[0], tables[1], atol=1e-6, rtol=1e-5)
    sums = unfused.sparse_optimizer.state[unfused.model.sparse.embeddings.weights]["sum"]
    torch.testing.assert_close(fused.model.sparse.embeddings.state, sums, atol=1e-6, rtol=1e-5)


@pytest.mark.usefixtures("references")
@pytest.mark.slow
def test_a_resumed_run_continues_exactly(tmp_path: Path) -> None:
    straight = Trainer(_config(steps=4))
    straight.fit()
    checkpoint = tmp_path / "run.pt"
    first = Trainer(_config(steps=4))
    first.fit(2, checkpoint=checkpoint)
    resumed = Trainer.resume(checkpoint)
    assert resumed.step == 2
    resumed.fit(4)
    straight_state, resumed_state = straight.model.state_dict(), resumed.model.state_dict()
    assert "sparse.embeddings.state" in straight_state  # the tables' optimizer state is saved
    assert straight_state.keys() == resumed_state.keys()
    for name, value in straight_state.items():  # tensors, and the tables' count of updates
        same = (
            torch.equal(value, resumed_state[name])
            if torch.is_tensor(value)
            else value == resumed_state[name]
        )
        assert same, name
    # The resumed run logged step 2 before its checkpoint, and step 4 as the straight one did.
    assert [s.step for s in resumed.history.steps] == [2, 4]
    assert straight.history.steps[-1].loss == resumed.history.steps[-1].loss


def test_resuming_with_another_config_is_refused(tmp_path: Path) -> None:
    checkpoint = tmp_path / "run.pt"
    Trainer(_config(steps=1)).save(checkpoint)
    with pytest.raises(ValueError, match=r"trained with another config \(differs in \['train.lr'\]\)"):
        Trainer.resume(checkpoint, config=_config(steps=1, lr=0.5))
    with pytest.raises(ValueError, match=r"differs in \['history'\]"):
        Trainer.resume(checkpoint, config=config_from_dict({"size": "tiny", "history": {"num_layers": 2}}))
    # Training longer, or compiled, is the same run.
    longer = Trainer.resume(checkpoint, config=_config(steps=9, compile=False))
    assert longer.config.train.steps == 9
    with pytest.raises(ValueError, match="no checkpoint at"):
        Trainer.resume(tmp_path / "absent.pt")


@pytest.mark.slow
def test_the_command_line_trains_and_resumes(tmp_path: Path) -> None:
    checkpoint, out = tmp_path / "tiny.pt", tmp_path / "train.json"
    args = ["model", "train", "--config", "tiny", "--reference-ops", "--checkpoint", str(checkpoint)]
    done = runner.invoke(app, [*args, "--steps", "3", "--json", str(out)])
    assert done.exit_code == 0, done.output
    assert "model FLOPs of a training step" in done.output and "held-out AUC" in done.output
    result = json.loads(out.read_text())
    assert [s["step"] for s in result["steps"]][-1] == 3 and result["evals"][-1]["auc"]["ctr"] > 0
    assert result["complete"] is True
    assert set(result["flops_per_step"]) >= {"embeddings", "history", "scoring", "interaction", "heads"}
    done = runner.invoke(app, [*args, "--steps", "5", "--resume"])
    assert done.exit_code == 0, done.output
    assert "resumed" in done.output and "at step 3" in done.output
    assert torch.load(checkpoint, weights_only=False)["step"] == 5
    # A benchmark run writes none, and leaves the one there as it was.
    done = runner.invoke(app, [*args, "--steps", "7", "--resume", "--no-save"])
    assert done.exit_code == 0 and "(--no-save)" in done.output, done.output
    assert torch.load(checkpoint, weights_only=False)["step"] == 5
    fresh = tmp_path / "fresh.pt"
    done = runner.invoke(app, [*args[:-1], str(fresh), "--steps", "1", "--no-save"])
    assert done.exit_code == 0 and not fresh.exists(), done.output


def test_a_run_cut_short_keeps_the_steps_it_logged(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "train.json"
    evaluate = Trainer.evaluate

    def fails_at_the_end(self):
        if self.step == 3:
            raise RuntimeError("cut short")
        return evaluate(self)

    monkeypatch.setattr(Trainer, "evaluate", fails_at_the_end)
    args = ["model", "train", "--config", "tiny", "--reference-ops", "--no-save", "--steps", "3"]
    done = runner.invoke(app, [*args, "--log-every", "1", "--json", str(out)])
    assert isinstance(done.exception, RuntimeError), done.output
    result = json.loads(out.read_text())
    assert [s["step"] for s in result["steps"]] == [1, 2, 3] and [e["step"] for e in result["evals"]] == [0]
    assert result["complete"] is False
    assert [p.name for p in tmp_path.iterdir()] == ["train.json"]  # nothing half written beside it


@pytest.mark.slow
def test_the_command_line_serves_and_profiles(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    serve = ["model", "serve-bench", "--config", "tiny", "--reference-ops", "--candidates", "4,16"]
    done = runner.invoke(app, [*serve, "--history", "8", "--repeats", "2", "--json", str(out)])
    assert done.exit_code == 0, done.output
    rows = json.loads(out.read_text())["rows"]
    assert {(r["path"], r["candidates_per_request"]) for r in rows} == {
        ("request", 4), ("naive", 4), ("request", 16), ("naive", 16)
    }  # fmt: skip
    assert all(r["p50_ms"] > 0 and r["history_length"] == 8 for r in rows)
    out = tmp_path / "profile.json"
    done = runner.invoke(
        app, ["model", "profile", "--graph", "serve", "--config", "tiny", "--steps", "1", "--json", str(out)]
    )
    assert done.exit_code == 0, done.output
    profile = json.loads(out.read_text())
    assert profile["graph"] == "serve" and {"embedding_bags", "jagged_attention", "target_attention"} <= {
        r["op"] for r in profile["rows"]
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["model", "train", "--config", "absent.toml"], "no model config at absent.toml"),
        (["model", "serve-bench", "--candidates", "4,x"], "--candidates takes comma-separated integers"),
        (["model", "serve-bench", "--history", "100000"], "exceeds the config's history max_len"),
        (["model", "serve-bench", "--graphs", "--reference-ops"], "a CUDA graph cannot"),
        (["model", "serve-bench", "--graphs", "--device", "cpu"], "CUDA graphs serve on a GPU, not on cpu"),
        (["model", "profile", "--graph", "eval"], "--graph must be one of train, serve"),
        (["model", "train", "--library", "absent-library"], "no kernel library at absent-library"),
    ],
)
def test_bad_input_is_a_clear_error(args: list[str], message: str) -> None:
    done = runner.invoke(app, args)
    assert done.exit_code == 2 and message in done.output, done.output


def test_the_profile_writes_the_torch_profilers_trace_with_a_range_per_op(tmp_path: Path) -> None:
    from model.profile import profile_model

    trace_file = tmp_path / "trace.json"
    with DISPATCHER.references_only():
        profile = profile_model(_config(), "serve", "cpu", steps=1, warmup=0, trace_file=trace_file)
    events = json.loads(trace_file.read_text())["traceEvents"]
    ranges = {e["name"] for e in events if str(e.get("name", "")).startswith("recforge::")}
    assert {f"recforge::{r.op}::{r.bucket}" for r in profile.rows if r.implementations} <= ranges
