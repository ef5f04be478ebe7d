"""The model's timed steps, as the campaign's report measures them (agent.model_plan.measure_step),
as its profile times them (model.profile.profile_model) and as the serving benchmark does
(model.serving.serve_bench), each run on a batch no step has seen: an implementation that
memoizes its outputs is never answered from memory. (The tiny model, serving a few requests,
interpreted on a CPU.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.config import ModelSection
from agent.model_plan import measure_step
from kernels import DISPATCHER, ops
from model.config import load_config
from model.profile import profile_model
from model.serving import serve_bench
from search_space.problem import Inputs

OP = "embedding_bags"


class ValueMemo:
    """An implementation that keeps each call's output under the values of its integer tensors
    (the ids, bags and tables' metadata) and the tables' address (serving never changes them),
    and answers a call with the same key from it."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.kept: dict[tuple, torch.Tensor] = {}
        self.answered: list[bool] = []

    def __call__(self, *args, **kwargs):
        tensors = Inputs(args=args, kwargs=kwargs).tensors()
        key = (tensors[0].data_ptr(), *(tuple(t.tolist()) for t in tensors if not t.is_floating_point()))
        self.answered.append(key in self.kept)
        if key not in self.kept:
            self.kept[key] = self.fn(*args, **kwargs)
        return self.kept[key]


@pytest.fixture
def memo(monkeypatch) -> ValueMemo:
    """The op's default kernel, memoizing, as what dispatch runs for it."""
    ops.op(OP)  # defined first: defining it registers its default
    memo = ValueMemo(DISPATCHER.default(OP))
    monkeypatch.setitem(DISPATCHER._defaults, OP, memo)
    monkeypatch.setattr(DISPATCHER, "_resolved", {})
    return memo


@pytest.fixture
def model_config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(
        'size = "tiny"\n[data]\nserve_requests = 2\nserve_candidates = 8\n'
        "[history]\nmedian_len = 6\nmax_len = 24\n"
    )
    return path


def test_each_library_steps_on_batches_no_step_has_seen(memo, model_config, tmp_path) -> None:
    section = ModelSection(config=str(model_config), graph="serve", device="cpu", measure_steps=2)
    measured = measure_step(section, {"start": tmp_path / "start", "now": tmp_path / "now"})
    assert measured["implementations"]["start"][OP] == measured["implementations"]["now"][OP] == "default"
    # A warm-up step and two timed steps for each library, on six batches.
    assert len(memo.answered) >= 6 and not any(memo.answered), memo.answered


def test_the_profiled_steps_run_on_batches_the_warm_up_did_not(memo, model_config) -> None:
    profile_model(load_config(model_config), "serve", "cpu", steps=1, warmup=1)
    assert len(memo.answered) >= 2 and not any(memo.answered), memo.answered


def test_each_served_batch_is_one_no_call_has_seen(memo, model_config) -> None:
    config = load_config(model_config)
    rows = serve_bench(config, "cpu", candidates=(4,), history_lengths=(6,), repeats=2, warmup=1, naive=False)
    assert [r.path for r in rows] == ["request"] and rows[0].p50_ms > 0
    assert len(memo.answered) >= 3 and not any(memo.answered), memo.answered
