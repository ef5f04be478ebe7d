"""A campaign on GPUs of several kinds (a Ray cluster of two GPU models, a host whose GPUs
differ): baselines and incumbents are measured on each kind that evaluates candidates, and a
candidate is compared only with those measured on its own kind; stores from before kinds open
and take the kind of the evaluation that timed their baselines. Also the `gpus` setting's
errors."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest
from quick_backend import QuickBackend

import agent.campaign
from agent import nodes
from agent.campaign import CampaignError, campaign_gpus
from agent.config import ConfigError, SandboxConfig, parse_config
from agent.incumbents import default_candidate
from agent.population import primary_baseline
from agent.report import _problem
from agent.state import CampaignContext
from agent.store import BASELINES_TIMING, Store
from kernels.registry import KernelLibrary
from sandbox.candidate import Candidate
from sandbox.result import DeviceInfo, EvalResult, ShapeTiming, Status, TimingStats
from search_space.embedding_bag import TEMPLATE

OP = "embedding_bag"
BASELINE = primary_baseline(OP)
H100 = DeviceInfo(name="NVIDIA H100", arch="sm_90", torch="t", triton="t", python="p", interpreted=False)
A100 = DeviceInfo(name="NVIDIA A100", arch="sm_80", torch="t", triton="t", python="p", interpreted=False)
L4 = DeviceInfo(name="NVIDIA L4", arch="sm_89", torch="t", triton="t", python="p", interpreted=False)
CONFIG = {"name": "k", "problems": [OP], "budget": {"max_evaluations": 20, "max_wall_s": 600}}


def _candidate(block_l: int | None, origin: str = "template") -> Candidate:
    knobs = TEMPLATE.validate({"BLOCK_L": block_l})
    return Candidate(
        problem=OP, source=TEMPLATE.render(knobs), entry=TEMPLATE.entry, knobs=knobs, origin=origin
    )


def _stats(us: float, spread: float = 0.0) -> TimingStats:
    return TimingStats(median_us=us, p20_us=us * (1 - spread / 2), p80_us=us * (1 + spread / 2), reps=20)


def _result(
    candidate: Candidate, device: DeviceInfo, us: float, baseline_us: float | None = None
) -> EvalResult:
    """A result timed on one fp32 shape of bucket d64, with its judge's baselines where given."""
    timing = ShapeTiming(
        shape="s", dtype="fp32", bucket="d64", candidate=_stats(us, 0.02), flops=1.0, bytes=1.0,
        achieved_gbps=1.0, baselines={} if baseline_us is None else {BASELINE: _stats(baseline_us)},
    )  # fmt: skip
    return EvalResult(
        status=Status.OK, problem=OP, candidate_id=candidate.id, timings=[timing], device=device
    )


class KindsBackend:
    """Each evaluation lands on the next device of `devices`, as a Ray cluster's tasks land where
    Ray puts them: its candidate takes `speed[id]` us, and its judge times the baselines
    (`baseline_us` of its kind) unless the request holds its kind."""

    name = "kinds"

    def __init__(
        self, devices: list[DeviceInfo], speed: dict[str, float], baseline_us: dict[str, float]
    ) -> None:
        self.devices, self.speed, self.baseline_us = list(devices), speed, baseline_us
        self.asked: list[list[str]] = []  # baselines_held_on of each evaluation

    def evaluate(self, candidate, *, baselines=None, baselines_held_on=(), **_) -> EvalResult:
        device = self.devices.pop(0)
        self.asked.append(sorted(baselines_held_on))
        timed = baselines and device.kind not in baselines_held_on
        return _result(
            candidate, device, self.speed[candidate.id], self.baseline_us[device.kind] if timed else None
        )

    def evaluate_many(self, candidates, **kwargs) -> list[EvalResult]:
        return [self.evaluate(c, **kwargs) for c in candidates]


class ClaimingBackend(KindsBackend):
    """A backend that times the baselines once per kind within a call, as the local one does
    (sandbox.locks.BaselineClaims): in evaluate_many, the evaluations on a kind not held whose
    candidate is in `timers` claim it in turn (the first to claim wins), and `fails` fail after
    claiming. A lone evaluate times them where its kind is not held."""

    name = "claiming"
    baselines_once = True

    def __init__(self, *args, timers: set[str], fails: set[str] = frozenset(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timers, self.fails = timers, fails
        self.calls: list[list[str]] = []  # the candidates of each call

    def evaluate_many(self, candidates, *, baselines=None, baselines_held_on=(), **_) -> list[EvalResult]:
        self.calls.append([c.id for c in candidates])
        claimed, results = set(baselines_held_on), []
        for candidate in candidates:
            device = self.devices.pop(0)
            self.asked.append(sorted(baselines_held_on))
            timed = baselines and candidate.id in self.timers and device.kind not in claimed
            claimed |= {device.kind} if timed else set()
            if candidate.id in self.fails:
                results.append(
                    EvalResult(status=Status.WRONG, problem=OP, candidate_id=candidate.id, device=device)
                )
                continue
            base = self.baseline_us[device.kind] if timed else None
            results.append(_result(candidate, device, self.speed[candidate.id], base))
        return results

    def evaluate(self, candidate, **kwargs) -> EvalResult:
        self.calls.append([candidate.id])
        return super().evaluate(candidate, **kwargs)


def _context(tmp_path: Path, store: Store, backend, **config) -> CampaignContext:
    cfg = parse_config({**CONFIG, **config})
    if store.campaign("c") is None:
        store.create_campaign("c", cfg.name, cfg.model_dump_json())
    library = KernelLibrary(tmp_path / "library")
    return CampaignContext(
        campaign_id="c", config=cfg, store=store, backend=backend, library=library, proposers={},
        report_dir=str(tmp_path / "report"),
    )  # fmt: skip


def test_each_kind_times_its_baselines_and_candidates_meet_only_their_own(tmp_path: Path) -> None:
    """The first evaluation goes alone and times the baselines on the kind it lands on (H100);
    the rest carry that kind, and the first on another kind (A100) times them there. A candidate
    on the A100 at 8 us is 2.5x its kind's 20 us baseline: plausible. Against the H100's 100 us
    it would be 12.5x, a speedup the campaign re-measures and flags as suspicious."""
    store = Store(tmp_path / "s.db")
    first, second, fast = _candidate(4), _candidate(8), _candidate(16)
    for c in (first, second, fast):
        store.add_candidate("c", c)
    backend = KindsBackend(
        [H100, A100, A100],
        speed={first.id: 90.0, second.id: 30.0, fast.id: 8.0},
        baseline_us={H100.kind: 100.0, A100.kind: 20.0},
    )
    ctx = _context(tmp_path, store, backend, start_from="reference", register_kernels=False)
    nodes.evaluate({"pending": [first.id, second.id, fast.id]}, SimpleNamespace(context=ctx))
    assert backend.asked == [[], [H100.kind], [H100.kind]]  # the first alone, then what is held
    assert store.baseline_kinds("c", OP) == sorted([H100.kind, A100.kind])
    assert store.baselines("c", OP, H100.kind)["s/fp32"][BASELINE].median_us == 100.0
    assert store.baselines("c", OP, A100.kind)["s/fp32"][BASELINE].median_us == 20.0
    assert store.baselines("c", OP, L4.kind) == {}
    statuses = {r.candidate.id: r.result.status for r in store.evaluations("c", OP)}
    assert statuses[fast.id] == Status.OK
    assert nodes.best_speedup(ctx, OP) == pytest.approx(20.0 / 8.0)
    # The report's figures for the best (on the A100) are the A100's too.
    report = _problem(store, "c", OP, fast.id, [])
    assert report.speedups[BASELINE] == pytest.approx(2.5)
    assert report.baselines["s/fp32"][BASELINE].median_us == 20.0


def _claimed_batch(
    tmp_path: Path, db: str, candidates: list[Candidate], backend: ClaimingBackend
) -> tuple[CampaignContext, dict[str, EvalResult]]:
    """`candidates` proposed and evaluated by a campaign with `backend`: its context, and each
    candidate's stored result by id."""
    store = Store(tmp_path / db)
    for c in candidates:
        store.add_candidate("c", c)
    ctx = _context(tmp_path, store, backend, start_from="reference", register_kernels=False)
    nodes.evaluate({"pending": [c.id for c in candidates]}, SimpleNamespace(context=ctx))
    return ctx, {r.candidate.id: r.result for r in store.evaluations("c", OP)}


def test_a_backend_that_claims_baselines_takes_the_first_batch_whole(tmp_path: Path) -> None:
    """With a backend that times the baselines once per kind within a call, the problem's first
    batch goes whole. The baselines come from whichever evaluation claimed them, here the last,
    and every result of the batch is judged against them: the first, 12.5x faster than its
    kind's baseline, is re-measured and flagged, though its own evaluation timed no baseline."""
    fast, slow, timer = _candidate(4), _candidate(8), _candidate(16)
    backend = ClaimingBackend(
        [H100, H100, H100, H100],
        speed={fast.id: 8.0, slow.id: 90.0, timer.id: 60.0},
        baseline_us={H100.kind: 100.0},
        timers={timer.id},
    )
    ctx, rows = _claimed_batch(tmp_path, "s.db", [fast, slow, timer], backend)
    assert backend.calls == [[fast.id, slow.id, timer.id], [fast.id]]  # the batch, then the re-measure
    assert backend.asked[:3] == [[], [], []]
    assert ctx.store.baselines("c", OP, H100.kind)["s/fp32"][BASELINE].median_us == 100.0
    assert rows[fast.id].status == Status.SUSPICIOUS
    assert "12.5x over the fastest baseline" in rows[fast.id].message
    assert rows[slow.id].status == rows[timer.id].status == Status.OK
    assert nodes.best_speedup(ctx, OP) == pytest.approx(100.0 / 60.0)


def test_baselines_lost_with_the_evaluation_that_claimed_them_are_timed_again(tmp_path: Path) -> None:
    """The evaluation that claimed the baselines failed while timing, so the batch's passing
    results have none on their kind: the first of them is evaluated again, alone, to time them,
    and every result is judged against those. Where that evaluation lands on another kind, the
    baselines it timed are that kind's, and it goes again, up to RECHECK_TRIES times; with none
    on the result's kind, the result is not accepted without review."""
    claimer, first, second = _candidate(4), _candidate(8), _candidate(16)
    backend = ClaimingBackend(
        [H100, H100, H100, H100],
        speed={claimer.id: 50.0, first.id: 40.0, second.id: 80.0},
        baseline_us={H100.kind: 100.0},
        timers={claimer.id},
        fails={claimer.id},
    )
    ctx, rows = _claimed_batch(tmp_path, "s.db", [claimer, first, second], backend)
    assert backend.calls == [[claimer.id, first.id, second.id], [first.id]]
    assert rows[claimer.id].status == Status.WRONG
    assert rows[first.id].status == rows[second.id].status == Status.OK
    assert "remeasure" in rows[first.id].phase_s  # the evaluation again counts in the device budget
    assert "remeasure" not in rows[second.id].phase_s
    assert nodes.best_speedup(ctx, OP) == pytest.approx(100.0 / 40.0)

    # The first evaluation again lands on an A100, whose baselines it keeps; the second on the
    # H100, whose baselines the result is then judged against.
    backend = ClaimingBackend(
        [H100, H100, A100, H100],
        speed={claimer.id: 50.0, first.id: 40.0},
        baseline_us={H100.kind: 100.0, A100.kind: 20.0},
        timers={claimer.id},
        fails={claimer.id},
    )
    ctx, rows = _claimed_batch(tmp_path, "t.db", [claimer, first], backend)
    assert backend.calls == [[claimer.id, first.id], [first.id], [first.id]]
    assert rows[first.id].status == Status.OK
    assert ctx.store.baselines("c", OP, A100.kind)["s/fp32"][BASELINE].median_us == 20.0
    assert nodes.best_speedup(ctx, OP) == pytest.approx(100.0 / 40.0)

    # Never on the H100 in RECHECK_TRIES: not accepted without review.
    backend = ClaimingBackend(
        [H100, H100, *[A100] * nodes.RECHECK_TRIES],
        speed={claimer.id: 50.0, first.id: 40.0},
        baseline_us={H100.kind: 100.0, A100.kind: 20.0},
        timers={claimer.id},
        fails={claimer.id},
    )
    ctx, rows = _claimed_batch(tmp_path, "u.db", [claimer, first], backend)
    assert len(backend.calls) == 1 + nodes.RECHECK_TRIES
    assert rows[first.id].status == Status.SUSPICIOUS
    assert rows[first.id].message.startswith("no baselines were timed on its kind of device")
    assert f"it ran on {A100.kind}" in rows[first.id].message
    assert ctx.store.baselines("c", OP, H100.kind) == {}


def _registered(
    tmp_path: Path, store: Store, recheck: DeviceInfo | tuple[DeviceInfo, ...], us: float
) -> tuple[CampaignContext, list[str]]:
    messages: list[str] = []
    backend = QuickBackend(speed=lambda c: us, devices=recheck if isinstance(recheck, tuple) else (recheck,))
    ctx = _context(tmp_path, store, backend)
    ctx.events = SimpleNamespace(message=messages.append)
    nodes.register({"best": {}}, SimpleNamespace(context=ctx))
    return ctx, messages


def test_a_proposal_is_compared_only_with_what_dispatch_runs_on_its_own_kind(tmp_path: Path) -> None:
    """What dispatch runs today takes 100 us on the H100 and 40 us on the A100 (measured there
    beside a proposal). A proposal at 50 us on the A100 beats the H100's figure, not its own
    kind's: nothing is registered for it. One at 90 us on the H100 beats that kind's by 10%: it is
    registered, for the H100's architecture. One on an L4, where dispatch's kernels were never
    measured, is compared with nothing and registered for nothing."""
    store = Store(tmp_path / "s.db")
    incumbent = default_candidate(OP)
    on_a100, on_h100, on_l4 = _candidate(4), _candidate(8), _candidate(16)
    for c, device, us in (
        (incumbent, H100, 100.0),
        (on_a100, A100, 50.0),
        (on_h100, H100, 90.0),
        (on_l4, L4, 10.0),
    ):
        store.add_candidate("c", c)
        store.add_evaluation("c", _result(c, device, us))
    store.add_incumbent_evaluation("c", incumbent, _result(incumbent, A100, 40.0))
    ctx, messages = _registered(tmp_path, store, H100, 90.0)
    [entry] = ctx.library.entries()
    assert (entry.source_hash, entry.arch) == (on_h100.id, "sm_90")
    assert any(
        m.startswith(f"{OP} on {A100.kind} fp32 d64: best proposal {on_a100.id} (50.0 us)")
        and "(40.0 us)" in m
        for m in messages
    ), messages
    assert (
        f"{OP} on {L4.kind}: nothing registered: what dispatch runs today was not measured there" in messages
    )


def _store(store: Store, candidate: Candidate) -> Candidate:
    store.add_candidate("c", candidate)
    return candidate


def test_a_new_kind_measures_the_incumbents_beside_its_first_proposal(tmp_path: Path) -> None:
    """The incumbents were measured on the CPU interpreter (the campaign's first batch); a batch of
    proposals that lands on an A100 measures them there too, once, for the A100's architecture:
    the library's kernel for sm_90 stays out of it."""
    library = KernelLibrary(tmp_path / "library")
    sm90 = _candidate(32, "library")
    library.add(
        op=OP, entry=TEMPLATE.entry, source=sm90.source, arch="sm_90", dtype="fp32", buckets=["d64"],
        median_us=1.0, interpreted=False, evidence={}, provenance={"test": "sm_90"},
    )  # fmt: skip
    store = Store(tmp_path / "s.db")
    default = default_candidate(OP)
    cpu = QuickBackend().evaluate(default)
    store.add_candidate("c", default)
    store.add_evaluation("c", cpu)
    proposals = [_candidate(4), _candidate(8)]
    for c in proposals:
        store.add_candidate("c", c)
    backend = QuickBackend(devices=(A100,))
    ctx = _context(tmp_path, store, backend)
    nodes.evaluate({"pending": [c.id for c in proposals]}, SimpleNamespace(context=ctx))
    again = store.incumbent_evaluations("c", OP)
    assert [(r.candidate.id, r.result.kind) for r in again] == [(default.id, A100.kind)]
    assert backend.evaluated.count(default.id) == 1 and sm90.id not in backend.evaluated
    # Measured on every kind that evaluated proposals: the next batch measures nothing more.
    nodes.evaluate({"pending": [_store(store, _candidate(16)).id]}, SimpleNamespace(context=ctx))
    assert backend.evaluated.count(default.id) == 1


OLD_SCHEMA = """
CREATE TABLE campaigns (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, config_json TEXT NOT NULL, status TEXT NOT NULL,
    stop_reason TEXT, wall_s REAL NOT NULL DEFAULT 0, created_at TEXT NOT NULL, updated_at TEXT NOT NULL
);
CREATE TABLE evaluations (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, campaign_id TEXT NOT NULL, candidate_id TEXT NOT NULL,
    problem TEXT NOT NULL, status TEXT NOT NULL, score_us REAL, interpreted INTEGER NOT NULL,
    result_json TEXT NOT NULL, created_at TEXT NOT NULL, UNIQUE (campaign_id, candidate_id)
);
CREATE TABLE baselines (
    campaign_id TEXT NOT NULL, problem TEXT NOT NULL, shape_key TEXT NOT NULL,
    name TEXT NOT NULL, stats_json TEXT NOT NULL, PRIMARY KEY (campaign_id, problem, shape_key, name)
);
"""


def test_a_store_from_before_kinds_opens_with_the_kind_that_timed_its_baselines(tmp_path: Path) -> None:
    """Campaign `old` timed its baselines with its first correct evaluation (after a failed one):
    they take that evaluation's kind. Campaign `lost` has baselines but no evaluation that says
    where they were timed: they are dropped, to be timed again."""
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    failed = EvalResult(status=Status.WRONG, problem=OP, candidate_id="x", device=A100)
    timed = _result(_candidate(4), H100, 50.0, baseline_us=100.0)
    for seq, (campaign, result) in enumerate([("old", failed), ("old", timed)]):
        db.execute(
            "INSERT INTO evaluations VALUES (?, ?, ?, ?, ?, NULL, 0, ?, '')",
            (
                seq + 1,
                campaign,
                f"{result.candidate_id}-{seq}",
                OP,
                result.status.value,
                result.model_dump_json(),
            ),
        )
    for campaign in ("old", "lost"):
        db.execute(
            "INSERT INTO baselines VALUES (?, ?, 's/fp32', ?, ?)",
            (campaign, OP, BASELINE, _stats(100.0).model_dump_json()),
        )
    # Its baselines' timing taken as today's, to see the kinds' migration alone (a store this old
    # also loses them to the next one: test_a_store_from_before_baselines_were_timed_to_end_events).
    db.execute(f"PRAGMA user_version = {BASELINES_TIMING}")
    db.commit()
    db.close()
    store = Store(path)
    assert store.baseline_kinds("old", OP) == [H100.kind]
    assert store.baselines("old", OP, H100.kind)["s/fp32"][BASELINE].median_us == 100.0
    assert store.baseline_kinds("lost", OP) == []
    store.close()
    assert Store(path).baseline_kinds("old", OP) == [H100.kind]  # opens again as it is


def test_a_store_from_before_baselines_were_timed_to_end_events_times_them_again(tmp_path: Path) -> None:
    """Its baselines were timed past a device-wide synchronize (12 us more a call on an H100):
    dropped when it opens, so a resumed campaign times them again; a store opened since keeps
    what it times."""
    path = tmp_path / "store.db"
    store = Store(path)
    store.add_baselines("c", OP, _result(_candidate(4), H100, 50.0, baseline_us=100.0))
    assert store.baseline_kinds("c", OP) == [H100.kind]
    store.close()
    assert Store(path).baseline_kinds("c", OP) == [H100.kind]  # opened again: kept
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 0")  # as a store from before
    db.commit()
    db.close()
    store = Store(path)
    assert store.baseline_kinds("c", OP) == [] and store.baselines("c", OP, H100.kind) == {}
    store.close()


@pytest.mark.parametrize(
    ("sandbox", "message"),
    [
        ({"gpus": 0}, "config: sandbox.gpus: Value error, gpus = 0: at least 1 GPU is needed"),
        ({"gpus": []}, "gpus = []: the list names no GPU"),
        ({"gpus": [1, 1]}, "gpus = [1, 1] names GPU 1 more than once"),
        ({"gpus": "two"}, 'give "all", a number of GPUs, or a list of GPU indices'),
        (
            {"gpus": "all", "backend": "ray"},
            "gpus applies to the local backend; the ray backend gives each task",
        ),
    ],
)
def test_gpus_no_host_takes_are_config_errors(sandbox: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="sandbox") as caught:
        parse_config({**CONFIG, "sandbox": sandbox})
    assert message in str(caught.value)


def test_gpus_this_host_lacks_stop_the_campaign_before_it_starts(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(agent.campaign, "visible_gpus", lambda: ["0", "1"])
    assert campaign_gpus(SandboxConfig(gpus="all")) == ["0", "1"]
    assert campaign_gpus(SandboxConfig()) is None
    with pytest.raises(
        CampaignError, match=r"sandbox.gpus = \[0, 3\]: no GPU 3 here; this host shows 2 GPU\(s\)"
    ):
        campaign_gpus(SandboxConfig(gpus=[0, 3]))
    monkeypatch.setattr(agent.campaign, "visible_gpus", list)  # a host without a GPU
    assert campaign_gpus(SandboxConfig(gpus="all")) is None
    config = parse_config({**CONFIG, "sandbox": {"gpus": 2}})
    with pytest.raises(CampaignError, match=r"sandbox.gpus = 2, but this host shows 0 GPU\(s\)"):
        agent.campaign.Campaigns(tmp_path / "home").start(config)
    assert agent.campaign.Campaigns(tmp_path / "home").store.campaigns() == []  # nothing recorded


def test_a_winner_is_registered_only_where_its_timing_is_borne_out_on_its_own_kind(tmp_path: Path) -> None:
    """Its re-verification lands where the backend puts it: on another kind it is tried again;
    one that never reaches the kind it won on is not registered (times from a slower GPU would
    pass any winner, and from a faster one refuse it). On its kind, it is."""
    for recheck, registered in (((A100, A100, A100), False), ((A100, H100), True)):
        store = Store(tmp_path / f"{registered}.db")
        incumbent, winner = default_candidate(OP), _candidate(8)
        for c, us in ((incumbent, 100.0), (winner, 50.0)):
            store.add_candidate("c", c)
            store.add_evaluation("c", _result(c, H100, us))
        ctx, messages = _registered(tmp_path / str(registered), store, recheck, 50.0)
        assert bool(ctx.library.entries()) == registered, messages
        if not registered:
            assert any(f"never on {H100.kind} where it won, in 3 tries" in m for m in messages), messages
