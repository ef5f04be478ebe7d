"""The judge's audit of a timed batch (sandbox.judge.Calibration.audit) and its retry
(Evaluation.timed_batch): a batch whose events leave most of the judge's clock unexplained is
timed again on fresh inputs, and only a candidate that leaves the gap every time is suspicious;
times the judge's clock cannot hold are suspicious at once. The runner is a stand-in that
answers with given clocks (what a GPU runner reports is all the judge sees)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from sandbox.judge import AUDIT_ATTEMPTS, Calibration, Evaluation, Verdict
from sandbox.result import Status
from search_space.problem import Shape

SHAPE = Shape(name="s", dtype="fp32", params={})
CALIBRATION = Calibration(rtt_us=50.0, flush_us=40.0)
HONEST = (8 * (100.0 + 40.0) + 50.0 + 100.0, [100.0] * 8)  # judge's clock us, runner's times
UNEXPLAINED = (20_000.0, [100.0] * 8)  # 800 us of events in 20 ms of the judge's clock


class _Session:
    """Answers each timed batch with the next (wall, times) of `batches`."""

    def __init__(self, batches: list[tuple[float, list[float]]]) -> None:
        self.batches, self.placed, self.dropped = list(batches), 0, 0

    def place(self, shape, n, write=True):
        self.placed += 1
        return [SimpleNamespace(id=self.placed * 100 + i) for i in range(n)]

    def gpu(self, *, exclusive):
        return contextlib.nullcontext()

    def run_timed(self, calls, *, where, poison=0):
        wall, times = self.batches.pop(0)
        return wall, times, [{} for _ in calls]

    def drop(self, calls):
        self.dropped += 1


def _timed_batch(batches):
    session = _Session(batches)
    judge = SimpleNamespace(session=session)
    judge.poison_bytes = lambda shape: 0
    return session, Evaluation.timed_batch(judge, SHAPE, 8, CALIBRATION)


def test_an_honest_batch_is_kept_as_measured() -> None:
    session, (calls, wall, times, _, _) = _timed_batch([HONEST])
    assert (wall, times) == HONEST and session.placed == 1 and session.dropped == 0
    assert CALIBRATION.audit(SHAPE, wall, times) == times


def test_a_gap_once_is_timed_again_on_fresh_inputs() -> None:
    session, (calls, wall, times, _, _) = _timed_batch([UNEXPLAINED, HONEST])
    assert (wall, times) == HONEST
    assert session.placed == 2 and session.dropped == 1  # the unexplained batch's calls dropped
    assert calls[0].id == 200  # the kept calls are the second batch's


def test_a_gap_every_time_is_suspicious() -> None:
    with pytest.raises(Verdict) as caught:
        _timed_batch([UNEXPLAINED] * AUDIT_ATTEMPTS)
    assert caught.value.status == Status.SUSPICIOUS
    assert f"({AUDIT_ATTEMPTS} batches)" in caught.value.message
    assert "work outside the timed calls' events" in caught.value.message


def test_calls_timed_without_their_flushes_are_suspicious() -> None:
    """A runner whose flush was patched away times its calls on what the L2 still holds: its
    events can be true, but the judge's clock then holds the calls and hardly anything beside
    them. Once, it is timed again; every time, suspicious. With half the flushes' time beside
    the calls (a flush that ran fast), the batch stands."""
    unflushed = (8 * 100.0 + 50.0 + 20.0, [100.0] * 8)
    session, (calls, wall, times, _, _) = _timed_batch([unflushed, HONEST])
    assert (wall, times) == HONEST and session.dropped == 1
    with pytest.raises(Verdict) as caught:
        _timed_batch([unflushed] * AUDIT_ATTEMPTS)
    assert caught.value.status == Status.SUSPICIOUS and "without their flushes" in caught.value.message
    fast_flushes = 8 * (100.0 + 20.0) + 50.0
    assert CALIBRATION.audit(SHAPE, fast_flushes, [100.0] * 8) == [100.0] * 8


def test_times_beyond_the_judges_clock_are_suspicious_at_once() -> None:
    forged = (1_000.0, [500.0] * 8)  # 4 ms of calls reported in 1 ms
    with pytest.raises(Verdict) as caught:
        _timed_batch([forged, HONEST])
    assert caught.value.status == Status.SUSPICIOUS and "reported" in caught.value.message


def test_a_partly_unexplained_batch_is_raised_to_the_judges_clock() -> None:
    wall, times = 8 * (200.0 + 40.0) + 50.0 + 1_200.0, [200.0] * 8  # 1.2 ms beyond the events
    raised = CALIBRATION.audit(SHAPE, wall, times)
    assert sum(raised) == pytest.approx(wall - CALIBRATION.rtt_us - 8 * CALIBRATION.flush_us)


class _Rng:
    """Draws nothing at random: no call picked by CHECKED_SHARE, the last of every range."""

    def random(self) -> float:
        return 0.9

    def randrange(self, n: int) -> int:
        return n - 1


def _fake_judge(timed_batch, check, batch_calls) -> SimpleNamespace:
    """What Evaluation.time_shape reads of its judge, with the batches, checks and batch sizes
    given and every other step a no-op."""
    session = SimpleNamespace(
        gpu=lambda exclusive: contextlib.nullcontext(),
        place=lambda shape, n, residues=(): [SimpleNamespace(inputs=None) for _ in range(n)],
        run=lambda calls, where: [{} for _ in calls],
        drop=lambda calls: None,
    )
    problem = SimpleNamespace(
        optimizes="forward", wants_statistics=lambda inputs: False, flops=lambda s: 1.0,
        bytes=lambda s: 1.0, bucket=lambda s: "b",
    )  # fmt: skip
    return SimpleNamespace(
        session=session, problem=problem, rng=_Rng(), reference_s=0.0, timed_batch=timed_batch, check=check,
        note_output_bytes=lambda shape, described: None, batch_calls=batch_calls,
        no_op_proof=lambda shape: None,
    )  # fmt: skip


def _batch_of(n: int, calibration, us: float, first_id: int = 0) -> tuple:
    """What timed_batch returns for `n` honest calls of `us` each."""
    calls = [SimpleNamespace(id=first_id + i) for i in range(n)]
    wall = n * (us + calibration.flush_us) + calibration.rtt_us
    return calls, wall, [us] * n, [us] * n, [{} for _ in calls]


@pytest.mark.parametrize(("reference_s", "batches_checked"), [(0.01, [0, 1, 2, 3]), (2.0, [0, 3])])
def test_timed_calls_are_checked_each_batch_until_the_reference_proves_costly(
    reference_s: float, batches_checked: list[int]
) -> None:
    """Four batches of two 100 ms calls (the shape's eight calls at the least): with no call drawn
    by CHECKED_SHARE, a cheap reference still checks one call of every batch; a costly one (a
    gradient's, seconds) one of the first batch, which shows its cost, and of the batch drawn
    before the timing (here the last of the four every shape runs)."""
    checked: list[int] = []
    batches = iter(range(100))

    def timed_batch(shape, n, calibration):
        return _batch_of(n, calibration, 100_000.0, first_id=next(batches) * 10)

    def check(calls, described, trial, *, where):
        checked.append(calls[0].id // 10)
        judge.reference_s = reference_s

    judge = _fake_judge(timed_batch, check, batch_calls=lambda shape: 2)
    timing = Evaluation.time_shape(judge, SHAPE, "sm_90", CALIBRATION, {})
    assert checked == batches_checked and timing.checked_calls == len(batches_checked)


def test_batches_are_sized_again_once_a_check_has_seen_the_reference() -> None:
    """A warm-up whose outputs the runner describes as tiny gets a large first batch (and a small
    poison); the first batch's check sees the reference's size, and every batch after it is
    sized by that."""
    sizes: list[int] = []
    seen = {"reference": False}

    def timed_batch(shape, n, calibration):
        sizes.append(n)
        # Calls of 10 ms: the shape's time target takes batches past its first eight calls.
        return _batch_of(n, calibration, 10_000.0)

    def check(calls, described, trial, *, where):
        seen["reference"] = True

    judge = _fake_judge(timed_batch, check, batch_calls=lambda shape: 2 if seen["reference"] else 8)
    Evaluation.time_shape(judge, SHAPE, "sm_90", CALIBRATION, {})
    assert sizes[0] == 8 and sizes[1:] and set(sizes[1:]) == {2}, sizes
