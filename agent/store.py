"""The candidate store: every campaign, candidate, evaluation and accepted kernel, in SQLite.

The store is the source of truth that survives a kill: the graph's checkpoints say where the
loop was, the store says what was evaluated (so a resumed campaign never re-runs a finished
evaluation) and how much budget is spent.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sandbox.candidate import Candidate
from sandbox.result import EvalResult, Status, TimingStats

if TYPE_CHECKING:
    from agent.llm.preflight import Preflight

# The store's user_version from which its baselines were timed as candidates are, each call to
# its end event (sandbox.judge; Store._baselines_timed_to_end_events).
BASELINES_TIMING = 1
BASELINES_TABLE = """CREATE TABLE IF NOT EXISTS baselines (
    campaign_id TEXT NOT NULL, problem TEXT NOT NULL, kind TEXT NOT NULL, shape_key TEXT NOT NULL,
    name TEXT NOT NULL, stats_json TEXT NOT NULL, PRIMARY KEY (campaign_id, problem, kind, shape_key, name)
);"""
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS campaigns (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, config_json TEXT NOT NULL, status TEXT NOT NULL,
    stop_reason TEXT, wall_s REAL NOT NULL DEFAULT 0, created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS candidates (
    campaign_id TEXT NOT NULL, id TEXT NOT NULL, problem TEXT NOT NULL, origin TEXT NOT NULL,
    parent_id TEXT, entry TEXT NOT NULL, knobs_json TEXT NOT NULL, source TEXT NOT NULL,
    created_at TEXT NOT NULL, PRIMARY KEY (campaign_id, id)
);
CREATE TABLE IF NOT EXISTS evaluations (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, campaign_id TEXT NOT NULL, candidate_id TEXT NOT NULL,
    problem TEXT NOT NULL, status TEXT NOT NULL, score_us REAL, interpreted INTEGER NOT NULL,
    result_json TEXT NOT NULL, created_at TEXT NOT NULL, UNIQUE (campaign_id, candidate_id)
);
-- Baselines as timed on each kind of device (DeviceInfo.kind): a candidate is compared only with
-- those of the kind it ran on. (Stores from before kinds: Store._baselines_by_kind.)
{BASELINES_TABLE}
-- Incumbents (the kernels dispatch runs today) measured again on another kind of device, beside
-- a proposal that ran on it (sandbox.backend.Alongside); their first measurement is in evaluations.
CREATE TABLE IF NOT EXISTS incumbent_evaluations (
    campaign_id TEXT NOT NULL, kind TEXT NOT NULL, candidate_id TEXT NOT NULL, problem TEXT NOT NULL,
    result_json TEXT NOT NULL, created_at TEXT NOT NULL, PRIMARY KEY (campaign_id, kind, candidate_id)
);
CREATE TABLE IF NOT EXISTS accepted (
    campaign_id TEXT NOT NULL, problem TEXT NOT NULL, candidate_id TEXT NOT NULL,
    kernel_id TEXT NOT NULL, library TEXT NOT NULL, created_at TEXT NOT NULL,
    PRIMARY KEY (campaign_id, problem, kernel_id)
);
-- One row per HTTP request to the LLM, retries included: what was sent, what came back, what it
-- cost and what became of it. Token and money budgets are sums over this table, so they survive
-- a kill. outcome: replied (recorded, not yet read: a kill came between), proposal, invalid, or
-- the transport failure (timeout, connection, http_<code>, garbage).
CREATE TABLE IF NOT EXISTS llm_exchanges (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, campaign_id TEXT NOT NULL, problem TEXT NOT NULL,
    conversation TEXT NOT NULL, turn INTEGER NOT NULL, attempt INTEGER NOT NULL, model TEXT NOT NULL,
    request_json TEXT NOT NULL, response_text TEXT, outcome TEXT NOT NULL, error TEXT,
    prompt_tokens INTEGER NOT NULL DEFAULT 0, completion_tokens INTEGER NOT NULL DEFAULT 0,
    cost REAL NOT NULL DEFAULT 0, latency_s REAL NOT NULL, candidate_id TEXT, created_at TEXT NOT NULL,
    finish_reason TEXT
);
CREATE INDEX IF NOT EXISTS llm_exchanges_campaign ON llm_exchanges (campaign_id);
-- Each fresh conversation with the LLM: the kernel it improves (parent_id; NULL: the template at
-- its defaults), and whether it has concluded (with a proposal, or given up). One cut short after
-- a reply (a kill, an outage) continues from its turns in llm_exchanges.
CREATE TABLE IF NOT EXISTS llm_conversations (
    campaign_id TEXT NOT NULL, id TEXT NOT NULL, problem TEXT NOT NULL, parent_id TEXT,
    concluded INTEGER NOT NULL DEFAULT 0, created_at TEXT NOT NULL, PRIMARY KEY (campaign_id, id)
);
-- Each candidate the LLM proposed: its conversation (for repair turns) and repair lineage;
-- repair_tried once its repair has concluded (with a proposal, or given up).
CREATE TABLE IF NOT EXISTS llm_proposals (
    campaign_id TEXT NOT NULL, candidate_id TEXT NOT NULL, problem TEXT NOT NULL,
    conversation TEXT NOT NULL, kind TEXT NOT NULL, rationale TEXT NOT NULL, depth INTEGER NOT NULL,
    repair_of TEXT, messages_json TEXT NOT NULL, repair_tried INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL, PRIMARY KEY (campaign_id, candidate_id)
);
-- Outage pauses of the LLM proposer (wall-clock seconds since the epoch).
CREATE TABLE IF NOT EXISTS llm_pauses (
    campaign_id TEXT NOT NULL, started REAL NOT NULL, until REAL NOT NULL, reason TEXT NOT NULL
);
-- What the LLM endpoint's pre-flight learned at each start and resume (agent.llm.preflight).
CREATE TABLE IF NOT EXISTS llm_preflights (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, campaign_id TEXT NOT NULL, preflight_json TEXT NOT NULL,
    created_at TEXT NOT NULL
);
"""


_CANDIDATE_COLUMNS = "c.problem, c.origin, c.parent_id, c.entry, c.knobs_json, c.source"


def _candidate(row) -> Candidate:
    problem, origin, parent_id, entry, knobs_json, source = row
    return Candidate(
        problem=problem,
        origin=origin,
        parent_id=parent_id,
        entry=entry,
        knobs=json.loads(knobs_json),
        source=source,
    )


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class CampaignRow:
    id: str
    name: str
    config_json: str
    status: str
    stop_reason: str | None
    wall_s: float
    created_at: str
    updated_at: str


@dataclass(frozen=True)
class LLMSpent:
    requests: int
    failed_requests: int  # timeouts, HTTP errors, garbage
    prompt_tokens: int
    completion_tokens: int
    cost: float

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class LLMReply:
    """A reply of the LLM as recorded: the request that got it (the conversation before it) and
    what became of it (replied: not yet read)."""

    seq: int
    turn: int
    request: dict
    text: str
    finish_reason: str | None
    outcome: str
    error: str | None


@dataclass(frozen=True)
class LLMProposalRow:
    candidate_id: str
    conversation: str
    kind: str
    rationale: str
    depth: int
    repair_of: str | None
    messages: list[dict]


# The phases of an evaluation that run kernels on its device, and so count against the GPU-seconds
# budget: the worker's checks and timing, and a suspicious result's re-measurement in a fresh
# worker (`remeasure`, added by the campaign), and a first run whose judge ran out of device
# memory beside other evaluations before the backend ran it again alone
# (`beside_out_of_memory`: it failed without phases, and its checks and timing ran). Not counted:
# the worker's start-up, the candidate's import, `lock_wait` (the judge waiting for the GPU's
# lock while other evaluations time or check: judge-side time, though the runner may still have
# work of its own on the device), and the re-verification of winners at registration, which runs
# after the budgets have stopped the loop.
DEVICE_PHASES = ("check", "timing", "remeasure", "beside_out_of_memory")


def device_seconds(result: EvalResult) -> float:
    return sum(result.phase_s.get(phase, 0.0) for phase in DEVICE_PHASES)


# The model's own fault, not the endpoint's: these are not transport failures.
_MODEL_OUTCOMES = ("replied", "proposal", "invalid")


@dataclass(frozen=True)
class EvaluationRow:
    seq: int
    candidate: Candidate
    result: EvalResult

    @property
    def score_us(self) -> float | None:
        return self.result.geomean_us() if self.result.status == Status.OK else None


class Store:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=10000")
        self._db.executescript(SCHEMA)
        self._add_columns()
        self._baselines_by_kind()
        self._baselines_timed_to_end_events()

    def _columns(self, table: str) -> set[str]:
        return {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}

    def _add_columns(self) -> None:
        """Columns added since a store was created (CREATE TABLE IF NOT EXISTS keeps its tables)."""
        if "finish_reason" not in self._columns("llm_exchanges"):
            self._db.execute("ALTER TABLE llm_exchanges ADD COLUMN finish_reason TEXT")

    def _baselines_by_kind(self) -> None:
        """A store from before baselines were kept per kind of device: each campaign timed a
        problem's baselines once, with the first correct evaluation asked to (the problem's
        first evaluation, alone), on the one host it ran on. Its rows take the kind of the
        device of that evaluation, the first correct one whose timings hold baselines; where
        none says (no such evaluation, or none with a device), they are dropped, and a resumed
        campaign times them again with its next evaluation."""

        def migrate() -> None:
            self._db.execute("ALTER TABLE baselines RENAME TO baselines_without_kind")
            self._db.execute(BASELINES_TABLE)
            pairs = self._db.execute(
                "SELECT DISTINCT campaign_id, problem FROM baselines_without_kind"
            ).fetchall()
            for campaign_id, problem in pairs:
                kind = self._kind_that_timed_baselines(campaign_id, problem)
                if kind is None:
                    continue
                self._db.execute(
                    "INSERT INTO baselines SELECT campaign_id, problem, ?, shape_key, name, stats_json "
                    "FROM baselines_without_kind WHERE campaign_id = ? AND problem = ?",
                    (kind, campaign_id, problem),
                )
            self._db.execute("DROP TABLE baselines_without_kind")

        self._migrate(lambda: "kind" in self._columns("baselines"), migrate)

    def _baselines_timed_to_end_events(self) -> None:
        """A store from before the judge timed baselines as it times candidates (each call to its
        end event on the current stream, not past a device-wide synchronize: 12 us more a call
        on an H100, which made candidates look faster at small calls): its baselines are dropped,
        and a resumed campaign times them again with its next evaluation on each kind of device.
        The store's user_version says it is done (BASELINES_TIMING)."""

        def migrate() -> None:
            self._db.execute("DELETE FROM baselines")
            self._db.execute(f"PRAGMA user_version = {BASELINES_TIMING}")

        self._migrate(
            lambda: self._db.execute("PRAGMA user_version").fetchone()[0] >= BASELINES_TIMING, migrate
        )

    def _migrate(self, done: Callable[[], bool], migrate: Callable[[], None]) -> None:
        """`migrate` once, in a transaction, unless `done()`: one process migrates, and the others,
        waiting for its write lock, find it done."""
        if done():
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            if not done():
                migrate()
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _kind_that_timed_baselines(self, campaign_id: str, problem: str) -> str | None:
        rows = self._db.execute(
            "SELECT result_json FROM evaluations WHERE campaign_id = ? AND problem = ? AND status = ? "
            "ORDER BY seq",
            (campaign_id, problem, Status.OK.value),
        )
        for (result_json,) in rows:
            result = EvalResult.model_validate_json(result_json)
            if result.timed_baselines:
                return result.kind
        return None

    def close(self) -> None:
        self._db.close()

    # campaigns
    def create_campaign(self, campaign_id: str, name: str, config_json: str) -> None:
        now = _now()
        self._db.execute(
            "INSERT INTO campaigns VALUES (?, ?, ?, 'running', NULL, 0, ?, ?)",
            (campaign_id, name, config_json, now, now),
        )

    def campaign(self, campaign_id: str) -> CampaignRow | None:
        row = self._db.execute("SELECT * FROM campaigns WHERE id = ?", (campaign_id,)).fetchone()
        return CampaignRow(*row) if row else None

    def campaigns(self) -> list[CampaignRow]:
        rows = self._db.execute("SELECT * FROM campaigns ORDER BY created_at DESC").fetchall()
        return [CampaignRow(*r) for r in rows]

    def set_status(self, campaign_id: str, status: str, stop_reason: str | None = None) -> None:
        self._db.execute(
            "UPDATE campaigns SET status = ?, stop_reason = ?, updated_at = ? WHERE id = ?",
            (status, stop_reason, _now(), campaign_id),
        )

    def set_wall(self, campaign_id: str, wall_s: float) -> None:
        self._db.execute(
            "UPDATE campaigns SET wall_s = ?, updated_at = ? WHERE id = ?", (wall_s, _now(), campaign_id)
        )

    # candidates and evaluations
    def add_candidate(self, campaign_id: str, c: Candidate) -> None:
        self._db.execute(
            "INSERT OR IGNORE INTO candidates VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                campaign_id,
                c.id,
                c.problem,
                c.origin,
                c.parent_id,
                c.entry,
                json.dumps(c.knobs, sort_keys=True),
                c.source,
                _now(),
            ),
        )

    def candidate(self, campaign_id: str, candidate_id: str) -> Candidate:
        row = self._db.execute(
            f"SELECT {_CANDIDATE_COLUMNS} FROM candidates c WHERE c.campaign_id = ? AND c.id = ?",
            (campaign_id, candidate_id),
        ).fetchone()
        if row is None:
            raise KeyError(f"no candidate {candidate_id} in campaign {campaign_id}")
        return _candidate(row)

    def add_evaluation(self, campaign_id: str, result: EvalResult) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO evaluations (campaign_id, candidate_id, problem, status, "
            "score_us, interpreted, result_json, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                campaign_id,
                result.candidate_id,
                result.problem,
                result.status.value,
                result.geomean_us() if result.status == Status.OK else None,
                int(result.interpreted),
                result.model_dump_json(),
                _now(),
            ),
        )

    def is_evaluated(self, campaign_id: str, candidate_id: str) -> bool:
        return (
            self._db.execute(
                "SELECT 1 FROM evaluations WHERE campaign_id = ? AND candidate_id = ?",
                (campaign_id, candidate_id),
            ).fetchone()
            is not None
        )

    def count_evaluations(self, campaign_id: str, problem: str | None = None) -> int:
        sql, args = "SELECT COUNT(*) FROM evaluations WHERE campaign_id = ?", [campaign_id]
        if problem is not None:
            sql, args = sql + " AND problem = ?", [*args, problem]
        return self._db.execute(sql, args).fetchone()[0]

    def evaluations(
        self, campaign_id: str, problem: str | None = None, *, best_only: bool = False
    ) -> list[EvaluationRow]:
        """Evaluations in order, with their candidates (one query). `best_only`: just the
        fastest correct one, if any."""
        sql = (
            f"SELECT e.seq, e.result_json, {_CANDIDATE_COLUMNS} FROM evaluations e "
            "JOIN candidates c ON c.campaign_id = e.campaign_id AND c.id = e.candidate_id "
            "WHERE e.campaign_id = ?"
        )
        args: list = [campaign_id]
        if problem is not None:
            sql, args = sql + " AND e.problem = ?", [*args, problem]
        if best_only:
            sql += " AND e.score_us IS NOT NULL ORDER BY e.score_us LIMIT 1"
        else:
            sql += " ORDER BY e.seq"
        return [
            EvaluationRow(seq, _candidate(rest), EvalResult.model_validate_json(result_json))
            for seq, result_json, *rest in self._db.execute(sql, args).fetchall()
        ]

    def device_seconds(self, campaign_id: str) -> float:
        """`device_seconds` summed over the campaign's evaluations and its incumbents' measurements
        on other kinds of device, in SQL (no result parsed)."""
        terms = " + ".join(f"COALESCE(json_extract(result_json, '$.phase_s.{p}'), 0)" for p in DEVICE_PHASES)
        total = 0.0
        for table in ("evaluations", "incumbent_evaluations"):
            row = self._db.execute(
                f"SELECT COALESCE(SUM({terms}), 0) FROM {table} WHERE campaign_id = ?", (campaign_id,)
            ).fetchone()
            total += float(row[0])
        return total

    def evaluation_times(self, campaign_id: str) -> dict[int, str]:
        """When each evaluation was recorded (seq -> ISO time, UTC)."""
        rows = self._db.execute(
            "SELECT seq, created_at FROM evaluations WHERE campaign_id = ?", (campaign_id,)
        ).fetchall()
        return dict(rows)

    # baselines and acceptance
    def add_baselines(self, campaign_id: str, problem: str, result: EvalResult) -> None:
        """The baselines `result`'s judge timed, as those of the kind of device it ran on."""
        kind = result.kind
        assert kind is not None, "baselines are timed by a judge, which always names its device"
        for t in result.timings:
            for name, stats in t.baselines.items():
                self._db.execute(
                    "INSERT OR REPLACE INTO baselines VALUES (?, ?, ?, ?, ?, ?)",
                    (campaign_id, problem, kind, f"{t.shape}/{t.dtype}", name, stats.model_dump_json()),
                )

    def baselines(
        self, campaign_id: str, problem: str, kind: str | None
    ) -> dict[str, dict[str, TimingStats]]:
        """Shape key -> name -> stats of the baselines timed on `kind` of device (DeviceInfo.kind;
        None, a result that ran on none: no baselines)."""
        out: dict[str, dict[str, TimingStats]] = {}
        rows = self._db.execute(
            "SELECT shape_key, name, stats_json FROM baselines "
            "WHERE campaign_id = ? AND problem = ? AND kind = ?",
            (campaign_id, problem, kind),
        )
        for shape_key, name, stats_json in rows:
            out.setdefault(shape_key, {})[name] = TimingStats.model_validate_json(stats_json)
        return out

    def baseline_kinds(self, campaign_id: str, problem: str) -> list[str]:
        """The kinds of device on which `problem`'s baselines have been timed."""
        rows = self._db.execute(
            "SELECT DISTINCT kind FROM baselines WHERE campaign_id = ? AND problem = ? ORDER BY kind",
            (campaign_id, problem),
        )
        return [kind for (kind,) in rows]

    def add_incumbent_evaluation(self, campaign_id: str, candidate: Candidate, result: EvalResult) -> None:
        """An incumbent measured again on another kind of device (the first measurement on each
        kind is kept: what the campaign's later comparisons on it have used)."""
        assert result.kind is not None
        self.add_candidate(campaign_id, candidate)
        self._db.execute(
            "INSERT OR IGNORE INTO incumbent_evaluations VALUES (?, ?, ?, ?, ?, ?)",
            (campaign_id, result.kind, candidate.id, candidate.problem, result.model_dump_json(), _now()),
        )

    def incumbent_evaluations(self, campaign_id: str, problem: str) -> list[EvaluationRow]:
        """The measurements of `problem`'s incumbents on other kinds of device than their first
        (in `evaluations`), in order; their seq counts apart from the evaluations'."""
        rows = self._db.execute(
            f"SELECT i.rowid, i.result_json, {_CANDIDATE_COLUMNS} FROM incumbent_evaluations i "
            "JOIN candidates c ON c.campaign_id = i.campaign_id AND c.id = i.candidate_id "
            "WHERE i.campaign_id = ? AND i.problem = ? ORDER BY i.rowid",
            (campaign_id, problem),
        )
        return [
            EvaluationRow(seq, _candidate(rest), EvalResult.model_validate_json(result_json))
            for seq, result_json, *rest in rows.fetchall()
        ]

    def add_accepted(
        self, campaign_id: str, problem: str, candidate_id: str, kernel_id: str, library: str
    ) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO accepted VALUES (?, ?, ?, ?, ?, ?)",
            (campaign_id, problem, candidate_id, kernel_id, library, _now()),
        )

    def last_accepted(self) -> tuple[str, str] | None:
        """(campaign, library) of the kernel registered last, by any campaign of this store."""
        return self._db.execute(
            "SELECT campaign_id, library FROM accepted ORDER BY created_at DESC, rowid DESC LIMIT 1"
        ).fetchone()

    def accepted(self, campaign_id: str) -> list[tuple[str, str, str, str]]:
        return self._db.execute(
            "SELECT problem, candidate_id, kernel_id, library FROM accepted "
            "WHERE campaign_id = ? ORDER BY created_at",
            (campaign_id,),
        ).fetchall()

    # LLM exchanges, proposals and pauses
    def add_llm_exchange(
        self,
        campaign_id: str,
        *,
        problem: str,
        conversation: str,
        turn: int,
        attempt: int,
        model: str,
        request_json: str,
        response_text: str | None,
        finish_reason: str | None,
        outcome: str,
        error: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        cost: float,
        latency_s: float,
    ) -> int:
        cursor = self._db.execute(
            "INSERT INTO llm_exchanges (campaign_id, problem, conversation, turn, attempt, model, "
            "request_json, response_text, finish_reason, outcome, error, prompt_tokens, completion_tokens, "
            f"cost, latency_s, created_at) VALUES ({', '.join('?' * 16)})",
            (
                campaign_id,
                problem,
                conversation,
                turn,
                attempt,
                model,
                request_json,
                response_text,
                finish_reason,
                outcome,
                error,
                prompt_tokens,
                completion_tokens,
                cost,
                latency_s,
                _now(),
            ),
        )
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def set_llm_outcome(
        self, seq: int, outcome: str, error: str | None = None, candidate_id: str | None = None
    ) -> None:
        self._db.execute(
            "UPDATE llm_exchanges SET outcome = ?, error = ?, candidate_id = ? WHERE seq = ?",
            (outcome, error, candidate_id, seq),
        )

    def last_llm_reply(self, campaign_id: str, conversation: str, since_turn: int) -> LLMReply | None:
        """The conversation's latest reply at `since_turn` or later, if any."""
        row = self._db.execute(
            "SELECT seq, turn, request_json, response_text, finish_reason, outcome, error FROM llm_exchanges "
            "WHERE campaign_id = ? AND conversation = ? AND turn >= ? AND response_text IS NOT NULL "
            "ORDER BY seq DESC LIMIT 1",
            (campaign_id, conversation, since_turn),
        ).fetchone()
        if row is None:
            return None
        seq, turn, request_json, *rest = row
        return LLMReply(seq, turn, json.loads(request_json), *rest)

    def llm_exchanges(self, campaign_id: str) -> list[dict]:
        cursor = self._db.execute(
            "SELECT * FROM llm_exchanges WHERE campaign_id = ? ORDER BY seq", (campaign_id,)
        )
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def llm_spent(self, campaign_id: str) -> LLMSpent:
        marks = ", ".join("?" * len(_MODEL_OUTCOMES))
        row = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(outcome NOT IN (" + marks + ")), 0), "
            "COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(cost), 0) "
            "FROM llm_exchanges WHERE campaign_id = ?",
            (*_MODEL_OUTCOMES, campaign_id),
        ).fetchone()
        return LLMSpent(*row)

    def add_llm_conversation(
        self, campaign_id: str, conversation: str, *, problem: str, parent_id: str | None
    ) -> None:
        self._db.execute(
            "INSERT INTO llm_conversations VALUES (?, ?, ?, ?, 0, ?)",
            (campaign_id, conversation, problem, parent_id, _now()),
        )

    def open_llm_conversations(self, campaign_id: str, problem: str) -> list[tuple[str, str | None]]:
        """Fresh conversations for `problem` cut short after a reply (a kill, an outage) and not
        concluded, oldest first: (id, parent_id)."""
        return self._db.execute(
            "SELECT c.id, c.parent_id FROM llm_conversations c "
            "WHERE c.campaign_id = ? AND c.problem = ? AND c.concluded = 0 AND EXISTS (SELECT 1 "
            "FROM llm_exchanges e WHERE e.campaign_id = c.campaign_id AND e.conversation = c.id "
            "AND e.response_text IS NOT NULL) ORDER BY c.rowid",
            (campaign_id, problem),
        ).fetchall()

    def conclude_llm_ask(self, campaign_id: str, conversation: str, repair_of: str | None) -> None:
        """An ask for a proposal has ended, with one or given up: a repair marks the kernel it
        repairs as tried, a fresh proposal concludes its conversation. Neither is continued."""
        if repair_of is None:
            self._db.execute(
                "UPDATE llm_conversations SET concluded = 1 WHERE campaign_id = ? AND id = ?",
                (campaign_id, conversation),
            )
        else:
            self._db.execute(
                "UPDATE llm_proposals SET repair_tried = 1 WHERE campaign_id = ? AND candidate_id = ?",
                (campaign_id, repair_of),
            )

    def add_llm_proposal(
        self,
        campaign_id: str,
        *,
        seq: int,
        candidate: Candidate,
        problem: str,
        conversation: str,
        kind: str,
        rationale: str,
        depth: int,
        repair_of: str | None,
        messages: list[dict],
    ) -> None:
        """The reply `seq` became a proposal: its outcome, the proposal with its candidate and the
        end of its ask (conclude_llm_ask) in one transaction, so a kill leaves all or none, and a
        resume evaluates every stored proposal first (unevaluated_llm_proposals)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self.set_llm_outcome(seq, "proposal", None, candidate.id)
            self.add_candidate(campaign_id, candidate)
            self._db.execute(
                "INSERT OR IGNORE INTO llm_proposals VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                (
                    campaign_id,
                    candidate.id,
                    problem,
                    conversation,
                    kind,
                    rationale,
                    depth,
                    repair_of,
                    json.dumps(messages),
                    _now(),
                ),
            )
            self.conclude_llm_ask(campaign_id, conversation, repair_of)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def unevaluated_llm_proposals(self, campaign_id: str, problem: str) -> list[Candidate]:
        """The LLM's stored proposals for `problem` that no evaluation has seen yet, oldest first:
        paid for before a kill, and evaluated first after the resume."""
        rows = self._db.execute(
            f"SELECT {_CANDIDATE_COLUMNS} FROM candidates c JOIN llm_proposals p "
            "ON p.campaign_id = c.campaign_id AND p.candidate_id = c.id "
            "WHERE c.campaign_id = ? AND c.problem = ? AND NOT EXISTS (SELECT 1 FROM evaluations e "
            "WHERE e.campaign_id = c.campaign_id AND e.candidate_id = c.id) ORDER BY p.created_at",
            (campaign_id, problem),
        ).fetchall()
        return [_candidate(r) for r in rows]

    def llm_proposals(self, campaign_id: str, problem: str) -> dict[str, LLMProposalRow]:
        rows = self._db.execute(
            "SELECT candidate_id, conversation, kind, rationale, depth, repair_of, messages_json "
            "FROM llm_proposals WHERE campaign_id = ? AND problem = ?",
            (campaign_id, problem),
        ).fetchall()
        return {r[0]: LLMProposalRow(*r[:6], messages=json.loads(r[6])) for r in rows}

    def llm_repairables(
        self, campaign_id: str, problem: str, statuses: tuple[str, ...], max_depth: int
    ) -> list[LLMProposalRow]:
        """LLM proposals that were evaluated with one of `statuses`, are less than `max_depth`
        repairs deep and whose repair has not concluded (not begun, or cut short); the most
        recently evaluated first."""
        marks = ", ".join("?" * len(statuses))
        rows = self._db.execute(
            "SELECT p.candidate_id, p.conversation, p.kind, p.rationale, p.depth, p.repair_of, "
            "p.messages_json FROM llm_proposals p JOIN evaluations e "
            "ON e.campaign_id = p.campaign_id AND e.candidate_id = p.candidate_id "
            f"WHERE p.campaign_id = ? AND p.problem = ? AND p.repair_tried = 0 AND p.depth < ? "
            f"AND e.status IN ({marks}) ORDER BY e.seq DESC",
            (campaign_id, problem, max_depth, *statuses),
        ).fetchall()
        return [LLMProposalRow(*r[:6], messages=json.loads(r[6])) for r in rows]

    def add_llm_pause(self, campaign_id: str, started: float, until: float, reason: str) -> None:
        self._db.execute("INSERT INTO llm_pauses VALUES (?, ?, ?, ?)", (campaign_id, started, until, reason))

    def clear_llm_stops(self, campaign_id: str) -> None:
        """Lift the LLM proposer's stops for good (pauses until infinity), keeping the rest."""
        self._db.execute(
            "DELETE FROM llm_pauses WHERE campaign_id = ? AND until = ?", (campaign_id, math.inf)
        )

    def add_llm_preflight(self, campaign_id: str, preflight: Preflight) -> None:
        self._db.execute(
            "INSERT INTO llm_preflights (campaign_id, preflight_json, created_at) VALUES (?, ?, ?)",
            (campaign_id, preflight.model_dump_json(), _now()),
        )

    def llm_preflight(self, campaign_id: str) -> Preflight | None:
        """What the campaign's last pre-flight learned (None: it has none, it uses no LLM)."""
        from agent.llm.preflight import Preflight

        row = self._db.execute(
            "SELECT preflight_json FROM llm_preflights WHERE campaign_id = ? ORDER BY seq DESC LIMIT 1",
            (campaign_id,),
        ).fetchone()
        return None if row is None else Preflight.model_validate_json(row[0])

    def llm_pauses(self, campaign_id: str) -> list[tuple[float, float, str]]:
        return self._db.execute(
            "SELECT started, until, reason FROM llm_pauses WHERE campaign_id = ? ORDER BY started",
            (campaign_id,),
        ).fetchall()
