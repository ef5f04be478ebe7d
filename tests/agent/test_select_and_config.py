"""Selection by a margin beyond timing noise; config validation; the offline proposer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agent import nodes
from agent.config import ConfigError, load_config, parse_config
from agent.proposers import SearchProposer, make_proposers
from agent.state import CampaignContext
from agent.store import Store
from sandbox.candidate import Candidate
from sandbox.result import DeviceInfo, EvalResult, ShapeTiming, Status, TimingStats
from search_space.embedding_bag import TEMPLATE

VALID = {"name": "x", "problems": ["embedding_bag"], "budget": {"max_evaluations": 3, "max_wall_s": 60}}


def _result(candidate: Candidate, median: float, spread: float = 0.0, status=Status.OK) -> EvalResult:
    stats = TimingStats(
        median_us=median, p20_us=median * (1 - spread / 2), p80_us=median * (1 + spread / 2), reps=20
    )
    timings = (
        [
            ShapeTiming(
                shape="s",
                dtype="fp32",
                bucket="d64",
                candidate=stats,
                flops=1.0,
                bytes=1.0,
                achieved_gbps=1.0,
            )
        ]
        if status == Status.OK
        else []
    )
    return EvalResult(status=status, problem="embedding_bag", candidate_id=candidate.id, timings=timings)


def _candidate(block_l: int) -> Candidate:
    knobs = TEMPLATE.validate({"BLOCK_L": block_l})
    return Candidate(
        problem="embedding_bag",
        source=TEMPLATE.render(knobs),
        entry=TEMPLATE.entry,
        knobs=knobs,
        origin="template",
    )


def _select(store: Store, best: dict) -> dict:
    ctx = SimpleNamespace(campaign_id="c", store=store)
    return nodes.select({"problem": "embedding_bag", "best": best}, SimpleNamespace(context=ctx))["best"]


def test_select_needs_a_margin_beyond_noise(tmp_path) -> None:
    store = Store(tmp_path / "s.db")
    a, b, c, d = (_candidate(n) for n in (4, 8, 16, 32))
    for cand, median, spread, status in (
        (a, 100.0, 0.02, Status.OK),
        (b, 99.5, 0.02, Status.OK),
        (c, 10.0, 0.0, Status.WRONG),
        (d, 90.0, 0.02, Status.OK),
    ):
        store.add_candidate("c", cand)
        store.add_evaluation("c", _result(cand, median, spread, status))
        if cand is a:
            assert _select(store, {}) == {"embedding_bag": a.id}
        if cand is b:  # 0.5% faster with 2% noise: not a real improvement
            assert _select(store, {"embedding_bag": a.id}) == {"embedding_bag": a.id}
        if cand is c:  # wrong results never win, however fast
            assert _select(store, {"embedding_bag": a.id}) == {"embedding_bag": a.id}
    assert _select(store, {"embedding_bag": a.id}) == {"embedding_bag": d.id}


def test_on_the_interpreter_the_best_is_the_first_correct_proposal(tmp_path) -> None:
    """Interpreted timings rank nothing: the best is the first correct proposal, the one
    registration takes, however much faster a later one was timed, on every bucket too; before
    any proposal is correct, what dispatch runs today."""
    from agent.population import pick_best, pick_bucket_bests

    interpreter = DeviceInfo(
        name="cpu", arch="interpreter", torch="t", triton="t", python="p", interpreted=True
    )
    store = Store(tmp_path / "s.db")
    library = Candidate(
        problem="embedding_bag",
        source=TEMPLATE.render(TEMPLATE.defaults()),
        entry=TEMPLATE.entry,
        origin="library",
    )
    a, b, c = (_candidate(n) for n in (4, 8, 16))
    for cand, median, status in ((library, 500.0, Status.OK), (a, 10.0, Status.WRONG), (b, 90.0, Status.OK)):
        store.add_candidate("c", cand)
        store.add_evaluation(
            "c", _result(cand, median, status=status).model_copy(update={"device": interpreter})
        )
        if cand is a:
            assert _select(store, {}) == {"embedding_bag": library.id}
    store.add_candidate("c", c)
    store.add_evaluation("c", _result(c, 20.0).model_copy(update={"device": interpreter}))
    rows = store.evaluations("c")
    assert _select(store, {"embedding_bag": c.id}) == {"embedding_bag": b.id}
    assert pick_best(rows, c.id) is rows[2] and pick_bucket_bests(rows) == {"fp32/d64": b.id}


def test_config_errors_name_the_field(tmp_path) -> None:
    assert parse_config(VALID).budget.max_evaluations == 3
    with pytest.raises(ConfigError, match=r"budget\.max_evaluations"):
        parse_config({**VALID, "budget": {"max_evaluations": 0, "max_wall_s": 60}})
    with pytest.raises(ConfigError, match=r"problems.*unknown problem"):
        parse_config({**VALID, "problems": ["nope"]})
    with pytest.raises(ConfigError, match=r"\['embedding_bag_backward'\] have no knob template"):
        parse_config({**VALID, "problems": ["embedding_bag", "embedding_bag_backward"]})
    with pytest.raises(ConfigError, match=r"proposr.*Extra inputs"):
        parse_config({**VALID, "proposr": {}})
    with pytest.raises(ConfigError, match=r"^config: budget: Field required"):
        parse_config({"name": "x", "problems": ["embedding_bag"]})
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.toml")


def test_search_proposer_is_valid_new_and_reproducible() -> None:
    proposer = SearchProposer(TEMPLATE, seed=7)
    first = proposer.suggest(4, [], set())
    assert first[0].knobs == TEMPLATE.defaults()  # the template's defaults start the search
    assert len({c.id for c in first}) == 4
    history = [(c.knobs, 100.0 + i) for i, c in enumerate(first)]
    seen = {c.id for c in first}
    second = proposer.suggest(4, history, seen)
    assert len(second) == 4 and not ({c.id for c in second} & seen)
    for c in second:
        assert TEMPLATE.validate(c.knobs) == c.knobs  # constraints hold
    assert proposer.suggest(0, [], set()) == []
    again = SearchProposer(TEMPLATE, seed=7).suggest(4, history, seen)
    assert [c.id for c in again] == [c.id for c in second]  # resume proposes the same


def test_a_config_limits_the_knobs_the_search_chooses() -> None:
    """proposer.space: the search proposes only the values named (others keep every choice), and
    a space naming what is not there is refused with the field and the culprit."""
    space = {"BLOCK_D": [128, 256], "BLOCK_B": [4, 8], "EVICT_ROWS": ["evict_first"]}
    config = parse_config({**VALID, "proposer": {"space": {"embedding_bag": space}, "seed": 5}})
    [proposer] = make_proposers(config, store=None, campaign_id="c")["embedding_bag"]
    proposals = proposer.suggest(6, [], set())
    assert len(proposals) == 6
    for c in proposals:
        assert all(c.knobs[name] in values for name, values in space.items()), c.knobs
        assert TEMPLATE.validate(c.knobs) == c.knobs  # a render of the full template still
    assert len({c.knobs["BLOCK_L"] for c in proposals}) > 1  # a knob not named keeps its choices
    for bad, fragment in [
        ({"gdpa": {"BLOCK_M": [64]}}, "names 'gdpa', which is not among problems"),
        ({"embedding_bag": {"BLOCK_Q": [1]}}, r"space\.embedding_bag: unknown knob\(s\) \['BLOCK_Q'\]"),
        ({"embedding_bag": {"BLOCK_D": [100]}}, "BLOCK_D=100 is not one of"),
        ({"embedding_bag": {"BLOCK_D": [64.0]}}, "BLOCK_D=64.0 is not one of"),
        ({"embedding_bag": {"BLOCK_D": []}}, "BLOCK_D: no values allowed"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            parse_config({**VALID, "proposer": {"space": bad}})


class _ScriptedBackend:
    """Returns prepared results in order and counts the calls."""

    name = "scripted"

    def __init__(self, results: list[EvalResult]) -> None:
        self.results, self.calls = list(results), 0

    def evaluate(self, candidate, **kwargs) -> EvalResult:
        self.calls += 1
        return self.results.pop(0)

    def evaluate_many(self, candidates, **kwargs) -> list[EvalResult]:
        return [self.evaluate(c, **kwargs) for c in candidates]


def _timed(candidate: Candidate, median: float, baseline: float) -> EvalResult:
    result = _result(candidate, median)
    result.phase_s = {"load": 10.0, "check": 1.0, "lock_wait": 10.0, "timing": 2.0}
    stats = TimingStats(median_us=baseline, p20_us=baseline, p80_us=baseline, reps=20)
    result.timings[0].baselines["torch.embedding_bag"] = stats
    return result.model_copy(
        update={
            "device": DeviceInfo(
                name="gpu", arch="sm_90", torch="t", triton="t", python="p", interpreted=False
            )
        }
    )


@pytest.mark.parametrize(("median", "expected"), [(50.0, Status.OK), (5.0, Status.SUSPICIOUS)])
def test_implausible_speedups_are_remeasured_and_never_accepted(tmp_path, median, expected) -> None:
    store = Store(tmp_path / "s.db")
    cand = _candidate(4)
    store.add_candidate("c", cand)
    backend = _ScriptedBackend([_timed(cand, median, 100.0), _timed(cand, median, 100.0)])
    config = parse_config(VALID)
    ctx = CampaignContext(
        campaign_id="c",
        config=config,
        store=store,
        backend=backend,
        library=None,
        proposers={},
        report_dir="",
    )
    nodes.evaluate({"pending": [cand.id]}, SimpleNamespace(context=ctx))
    [row] = store.evaluations("c")
    assert row.result.status == expected
    if expected == Status.SUSPICIOUS:  # 20x over the fastest baseline: measured twice, flagged
        assert backend.calls == 2 and "20.0x" in row.result.message and "review" in row.result.message
        # The re-measurement held the device too: it counts against the GPU-seconds budget.
        assert store.device_seconds("c") == pytest.approx(2 * 3.0)
    else:  # 2x: plausible, measured once
        assert backend.calls == 1
        assert store.device_seconds("c") == pytest.approx(3.0)
