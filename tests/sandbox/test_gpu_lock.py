"""The GPU lock of the local backend's judges: checks share the GPU, timing has it alone, and a
waiting timer is not starved by a stream of checks. Real processes, real flock(2) locks."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from sandbox.locks import gpu_use

HOLD_S = 0.6


def _hold(lock: str, exclusive: bool, delay: float, ready, log) -> None:
    ready.wait()  # every process imported and started: the plan's delays count from here
    time.sleep(delay)
    with gpu_use(lock, exclusive=exclusive):
        begin = time.time()
        time.sleep(HOLD_S)
        log.put(("timing" if exclusive else "check", begin, time.time()))


def _run(lock: Path, plan: list[tuple[bool, float]]) -> list[tuple[str, float, float]]:
    ctx = multiprocessing.get_context("spawn")
    log, ready = ctx.Queue(), ctx.Barrier(len(plan))
    procs = [ctx.Process(target=_hold, args=(str(lock), ex, delay, ready, log)) for ex, delay in plan]
    for p in procs:
        p.start()
    windows = [log.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return sorted(windows, key=lambda w: w[1])


def _overlap(a: tuple, b: tuple) -> bool:
    return a[1] < b[2] and b[1] < a[2]


def test_checks_share_the_gpu_and_timing_has_it_alone(tmp_path: Path) -> None:
    # Two checks start together, a timer arrives while they run, then two more checks arrive
    # while the timer waits: they must wait for it (the turnstile), not slip in ahead of it.
    windows = _run(
        tmp_path / "gpu.lock", [(False, 0.0), (False, 0.0), (True, 0.2), (False, 0.4), (False, 0.4)]
    )
    checks = [w for w in windows if w[0] == "check"]
    [timing] = [w for w in windows if w[0] == "timing"]
    assert _overlap(checks[0], checks[1]), "checks run side by side"
    assert not any(_overlap(timing, c) for c in checks), "no check runs beside the timing"
    late = [c for c in checks if c[1] > checks[1][1]]
    assert len(late) == 2 and all(c[1] >= timing[2] for c in late), "the waiting timer goes first"


def test_without_a_lock_file_nothing_is_locked() -> None:
    with gpu_use(None, exclusive=True), gpu_use(None, exclusive=True):
        pass
