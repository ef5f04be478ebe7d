"""The sandbox benchmark's candidate mix is what it claims: distinct, screen-clean, mostly correct."""

from collections import Counter

from evals.bench_sandbox import CRASH_LINE, WRONG_EDIT, realistic_mix
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
