"""The sandbox benchmark's candidate mix is what it claims: distinct, screen-clean, mostly correct."""

import io
import time
from collections import Counter

from rich.console import Console

from evals.bench_sandbox import CRASH_LINE, WRONG_EDIT, _evaluate_all, realistic_mix
from sandbox.result import DeviceInfo, EvalResult, ShapeTiming, Status, TimingStats
from sandbox.screen import screen_candidate


def test_realistic_mix_composition() -> None:
    mix = realistic_mix(30, seed=1)
    assert len({c.id for c in mix}) == 30
    kinds = Counter(
        "wrong" if WRONG_EDIT[1] in c.source else "crash" if CRASH_LINE in c.source else "correct"
        for c in mix
    )
    assert kinds == {"correct": 18, "wrong": 10, "crash": 2}
    # Every one reaches the worker: the mix measures evaluation, not the static screen.
    assert all(screen_candidate(c) is None for c in mix)


FIRST_RUN = "the first run, beside other evaluations: the judge failed: OutOfMemoryError: CUDA out of memory"
DEVICE = DeviceInfo(name="GPU", arch="sm_90", torch="t", triton="t", python="p", interpreted=False)


def _result(candidate, *, baselines: bool = False, rerun: bool = False) -> EvalResult:
    stats = TimingStats(median_us=10.0, p20_us=9.0, p80_us=11.0, reps=10)
    timing = ShapeTiming(
        shape="s", dtype="fp32", bucket="b", candidate=stats, flops=1.0, bytes=1.0, achieved_gbps=1.0,
        baselines={"reference": stats} if baselines else {},
    )  # fmt: skip
    return EvalResult(
        status=Status.OK,
        problem=candidate.problem,
        candidate_id=candidate.id,
        device=DEVICE,
        timings=[timing],
        wall_s=1.0,
        phase_s={"check": 0.5, **({"beside_out_of_memory": 0.3} if rerun else {})},
        gpu_held_s={"exclusive": 0.2},
        log_tail=f"{FIRST_RUN}\nthe second run's log" if rerun else "",
    )


class ClaimingBackend:
    """Evaluates a call's candidates as the local backend does: side by side, each result told
    as it comes (the first ends last here), the baselines timed by one of them (the third)."""

    name = "claiming"
    baselines_once = True

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def evaluate_many(self, candidates, *, baselines, on_result, **kwargs):
        self.calls.append({"n": len(candidates), "baselines": baselines, **kwargs})
        results = [_result(c, baselines=i == 2, rerun=i == 3) for i, c in enumerate(candidates)]
        for i in [*range(1, len(candidates)), 0]:
            on_result(i, results[i])
        return results


class FirstAloneBackend(ClaimingBackend):
    """A backend whose calls' evaluations each time the baselines (Ray's tasks)."""

    name = "first-alone"
    baselines_once = False

    def evaluate(self, candidate, *, baselines, **kwargs):
        self.calls.append({"n": 1, "baselines": baselines, **kwargs})
        return _result(candidate, baselines=True)


def test_each_result_is_printed_as_it_comes_and_kept_in_order() -> None:
    """With a backend that times the baselines once within a call, the mix goes in one call,
    as a campaign's first batch does; each result is printed when it ends (a run cut short
    still shows what it measured), the one that timed the baselines marked, and the results
    come back in the candidates' order."""
    mix = realistic_mix(6, seed=2)
    backend = ClaimingBackend()
    console = Console(record=True, width=200)
    results = _evaluate_all(backend, mix, ["reference"], time.perf_counter(), console)
    assert [r.candidate_id for r in results] == [c.id for c in mix]
    assert backend.calls == [{"n": 6, "baselines": ["reference"]}]
    lines = console.export_text().splitlines()
    # A line each, and under the rerun's the first run's failure.
    assert len(lines) == len(mix) + 1
    rerun = next(i for i, line in enumerate(lines) if "#4 " in line)
    assert "beside_out_of_memory 0.3" in lines[rerun] and "judge start-up 0.2" in lines[rerun]
    assert lines[rerun + 1].strip() == FIRST_RUN
    evaluations = lines[: rerun + 1] + lines[rerun + 2 :]
    assert all("judge   1.0 s" in line and "held exclusive 0.2" in line for line in evaluations)
    assert [line.split()[2] for line in evaluations if "(timed the baselines)" in line] == ["#3"]
    assert evaluations[-1].split()[2] == "#1"  # the first candidate ended last


def test_without_claims_the_first_goes_alone_and_the_rest_hold_its_baselines() -> None:
    """A backend whose evaluations would each time the baselines gets the first candidate
    alone, as a campaign sends it, and the rest with that evaluation's kind held."""
    mix = realistic_mix(4, seed=3)
    backend = FirstAloneBackend()
    results = _evaluate_all(backend, mix, ["reference"], time.perf_counter(), Console(file=io.StringIO()))
    assert [r.candidate_id for r in results] == [c.id for c in mix]
    assert backend.calls == [
        {"n": 1, "baselines": ["reference"]},
        {"n": 3, "baselines": ["reference"], "baselines_held_on": [DEVICE.kind]},
    ]
