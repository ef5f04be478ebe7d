"""The GPU lock of the local backend's judges: checks share the GPU, timing has it alone, a
waiting timer is not starved by a stream of checks, and an evaluation holding several GPUs
times with no evaluation on any of them. Real processes, real flock(2) locks."""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter
from pathlib import Path

import pytest

from sandbox.locks import BaselineClaims, gpu_use

HOLD_S = 0.6


def _hold(lock: str | list[str], exclusive: bool, delay: float, ready, log) -> None:
    ready.wait()  # every process imported and started: the plan's delays count from here
    time.sleep(delay)
    with gpu_use(lock, exclusive=exclusive):
        begin = time.time()
        time.sleep(HOLD_S)
        log.put(("timing" if exclusive else "check", begin, time.time(), lock))


def _run(lock: Path | list, plan: list[tuple[bool, float]]) -> list[tuple[str, float, float, object]]:
    """Each (exclusive, delay) of `plan` in a process of its own, all on `lock`; or, where `lock`
    is a list, each on its own entry of it (a lock file, or a list of them)."""
    ctx = multiprocessing.get_context("spawn")
    log, ready = ctx.Queue(), ctx.Barrier(len(plan))
    locks = lock if isinstance(lock, list) else [str(lock)] * len(plan)
    procs = [
        ctx.Process(target=_hold, args=(lk, ex, delay, ready, log))
        for lk, (ex, delay) in zip(locks, plan, strict=True)
    ]
    for p in procs:
        p.start()
    windows = [log.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return sorted(windows, key=lambda w: w[1])


def _overlap(a: tuple, b: tuple) -> bool:
    return a[1] < b[2] and b[1] < a[2]


@pytest.mark.slow
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


def test_an_evaluation_on_two_gpus_times_with_none_on_either(tmp_path: Path) -> None:
    """GPU a and GPU b each time one evaluation at once, side by side; an evaluation holding both
    (the host's GPUs as one place), whose list names them in the other order, times beside
    neither, and none of the three waits forever."""
    a, b = str(tmp_path / "a.lock"), str(tmp_path / "b.lock")
    windows = _run([a, b, [b, a]], [(True, 0.0), (True, 0.0), (True, 0.2)])
    on_a, on_b = (next(w for w in windows if w[3] == lk) for lk in (a, b))
    [both] = [w for w in windows if isinstance(w[3], list)]
    assert _overlap(on_a, on_b), "two GPUs time at once"
    assert not _overlap(both, on_a) and not _overlap(both, on_b), "the pair times alone"


def test_without_a_lock_file_nothing_is_locked() -> None:
    with gpu_use(None, exclusive=True), gpu_use(None, exclusive=True), gpu_use([], exclusive=True):
        pass


def test_a_wait_for_the_lock_moves_the_evaluations_deadline_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another evaluation times for HOLD_S: a judge waiting for the lock meanwhile is told how long
    # it waited, and its deadline (and the mark its backend follows) moves back by that much.
    import threading

    from sandbox import judge, local
    from sandbox.protocol import DEADLINE_MARK

    lock = str(tmp_path / "gpu.lock")
    mark = tmp_path / DEADLINE_MARK
    deadline = judge.Deadline(10.0, mark)
    first_at = deadline.at
    holding = threading.Event()

    def other_evaluation() -> None:
        with gpu_use(lock, exclusive=True):
            holding.set()
            time.sleep(HOLD_S)

    other = threading.Thread(target=other_evaluation)
    other.start()
    holding.wait()
    with gpu_use(lock, exclusive=False, waited=deadline.extend):
        pass
    other.join()
    assert deadline.at - first_at >= HOLD_S * 0.8
    assert abs(float(mark.read_text()) - (time.time() + deadline.left())) < 0.5

    # The backend's hard limit follows the mark: a judge that would outlive `limit` is waited for
    # while the mark says its deadline moved, and given up on once the moved limit passes too.
    mark.write_text(repr(time.time() + 0.6))
    waits: list[float] = []

    def still_running(timeout: float) -> None:
        waits.append(timeout)
        time.sleep(timeout)
        raise TimeoutError

    monkeypatch.setattr(local, "JUDGE_GRACE_S", 0.0)
    monkeypatch.setattr(local, "MARK_POLL_S", 0.1)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        local._wait_within(still_running, 0.1, tmp_path)
    waited = time.monotonic() - t0
    assert waited >= 0.5 and len(waits) > 1, (waited, waits)  # it waited on past its own limit


def test_an_evaluation_counts_how_long_it_held_the_lock(tmp_path: Path) -> None:
    """The judge's session adds each hold of the lock to its kind (EvalResult.gpu_held_s), the
    wait for it to the phase clock's lock_wait instead; with no lock to take, nothing is counted."""
    from types import SimpleNamespace

    import torch

    from sandbox.judge import Deadline, PhaseClock, Session
    from search_space import get_problem

    clock = PhaseClock()
    runner = SimpleNamespace(deadline=Deadline(60))
    problem, cpu = get_problem("embedding_bag"), torch.device("cpu")
    session = Session(runner, problem, cpu, [str(tmp_path / "gpu.lock")], on_wait=clock.waited)
    for exclusive, seconds in ((True, 0.2), (False, 0.1), (True, 0.1)):
        with session.gpu(exclusive=exclusive):
            time.sleep(seconds)
    assert 0.3 <= session.held_s["exclusive"] < 0.6
    assert 0.1 <= session.held_s["shared"] < 0.4
    assert "lock_wait" in clock.stop()
    unlocked = Session(runner, problem, cpu, [])
    with unlocked.gpu(exclusive=True):
        time.sleep(0.05)
    assert unlocked.held_s == {}


@pytest.mark.timeout(60)  # a nested flock of the same file would wait forever
def test_inside_an_exclusive_hold_the_session_takes_nothing_more(tmp_path: Path) -> None:
    """Under TIMING_LOCK "shape" a timing shape's batches and checks run inside one exclusive
    hold: each gpu() within it takes nothing (a second flock of the lock file from the same
    process would wait on the first), and only the outer hold is counted."""
    from types import SimpleNamespace

    import torch

    from sandbox.judge import Deadline, Session
    from search_space import get_problem

    runner = SimpleNamespace(deadline=Deadline(60))
    session = Session(runner, get_problem("embedding_bag"), torch.device("cpu"), [str(tmp_path / "gpu.lock")])
    with session.gpu(exclusive=True):
        with session.gpu(exclusive=False):
            time.sleep(0.05)
        with session.gpu(exclusive=True):
            time.sleep(0.05)
    assert set(session.held_s) == {"exclusive"} and session.held_s["exclusive"] >= 0.1
    with session.gpu(exclusive=False):  # after it, each takes its own again
        pass
    assert set(session.held_s) == {"exclusive", "shared"}


def _claim(path: str, kind: str, evaluation: str) -> bool:
    return BaselineClaims.claim(Path(path), kind, evaluation)


def test_one_judge_per_kind_claims_the_baselines_and_the_claims_go_with_the_call() -> None:
    """Eight evaluations claim at once, each in a process of its own: one wins each kind, and
    wins it again when run once more (its judge ran out of memory beside others); a claim in a
    directory gone (a call ended) is won, since timing the baselines twice costs less than
    missing them."""
    with BaselineClaims() as claims:
        path = str(claims.path)
        kinds = ["NVIDIA H200 (sm_90)"] * 4 + ["NVIDIA H100 80GB HBM3 (sm_90)"] * 3 + ["x86_64 (interpreter)"]
        asked = [(path, kind, f"/scratch/eval-{i}") for i, kind in enumerate(kinds)]
        with multiprocessing.get_context("spawn").Pool(8) as pool:
            won = pool.starmap(_claim, asked)
        assert Counter(k for w, k in zip(won, kinds, strict=True) if w) == Counter(set(kinds))
        assert [_claim(*a) for a in asked] == won
        assert not _claim(path, kinds[0], "/scratch/eval-8")
    assert not claims.path.exists()
    assert _claim(path, kinds[0], "/scratch/eval-8")


def test_a_killed_calls_claims_go_when_the_next_call_starts(tmp_path: Path, monkeypatch) -> None:
    """A call killed before it could remove its claims directory leaves it; the next call's
    claims remove it, and leave those of calls still running (their PIDs alive)."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    ended = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    ended.start()
    ended.join()
    orphan = tmp_path / f"{BaselineClaims.PREFIX}{ended.pid}-abc"
    running = tmp_path / f"{BaselineClaims.PREFIX}{multiprocessing.current_process().pid}-def"
    other = tmp_path / "recforge-baselines-notapid"
    for path in (orphan, running, other):
        path.mkdir()
        (path / "claim").write_text("/scratch/eval-0")
    with BaselineClaims() as claims:
        assert claims.path.parent == tmp_path and claims.path.name.startswith(f"{BaselineClaims.PREFIX}")
        assert not orphan.exists() and running.exists() and other.exists()
    assert not claims.path.exists()
