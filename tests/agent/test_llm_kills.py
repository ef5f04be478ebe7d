"""Nothing paid for is lost at a kill: a real campaign process, against the scripted loopback
server, kills itself at a failpoint (agent/failpoints.py) between paying for a reply and using
it; the campaign is resumed here and must neither ask the server again for what it already
answered nor evaluate anything twice."""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path

import pytest
from llm_helpers import BROKEN, BROKEN_LINE, GOOD, KEY, KEY_ENV, campaign_child, config, knob_replies
from llm_server import FakeLLMServer, Reply, proposal
from quick_backend import QuickBackend

import agent.campaign
from agent.campaign import Campaigns
from agent.failpoints import ENV
from agent.store import SCHEMA, Store
from sandbox.result import Status

KNOBS = proposal("knobs", knobs={"BLOCK_B": 8, "num_warps": 4})
NOT_JSON = "{'kind': 'knobs', not json"


@pytest.fixture(autouse=True)
def resumable(monkeypatch) -> None:
    """The key the campaigns' config names, and the quick backend for the resumes run here."""
    monkeypatch.setenv(KEY_ENV, KEY)
    backend = QuickBackend()
    monkeypatch.setattr(agent.campaign, "make_backend", lambda *a, **k: backend)


def _killed_at(point: str, tmp_path: Path, server: FakeLLMServer, evaluations: int) -> tuple[Campaigns, str]:
    """A campaign of `evaluations` evaluations against `server`, run until it kills itself at
    `point`: its campaigns and its id."""
    cfg = config(tmp_path, server.url, budget={"max_evaluations": evaluations, "max_wall_s": 600})
    child = campaign_child(tmp_path, cfg, tmp_path / "home", **{ENV: point})
    try:
        assert child.wait(timeout=120) == -signal.SIGKILL, (tmp_path / "child.log").read_text()
    finally:
        if child.poll() is None:  # it never got there
            child.kill()
            child.wait()
    campaigns = Campaigns(tmp_path / "home")
    [row] = campaigns.store.campaigns()
    return campaigns, row.id


def _evaluated_once(store: Store, campaign_id: str) -> list[str]:
    ids = [r.candidate.id for r in store.evaluations(campaign_id)]
    assert len(ids) == len(set(ids)), "an evaluation was repeated"
    return ids


@pytest.mark.parametrize("point", ["after-reply-recorded", "after-outcome"])
@pytest.mark.slow
def test_a_reply_paid_for_before_a_kill_is_evaluated_after_the_resume_without_asking_again(
    tmp_path: Path, point: str
) -> None:
    """Killed once the reply is recorded (not yet read), or once it is recorded as a proposal
    with its candidate (not yet evaluated): the resume evaluates that proposal and sends nothing."""
    with FakeLLMServer([Reply(KNOBS)], default=knob_replies()) as server:
        campaigns, cid = _killed_at(point, tmp_path, server, evaluations=2)
        [paid] = campaigns.store.llm_exchanges(cid)
        if point == "after-outcome":  # the outcome and the candidate it names, both or neither
            assert campaigns.store.candidate(cid, paid["candidate_id"]).origin == "llm"
        outcome = campaigns.resume(cid)
    assert outcome.stop_reason == "evaluation budget reached (2 of 2)"
    assert len(server.requests) == 1
    [paid] = campaigns.store.llm_exchanges(cid)
    assert paid["outcome"] == "proposal"
    assert _evaluated_once(campaigns.store, cid)[1] == paid["candidate_id"]  # after the incumbent


@pytest.mark.slow
def test_a_reask_cut_short_by_a_kill_continues_from_its_recorded_turns(tmp_path: Path) -> None:
    """Killed after an unusable reply is recorded, before it is asked again: the resume sends
    the re-ask of that conversation (the reply and the reason it was unusable), not a new one."""
    with FakeLLMServer([Reply(NOT_JSON), Reply(KNOBS)], default=knob_replies()) as server:
        campaigns, cid = _killed_at("mid-reask", tmp_path, server, evaluations=2)
        outcome = campaigns.resume(cid)
    assert outcome.stop_reason == "evaluation budget reached (2 of 2)"
    first, reask = server.requests
    assert reask["messages"][:-2] == first["messages"]
    assert reask["messages"][-2] == {"role": "assistant", "content": NOT_JSON}
    assert "not valid JSON" in reask["messages"][-1]["content"]
    invalid, paid = campaigns.store.llm_exchanges(cid)
    assert (invalid["outcome"], paid["outcome"]) == ("invalid", "proposal")
    assert (paid["conversation"], paid["turn"]) == (invalid["conversation"], 1)
    assert _evaluated_once(campaigns.store, cid)[1] == paid["candidate_id"]


@pytest.mark.slow
def test_a_repair_cut_short_by_a_kill_continues_from_its_recorded_turns(tmp_path: Path) -> None:
    """A broken kernel goes back for repair; killed after the repair's unusable reply is
    recorded: the resume asks again within the repair (not the repair from its start), and the
    repaired kernel is what it evaluates."""
    script = [
        Reply(proposal("module", source=BROKEN)),
        Reply(NOT_JSON),
        Reply(proposal("edit", edits=[{"search": BROKEN_LINE, "replace": ""}])),
    ]
    with FakeLLMServer(script, default=knob_replies()) as server:
        campaigns, cid = _killed_at("mid-repair", tmp_path, server, evaluations=3)
        broken = campaigns.store.evaluations(cid)[-1]
        assert broken.result.status == Status.COMPILE_ERROR
        outcome = campaigns.resume(cid)
    assert outcome.stop_reason == "evaluation budget reached (3 of 3)"
    _, repair, reask = server.requests
    assert reask["messages"][:-2] == repair["messages"]
    assert reask["messages"][-2] == {"role": "assistant", "content": NOT_JSON}
    assert "compile_error" in repair["messages"][-1]["content"]
    fixed = campaigns.store.evaluations(cid)[-1]
    assert fixed.candidate.source == GOOD and fixed.candidate.parent_id == broken.candidate.id
    assert [e["outcome"] for e in campaigns.store.llm_exchanges(cid)] == ["proposal", "invalid", "proposal"]
    _evaluated_once(campaigns.store, cid)


def test_a_store_from_before_finish_reasons_were_recorded_records_them(tmp_path: Path) -> None:
    """A reply cut off at max_tokens is read as cut off after a resume too: its finish reason is
    recorded with it, also in a store whose table of exchanges predates that column."""
    before = SCHEMA.replace(",\n    finish_reason TEXT", "")
    assert before != SCHEMA
    with sqlite3.connect(tmp_path / "store.db") as db:
        db.executescript(before)
    store = Store(tmp_path / "store.db")
    store.add_llm_exchange(
        "c", problem="embedding_bag", conversation="a", turn=0, attempt=0, model="m",
        request_json=json.dumps({"messages": [], "max_tokens": 64}), response_text='{"kind": "kno',
        finish_reason="length", outcome="replied", error=None, prompt_tokens=1, completion_tokens=64,
        cost=0.0, latency_s=0.1,
    )  # fmt: skip
    reply = store.last_llm_reply("c", "a", since_turn=0)
    assert reply is not None and (reply.finish_reason, reply.outcome) == ("length", "replied")
