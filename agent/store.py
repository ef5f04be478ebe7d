"""The candidate store: every campaign, candidate, evaluation and accepted kernel, in SQLite.

The store is the source of truth that survives a kill: the graph's checkpoints say where the
loop was, the store says what was evaluated (so a resumed campaign never re-runs a finished
evaluation) and how much budget is spent.
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from sandbox.candidate import Candidate
from sandbox.result import EvalResult, Status, TimingStats

SCHEMA = """
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
CREATE TABLE IF NOT EXISTS baselines (
    campaign_id TEXT NOT NULL, problem TEXT NOT NULL, shape_key TEXT NOT NULL,
    name TEXT NOT NULL, stats_json TEXT NOT NULL, PRIMARY KEY (campaign_id, problem, shape_key, name)
);
CREATE TABLE IF NOT EXISTS accepted (
    campaign_id TEXT NOT NULL, problem TEXT NOT NULL, candidate_id TEXT NOT NULL,
    kernel_id TEXT NOT NULL, library TEXT NOT NULL, created_at TEXT NOT NULL,
    PRIMARY KEY (campaign_id, problem, kernel_id)
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

    # baselines and acceptance
    def add_baselines(self, campaign_id: str, problem: str, result: EvalResult) -> None:
        for t in result.timings:
            for name, stats in t.baselines.items():
                self._db.execute(
                    "INSERT OR REPLACE INTO baselines VALUES (?, ?, ?, ?, ?)",
                    (campaign_id, problem, f"{t.shape}/{t.dtype}", name, stats.model_dump_json()),
                )

    def baselines(self, campaign_id: str, problem: str) -> dict[str, dict[str, TimingStats]]:
        out: dict[str, dict[str, TimingStats]] = {}
        rows = self._db.execute(
            "SELECT shape_key, name, stats_json FROM baselines WHERE campaign_id = ? AND problem = ?",
            (campaign_id, problem),
        )
        for shape_key, name, stats_json in rows:
            out.setdefault(shape_key, {})[name] = TimingStats.model_validate_json(stats_json)
        return out

    def add_accepted(
        self, campaign_id: str, problem: str, candidate_id: str, kernel_id: str, library: str
    ) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO accepted VALUES (?, ?, ?, ?, ?, ?)",
            (campaign_id, problem, candidate_id, kernel_id, library, _now()),
        )

    def accepted(self, campaign_id: str) -> list[tuple[str, str, str, str]]:
        return self._db.execute(
            "SELECT problem, candidate_id, kernel_id, library FROM accepted "
            "WHERE campaign_id = ? ORDER BY created_at",
            (campaign_id,),
        ).fetchall()
