"""The sandbox benchmark's candidate mix is what it claims: distinct, screen-clean, mostly correct."""

import threading
import time
from collections import Counter
from types import SimpleNamespace

from rich.console import Console

from evals.bench_sandbox import CRASH_LINE, WRONG_EDIT, _evaluate_all, realistic_mix
from sandbox.result import EvalResult, Status
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


def test_each_result_is_printed_as_it_comes_and_kept_in_order() -> None:
    """The benchmark evaluates as many at once as the backend's places take and prints each
    result when it ends (a run cut short still shows what it measured); the results come back
    in the candidates' order."""
    mix = realistic_mix(6, seed=2)
    at_once, most = [0], [0]
    lock = threading.Lock()

    def evaluate(candidate):
        with lock:
            at_once[0] += 1
            most[0] = max(most[0], at_once[0])
        time.sleep(0.5 if candidate is mix[0] else 0.05)  # the first ends last
        with lock:
            at_once[0] -= 1
        rerun = candidate is mix[3]  # run again alone after its judge ran out of device memory
        return EvalResult(
            status=Status.OK,
            problem=candidate.problem,
            candidate_id=candidate.id,
            wall_s=1.0,
            phase_s={"check": 0.5, **({"beside_out_of_memory": 0.3} if rerun else {})},
            gpu_held_s={"exclusive": 0.2},
            log_tail=f"{FIRST_RUN}\nthe second run's log" if rerun else "",
        )

    backend = SimpleNamespace(places=SimpleNamespace(capacity=3), evaluate=evaluate)
    console = Console(record=True, width=200)
    results = _evaluate_all(backend, mix, time.perf_counter(), console)
    assert [r.candidate_id for r in results] == [c.id for c in mix]
    assert most[0] == 3
    lines = console.export_text().splitlines()
    # A line each, and under the rerun's the first run's failure.
    assert len(lines) == len(mix) + 1
    rerun = next(i for i, line in enumerate(lines) if "#5 " in line)
    assert "beside_out_of_memory 0.3" in lines[rerun] and "judge start-up 0.2" in lines[rerun]
    assert lines[rerun + 1].strip() == FIRST_RUN
    evaluations = lines[: rerun + 1] + lines[rerun + 2 :]
    assert all("judge   1.0 s" in line and "held exclusive 0.2" in line for line in evaluations)
    assert all("judge start-up 0.5" in line for line in evaluations if line is not lines[rerun])
    assert lines[-1].split()[2] == "#2"  # the first candidate of the list (the second of the run) ended last
