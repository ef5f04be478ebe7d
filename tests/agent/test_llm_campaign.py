"""LLM campaigns end to end: the real `openai` client against a scripted OpenAI-compatible
server on loopback, the real campaign graph and store, and the quick in-process backend
(`quick_backend`), so a campaign takes seconds."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from llm_helpers import (
    BROKEN,
    BROKEN_LINE,
    GOOD,
    KEY,
    KEY_ENV,
    STORE_GOOD,
    STORE_WRONG,
    campaign_child,
    config,
    knob_replies,
)
from llm_server import Fail, FakeLLMServer, Garbage, Reply, prompt_tokens, proposal
from quick_backend import QuickBackend, hashed_speed
from typer.testing import CliRunner

import agent.campaign
from agent.campaign import CampaignError, Campaigns
from agent.cli import app
from agent.proposers.knob_source import structure_key
from sandbox.result import Status


class Recorder:
    def __init__(self) -> None:
        self.messages: list[str] = []

    def evaluated(self, result, best_speedup) -> None:
        pass

    def progress(self, progress) -> None:
        pass

    def message(self, text: str) -> None:
        self.messages.append(text)


@pytest.fixture
def quick(monkeypatch) -> QuickBackend:
    backend = QuickBackend()
    monkeypatch.setattr(agent.campaign, "make_backend", lambda *a, **k: backend)
    return backend


@pytest.fixture(autouse=True)
def api_key(monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


def _user(request: dict) -> str:
    return request["messages"][-1]["content"]


def test_retries_malformed_output_and_repair_turns(tmp_path: Path, quick: QuickBackend) -> None:
    script = [
        Garbage(),  # a 200 that is not a chat completion: retried
        Fail(429, {"retry-after-ms": "5"}),  # a rate limit: retried after Retry-After
        Reply("{'kind': 'module', not json", prompt_tokens=100, completion_tokens=50),  # re-asked
        Reply(proposal("module", source=BROKEN), prompt_tokens=100, completion_tokens=50),
        # repair of the broken kernel: an edit that fixes the import and breaks the sum
        Reply(
            proposal(
                "edit",
                edits=[
                    {"search": BROKEN_LINE, "replace": ""},
                    {"search": STORE_GOOD, "replace": STORE_WRONG},
                ],
            ),
            prompt_tokens=100,
            completion_tokens=50,
        ),
        Reply(
            proposal("knobs", knobs={"BLOCK_B": 8, "num_warps": 4}), prompt_tokens=100, completion_tokens=50
        ),
        # repair of the wrong kernel
        Reply(
            proposal("edit", edits=[{"search": STORE_WRONG, "replace": STORE_GOOD}]),
            prompt_tokens=100,
            completion_tokens=50,
        ),
    ]
    with FakeLLMServer(script) as server:
        campaigns = Campaigns(tmp_path / "home")
        outcome = campaigns.start(config(tmp_path, server.url))
    cid = outcome.campaign_id
    assert outcome.stop_reason == "evaluation budget reached (5 of 5)"
    rows = campaigns.store.evaluations(cid)
    default, broken, wrong, knobs, fixed = rows
    assert default.candidate.origin == "library"
    assert [r.result.status for r in rows] == [
        Status.OK,
        Status.COMPILE_ERROR,
        Status.WRONG,
        Status.OK,
        Status.OK,
    ], [r.result.message for r in rows]
    assert fixed.candidate.source == GOOD
    # Lineage: each repair descends from the attempt it fixed; fresh proposals from the best.
    assert broken.candidate.parent_id is None
    assert wrong.candidate.parent_id == broken.candidate.id
    assert fixed.candidate.parent_id == wrong.candidate.id
    assert knobs.candidate.parent_id == default.candidate.id
    assert knobs.candidate.knobs["BLOCK_B"] == 8 and all(r.candidate.origin == "llm" for r in rows[1:])

    exchanges = campaigns.store.llm_exchanges(cid)
    assert [e["outcome"] for e in exchanges] == ["garbage", "rate_limited", "invalid", *["proposal"] * 4]
    assert [e["attempt"] for e in exchanges[:4]] == [0, 1, 2, 0]
    assert "not valid JSON" in exchanges[2]["error"]
    spent = campaigns.store.llm_spent(cid)
    assert (spent.requests, spent.failed_requests, spent.tokens) == (7, 2, 5 * 150)

    requests = server.requests
    first = requests[0]["messages"]
    # The screen's allowlist.
    assert first[0]["role"] == "system" and "torch.empty_like" in first[0]["content"]
    for needed in ("def reference(", "Timed (realistic)", "memory-bound", "TB/s", "KNOBS", "BLOCK_B: one of"):
        assert needed in first[1]["content"], needed
    assert requests[0]["response_format"]["type"] == "json_schema"
    assert "not valid JSON" in _user(requests[3])  # the validation error went back to the model
    # The repair continues the conversation with the evaluation's error...
    repair = requests[4]["messages"]
    assert [m["role"] for m in repair] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert "compile_error" in repair[-1]["content"] and "cdiv" in repair[-1]["content"]
    # ...and a wrong kernel goes back with where and by how much it was off.
    assert "**wrong**" in _user(requests[6]) and "max abs err" in _user(requests[6])
    # A fresh proposal sees the recent attempts of the lineage, failures included.
    assert "compile_error" in requests[5]["messages"][1]["content"]

    # The key travels in the Authorization header and nowhere else.
    assert all(h["authorization"] == f"Bearer {KEY}" for h in server.headers)
    for db in (tmp_path / "home").glob("*.db*"):
        assert KEY.encode() not in db.read_bytes(), db

    status = CliRunner().invoke(app, ["campaign", "status", cid, "--home", str(tmp_path / "home")])
    assert status.exit_code == 0 and "LLM: 7 requests (2 failed), 750 tokens" in status.output
    said = " ".join(status.output.split())
    assert "LLM requests by outcome: proposal 4, garbage 1, rate_limited 1, invalid 1" in said, said


@pytest.mark.parametrize(
    ("budget", "llm", "expected"),
    [
        ({"max_llm_tokens": 3000}, {}, "LLM token budget reached (3600 of 3000 tokens)"),
        (
            {"max_llm_cost": 5.0},
            {"cost_per_million_input_tokens": 1000.0, "cost_per_million_output_tokens": 5000.0},
            "LLM money budget reached (6.0000 of 5.0000)",
        ),
    ],
)
@pytest.mark.slow
def test_llm_budgets_stop_the_campaign(tmp_path: Path, quick, budget, llm, expected) -> None:
    with FakeLLMServer(default=knob_replies(prompt_tokens=1000, completion_tokens=200)) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(
            tmp_path, server.url, budget={"max_evaluations": 50, "max_wall_s": 600, **budget}, llm=llm
        )
        outcome = campaigns.start(cfg)
    # 1200 tokens (2 in money) a request: the third crosses the line, and no fourth is sent.
    assert outcome.stop_reason == expected
    assert len(server.requests) == 3
    assert campaigns.store.count_evaluations(outcome.campaign_id) == 4  # the incumbent and three proposals


@pytest.mark.slow
def test_outage_pauses_the_llm_and_search_goes_on(tmp_path: Path, quick) -> None:
    events = Recorder()
    with FakeLLMServer(default=Fail(503, {"retry-after-ms": "1"})) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(
            tmp_path,
            server.url,
            proposer={"kinds": ["llm", "search"]},
            llm={"max_retries": 1, "outage_failures": 2, "outage_cooldown_s": 3600},
        )
        outcome = campaigns.start(cfg, events)
    cid = outcome.campaign_id
    assert outcome.stop_reason == "evaluation budget reached (5 of 5)"
    # Two requests, each tried twice, then the pause: no request after it.
    assert len(server.requests) == 4
    assert [e["outcome"] for e in campaigns.store.llm_exchanges(cid)] == ["http_503"] * 4
    [(started, until, reason)] = campaigns.store.llm_pauses(cid)
    assert until - started == 3600 and "2 requests in a row failed" in reason and "http_503" in reason
    assert any("LLM proposer paused" in m for m in events.messages)
    origins = [r.candidate.origin for r in campaigns.store.evaluations(cid)]
    assert origins == ["library", "template", "template", "template", "template"]


@pytest.mark.slow
def test_llm_only_campaign_waits_out_an_outage(tmp_path: Path, quick) -> None:
    events = Recorder()
    with FakeLLMServer([Fail(500)], default=knob_replies()) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(
            tmp_path,
            server.url,
            llm={"max_retries": 0, "outage_failures": 1, "outage_cooldown_s": 1.5},
            budget={"max_evaluations": 3, "max_wall_s": 600},
        )
        start = time.monotonic()
        outcome = campaigns.start(cfg, events)
    # Nothing else could propose: the campaign waited for the pause to end, then went on.
    assert outcome.stop_reason == "evaluation budget reached (3 of 3)"
    assert time.monotonic() - start >= 1.5
    assert any("every proposer is paused; waiting" in m for m in events.messages)
    assert [r.candidate.origin for r in campaigns.store.evaluations(outcome.campaign_id)] == [
        "library",
        "llm",
        "llm",
    ]


def test_a_reask_cut_short_by_an_outage_continues_after_the_pause(tmp_path: Path, quick) -> None:
    """An unusable reply, then the re-ask fails and the LLM pauses: once the pause is over, that
    conversation is asked again where it was, not given up for a new prompt."""
    unusable = "{'kind': 'knobs', not json"
    with FakeLLMServer([Reply(unusable), Fail(503)], default=knob_replies()) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(
            tmp_path,
            server.url,
            llm={"max_retries": 0, "outage_failures": 1, "outage_cooldown_s": 0.5},
            budget={"max_evaluations": 2, "max_wall_s": 600},
        )
        outcome = campaigns.start(cfg)
    assert outcome.stop_reason == "evaluation budget reached (2 of 2)"
    first, reask, again = server.requests
    assert reask["messages"][-2] == {"role": "assistant", "content": unusable}
    assert again["messages"] == reask["messages"]
    exchanges = campaigns.store.llm_exchanges(outcome.campaign_id)
    assert [e["outcome"] for e in exchanges] == ["invalid", "http_503", "proposal"]
    assert len({e["conversation"] for e in exchanges}) == 1


def test_a_key_revoked_mid_campaign_stops_the_llm_and_the_campaign_says_why(tmp_path: Path, quick) -> None:
    """A 401 is not an outage: the LLM-only campaign ends at once with the reason, instead of
    pausing for outage_cooldown_s again and again until its wall budget is spent."""
    with FakeLLMServer([Fail(401, message="Incorrect API key provided")], default=knob_replies()) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(
            tmp_path,
            server.url,
            llm={"max_retries": 3, "outage_failures": 1, "outage_cooldown_s": 600},
            budget={"max_evaluations": 5, "max_wall_s": 600},
        )
        start = time.monotonic()
        outcome = campaigns.start(cfg)
    assert time.monotonic() - start < 120 and len(server.requests) == 1  # neither retried nor waited
    assert outcome.stop_reason.startswith("the LLM proposer stopped: auth: ")
    assert "Incorrect API key provided" in outcome.stop_reason
    [(_, until, reason)] = campaigns.store.llm_pauses(outcome.campaign_id)
    assert until == float("inf") and reason == outcome.stop_reason
    [exchange] = campaigns.store.llm_exchanges(outcome.campaign_id)
    assert exchange["outcome"] == "auth"
    # A resume whose pre-flight passes (the key fixed) lifts the stop, and only the stop.
    campaigns.store.add_llm_pause(outcome.campaign_id, 1.0, 2.0, "an outage")
    campaigns.store.clear_llm_stops(outcome.campaign_id)
    assert campaigns.store.llm_pauses(outcome.campaign_id) == [(1.0, 2.0, "an outage")]


@pytest.mark.slow
def test_search_tunes_the_kernel_the_llm_wrote(tmp_path: Path, monkeypatch) -> None:
    backend = QuickBackend(speed=lambda c: 10.0 if "LLM-written" in c.source else hashed_speed(c))
    monkeypatch.setattr(agent.campaign, "make_backend", lambda *a, **k: backend)
    script = [Reply(proposal("module", source=GOOD))]
    with FakeLLMServer(script, default=knob_replies()) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(
            tmp_path,
            server.url,
            proposer={"kinds": ["llm", "search"], "shares": {"llm": 1, "search": 1}},
            budget={"max_evaluations": 6, "max_wall_s": 600},
        )
        outcome = campaigns.start(cfg)
    rows = campaigns.store.evaluations(outcome.campaign_id)
    [written] = [r for r in rows if r.candidate.source == GOOD]
    assert outcome.best["embedding_bag"] == written.candidate.id
    tuned = [r for r in rows if r.candidate.origin == "template" and r.seq > written.seq]
    assert len(tuned) == 2
    for r in tuned:  # the LLM's module at other knob values, not the template
        assert r.candidate.parent_id == written.candidate.id
        assert structure_key(r.candidate.source) == structure_key(GOOD)
        assert "LLM-written" in r.candidate.source and r.candidate.knobs != written.candidate.knobs


def test_missing_api_key_is_one_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(KEY_ENV)
    path = tmp_path / "c.json"
    cfg = config(tmp_path, "http://127.0.0.1:9/v1")
    runner = CliRunner()
    toml = tmp_path / "c.toml"
    toml.write_text(
        f'name = "x"\nproblems = ["embedding_bag"]\n[proposer]\nkinds = ["llm"]\n'
        f'[llm]\nbase_url = "{cfg.llm.base_url}"\nmodel = "m"\napi_key_env = "{KEY_ENV}"\n'
        "[budget]\nmax_evaluations = 2\nmax_wall_s = 5\n"
    )
    result = runner.invoke(app, ["campaign", "run", str(toml), "--home", str(tmp_path / "h")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"environment variable {KEY_ENV} (llm.api_key_env) is not set" in result.output
    assert not path.exists() and not list((tmp_path / "h").glob("checkpoints.db"))


def test_llm_check_and_campaign_start_fail_fast_on_a_model_the_server_does_not_serve(tmp_path: Path) -> None:
    # The model is not listed, so each check asks for it once, and the server says 404 as vLLM does.
    with FakeLLMServer(style="vllm", models=["qwen-coder"], max_model_len=65536) as server:
        toml = tmp_path / "c.toml"

        def write(model: str) -> None:
            toml.write_text(
                f'name = "x"\nproblems = ["embedding_bag"]\n[proposer]\nkinds = ["llm"]\n'
                f'[llm]\nbase_url = "{server.url}"\nmodel = "{model}"\napi_key_env = "{KEY_ENV}"\n'
                "[budget]\nmax_evaluations = 2\nmax_wall_s = 60\n"
            )

        runner = CliRunner()
        write("qwen-coder")
        ok = runner.invoke(app, ["llm", "check", str(toml)])
        assert ok.exit_code == 0, ok.output
        said = " ".join(ok.output.split())  # the console folds long lines
        assert "serves qwen-coder" in said and "context 65536 tokens" in said
        write("qwen-coderr")
        for args in (
            ["llm", "check", str(toml)],
            ["campaign", "run", str(toml), "--home", str(tmp_path / "h")],
        ):
            result = runner.invoke(app, args)
            assert result.exit_code == 2 and "Traceback" not in result.output, result.output
            assert "does not serve this model; it serves qwen-coder" in " ".join(result.output.split())
        assert [r["max_tokens"] for r in server.requests] == [1, 1]  # one-token probes, nothing more
        assert Campaigns(tmp_path / "h").store.campaigns() == []  # nor any campaign recorded


@pytest.mark.slow
def test_sigkill_then_resume_remembers_llm_spend(tmp_path: Path, quick) -> None:
    home = tmp_path / "home"
    with FakeLLMServer(default=knob_replies(prompt_tokens=100, completion_tokens=20, delay_s=0.05)) as server:
        cfg = config(
            tmp_path, server.url, budget={"max_evaluations": 100, "max_wall_s": 600, "max_llm_tokens": 1200}
        )
        proc = campaign_child(tmp_path, cfg, home)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.05)
                if (home / "store.db").exists():
                    store = Campaigns(home).store
                    ids = [c.id for c in store.campaigns()]
                    if ids and store.count_evaluations(ids[0]) >= 1 and store.llm_spent(ids[0]).requests >= 3:
                        break
            else:
                pytest.fail("the campaign made no progress within 60 s")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # no clean shutdown: the worst case for resume
            proc.wait()
        campaigns = Campaigns(home)
        [row] = campaigns.store.campaigns()
        before = campaigns.store.llm_spent(row.id)
        assert row.status == "running" and 3 <= before.requests < 10
        sent_before = len(server.requests)

        outcome = campaigns.resume(row.id)

        after = campaigns.store.llm_spent(row.id)
        # The spend before the kill counts: the budget of ten requests is met with the rest, exactly.
        assert outcome.stop_reason == "LLM token budget reached (1200 of 1200 tokens)"
        assert after.requests == 10 and after.tokens == 1200
        assert len(server.requests) - sent_before == 10 - before.requests
    ids = [r.candidate.id for r in campaigns.store.evaluations(row.id)]
    assert len(ids) == len(set(ids)), "an evaluation was repeated"
    assert campaigns.store.campaign(row.id).status == "finished"


def test_a_knobs_reply_tunes_the_kernel_the_llm_wrote(tmp_path: Path, monkeypatch) -> None:
    """The LLM's module is the best; the next prompt shows it with the knobs it keeps, and a
    knobs reply becomes that module at the new values, descended from it (not the template)."""
    backend = QuickBackend(speed=lambda c: 10.0 if "LLM-written" in c.source else hashed_speed(c))
    monkeypatch.setattr(agent.campaign, "make_backend", lambda *a, **k: backend)
    with FakeLLMServer(
        [Reply(proposal("module", source=GOOD)), Reply(proposal("knobs", knobs={"BLOCK_B": 2}))]
    ) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(
            tmp_path, server.url, proposer={"batch_size": 1}, budget={"max_evaluations": 3, "max_wall_s": 600}
        )
        outcome = campaigns.start(cfg)
    _, written, tuned = campaigns.store.evaluations(outcome.campaign_id)
    assert written.candidate.source == GOOD
    assert tuned.candidate.parent_id == written.candidate.id
    assert "LLM-written" in tuned.candidate.source and structure_key(tuned.candidate.source) == structure_key(
        GOOD
    )
    assert tuned.candidate.knobs["BLOCK_B"] == 2
    shown = _user(server.requests[1])
    assert "## Knobs of the kernel above" in shown and "LLM-written" in shown


def test_a_prompt_that_fits_the_context_in_no_form_ends_an_llm_only_campaign(tmp_path: Path, quick) -> None:
    """The model's context cannot hold even the smallest fresh prompt: the prompt is tried
    smaller (the kernel's source trimmed), then the LLM proposer stops with the reason and the
    LLM-only campaign ends with it, instead of pausing for an outage and waiting out its budget."""
    tight = (
        "This model's maximum context length is 2048 tokens. However, you requested 10000 tokens "
        "(1900 in the messages, 8100 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    with FakeLLMServer(default=Fail(400, message=tight)) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(
            tmp_path,
            server.url,
            llm={"outage_failures": 1, "outage_cooldown_s": 900},
            budget={"max_evaluations": 5, "max_wall_s": 30},
        )
        start = time.monotonic()
        outcome = campaigns.start(cfg)
    assert time.monotonic() - start < 25
    assert outcome.stop_reason.startswith("the LLM proposer stopped: context_overflow: ")
    assert "smallest prompt of a fresh proposal does not fit" in outcome.stop_reason
    [(_, until, _)] = campaigns.store.llm_pauses(outcome.campaign_id)
    assert until == float("inf")  # a stop with the reason, not an outage pause
    exchanges = campaigns.store.llm_exchanges(outcome.campaign_id)
    assert (
        [e["outcome"] for e in exchanges]
        == ["context_overflow"] * len(server.requests)
        == ["context_overflow"] * 3
    )
    sizes = [len(_user(r)) for r in server.requests]
    assert sizes[0] > sizes[1] > sizes[2]  # the kernel's source shown in half, then a quarter
    assert "more lines, not shown" in _user(server.requests[2])


def test_a_server_that_enforces_its_context_gets_a_smaller_prompt_and_the_campaign_goes_on(
    tmp_path: Path, quick
) -> None:
    """A vLLM-like server whose max_model_len cannot hold a fresh prompt beside llm.max_tokens:
    its 400 makes the prompt smaller and the completion fit, and the campaign goes on."""
    with FakeLLMServer(default=knob_replies(), max_model_len=10_000) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(tmp_path, server.url, budget={"max_evaluations": 3, "max_wall_s": 600})
        outcome = campaigns.start(cfg)
    cid = outcome.campaign_id
    assert outcome.stop_reason == "evaluation budget reached (3 of 3)"
    outcomes = [e["outcome"] for e in campaigns.store.llm_exchanges(cid)]
    assert outcomes[0] == "context_overflow" and outcomes[-2:] == ["proposal", "proposal"], outcomes
    first, retry = server.requests[:2]
    assert prompt_tokens(retry) < prompt_tokens(first) and "more lines, not shown" in _user(retry)
    assert (
        "asking again with a smaller prompt (the kernel's first"
        in campaigns.store.llm_exchanges(cid)[0]["error"]
    )
    for r in server.requests[1:]:  # each fitted once the context was known
        assert prompt_tokens(r) + r["max_tokens"] <= 10_000
    assert not campaigns.store.llm_pauses(cid)
    assert [r.candidate.origin for r in campaigns.store.evaluations(cid)] == ["library", "llm", "llm"]


def test_a_refused_response_format_falls_back_to_plain_json_for_the_campaign(tmp_path: Path, quick) -> None:
    refused = Fail(
        400, message="The provided JSON schema contains features not supported by xgrammar.", style="vllm"
    )
    with FakeLLMServer([refused], default=knob_replies()) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(tmp_path, server.url, budget={"max_evaluations": 3, "max_wall_s": 600})
        outcome = campaigns.start(cfg)
    cid = outcome.campaign_id
    assert outcome.stop_reason == "evaluation budget reached (3 of 3)"
    exchanges = campaigns.store.llm_exchanges(cid)
    assert [e["outcome"] for e in exchanges] == ["structured_output_refused", "proposal", "proposal"]
    assert "xgrammar" in exchanges[0]["error"]
    assert "response_format" in server.requests[0]
    assert all("response_format" not in r for r in server.requests[1:])  # once, for the campaign
    assert "one JSON object" in server.requests[1]["messages"][0]["content"]  # the plain instructions


def test_a_reasoning_models_reply_becomes_the_proposal_in_its_answer(tmp_path: Path, quick) -> None:
    """Thinking in reasoning_content and in a <think> block in content, each with code and JSON
    of its own: the campaign evaluates the proposal of the answer after them."""
    thinking = 'First idea: {"kind": "module", "source": "def embedding_bag(): pass"}. Too slow.'
    content = (
        "<think>\nMaybe rewrite it:\n```python\ndef embedding_bag(w, i, o):\n    return {}\n```\n"
        '{"kind": "edit", "edits": [{"search": "x", "replace": "y"}]}\nNo: more bags per program.\n</think>\n'
        f"```json\n{proposal('knobs', knobs={'BLOCK_B': 16, 'num_warps': 4})}\n```\n"
        "That doubles the rows in flight."
    )
    with FakeLLMServer([Reply(content, reasoning=thinking)]) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(tmp_path, server.url, budget={"max_evaluations": 2, "max_wall_s": 600})
        outcome = campaigns.start(cfg)
    _, proposed = campaigns.store.evaluations(outcome.campaign_id)
    assert proposed.candidate.origin == "llm" and proposed.result.status == Status.OK
    assert proposed.candidate.knobs["BLOCK_B"] == 16 and proposed.candidate.knobs["num_warps"] == 4
    [exchange] = campaigns.store.llm_exchanges(outcome.campaign_id)
    assert exchange["outcome"] == "proposal" and len(server.requests) == 1


def test_the_context_the_server_states_is_known_before_the_first_request(tmp_path: Path, quick) -> None:
    """A vLLM-like server whose listing states a context that holds the first prompt beside
    llm.max_tokens, but not a repair turn's longer conversation beside it: the pre-flight checks
    the first prompt the campaign renders, and the client, told the context, sends the repair
    with a completion that fits; the server never refuses a request."""
    from agent.incumbents import campaign_arch, incumbents
    from agent.llm.client import PROMPT_MARGIN, estimate_tokens
    from agent.proposers.llm import first_prompts, fresh_messages, starting_point
    from kernels.registry import KernelLibrary

    max_tokens = 8192
    [first] = first_prompts(
        ["embedding_bag"], lambda p: incumbents(p, KernelLibrary(tmp_path / "library"), campaign_arch())
    ).values()
    context = estimate_tokens(first) + max_tokens + PROMPT_MARGIN  # the first prompt just fits
    script = [
        Reply(proposal("module", source=BROKEN)),
        Reply(proposal("edit", edits=[{"search": BROKEN_LINE, "replace": ""}])),
    ]
    with FakeLLMServer(script, style="vllm", models=["scripted"], max_model_len=context) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(
            tmp_path,
            server.url,
            llm={"max_tokens": max_tokens},
            budget={"max_evaluations": 3, "max_wall_s": 60},
        )
        outcome = campaigns.start(cfg)
    cid = outcome.campaign_id
    assert [e["outcome"] for e in campaigns.store.llm_exchanges(cid)] == ["proposal", "proposal"]
    fresh, repair = server.requests
    # The first request is the prompt the pre-flight rendered, whole, with llm.max_tokens.
    template = starting_point("embedding_bag")
    rendered = fresh_messages("embedding_bag", template, best=None, attempts=[], llm_rows={}, baselines={})
    assert fresh["messages"] == rendered and estimate_tokens(rendered) <= estimate_tokens(first)
    assert fresh["max_tokens"] == max_tokens
    # The repair would not have fit with llm.max_tokens; it was sent with what fits.
    assert prompt_tokens(repair) + max_tokens > context
    assert repair["max_tokens"] < max_tokens and prompt_tokens(repair) + repair["max_tokens"] <= context
    assert campaigns.store.llm_preflight(cid).context_tokens == context
    status = CliRunner().invoke(app, ["campaign", "status", cid, "--home", str(tmp_path / "home")])
    assert f"context {context} tokens" in " ".join(status.output.split())


def test_auto_structured_output_uses_the_form_the_preflight_found(tmp_path: Path, quick) -> None:
    """structured_output = "auto" against a server that refuses a json_schema response_format but
    takes tools: the pre-flight finds it out with tiny requests, the choice is recorded and shown
    by campaign status, and every request of the campaign uses the propose_kernel tool, with no
    refusal spent on the way."""
    with FakeLLMServer(default=knob_replies(), refuses=["json_schema"]) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(
            tmp_path,
            server.url,
            llm={"structured_output": "auto"},
            budget={"max_evaluations": 3, "max_wall_s": 60},
        )
        outcome = campaigns.start(cfg)
    cid = outcome.campaign_id
    probes, campaign = server.requests[:2], server.requests[2:]
    assert [("tools" in r, "response_format" in r) for r in probes] == [(False, True), (True, False)]
    assert len(campaign) == 2 and all("tools" in r and "response_format" not in r for r in campaign)
    assert [e["outcome"] for e in campaigns.store.llm_exchanges(cid)] == ["proposal", "proposal"]
    found = campaigns.store.llm_preflight(cid)
    assert (found.structured_output, found.refused) == ("tools", ("json_schema",))
    status = CliRunner().invoke(app, ["campaign", "status", cid, "--home", str(tmp_path / "home")])
    assert "structured output tools (json_schema refused)" in " ".join(status.output.split())


def test_a_campaign_in_tools_mode_proposes_through_the_propose_kernel_tool(tmp_path: Path, quick) -> None:
    """structured_output = "tools": every request offers the propose_kernel tool and forces its
    call; the server answers with the call, whose arguments are the proposal, for a fresh
    kernel and for the repair of its compile error, which continues the conversation."""
    from agent.llm.client import TOOL

    script = [
        Reply(proposal("module", source=BROKEN)),
        Reply(proposal("edit", edits=[{"search": BROKEN_LINE, "replace": ""}])),
    ]
    with FakeLLMServer(script, style="vllm") as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(
            tmp_path,
            server.url,
            llm={"structured_output": "tools"},
            budget={"max_evaluations": 3, "max_wall_s": 60},
        )
        outcome = campaigns.start(cfg)
    cid = outcome.campaign_id
    _, broken, fixed = campaigns.store.evaluations(cid)
    assert (broken.result.status, fixed.result.status) == (Status.COMPILE_ERROR, Status.OK)
    assert fixed.candidate.source == GOOD and fixed.candidate.parent_id == broken.candidate.id
    for r in server.requests:
        assert [t["function"]["name"] for t in r["tools"]] == [TOOL] and "response_format" not in r
        assert r["tool_choice"] == {"type": "function", "function": {"name": TOOL}}
    exchanges = campaigns.store.llm_exchanges(cid)
    assert [e["outcome"] for e in exchanges] == ["proposal", "proposal"]
    assert [e["response_text"] for e in exchanges] == [s.content for s in script]  # the calls' arguments
    repair = server.requests[1]["messages"]
    assert (
        repair[2] == {"role": "assistant", "content": script[0].content}
        and "compile_error" in repair[3]["content"]
    )


def test_an_ollama_campaign_under_an_untagged_model_name(tmp_path: Path, quick) -> None:
    """Ollama lists its models with tags and serves `qwen2.5-coder` as the qwen2.5-coder:latest
    it lists; its errors come in its own words: tools refused for a model without them (asked
    again without, for the campaign), a busy server's 503 (retried). A tag it does not have
    fails the pre-flight with what it serves, before anything is spent."""
    busy = Fail(
        503, message="server busy, please try again.  maximum pending requests exceeded", style="ollama"
    )
    served = ["qwen2.5-coder:latest", "llama3.1:8b"]
    with FakeLLMServer(
        [busy], default=knob_replies(), style="ollama", models=served, refuses=["tools"]
    ) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(
            tmp_path,
            server.url,
            llm={"model": "qwen2.5-coder", "structured_output": "tools"},
            budget={"max_evaluations": 3, "max_wall_s": 60},
        )
        outcome = campaigns.start(cfg)
        cid = outcome.campaign_id
        exchanges = campaigns.store.llm_exchanges(cid)
        assert [e["outcome"] for e in exchanges] == [
            "structured_output_refused",
            "http_503",
            "proposal",
            "proposal",
        ]
        assert (
            "registry.ollama.ai/library/qwen2.5-coder:latest does not support tools" in exchanges[0]["error"]
        )
        assert "server busy, please try again" in exchanges[1]["error"]
        assert {r["model"] for r in server.requests} == {"qwen2.5-coder"}
        assert "tools" in server.requests[0] and all("tools" not in r for r in server.requests[1:])
        assert [r.candidate.origin for r in campaigns.store.evaluations(cid)] == ["library", "llm", "llm"]
        sent = len(server.requests)
        tagged = cfg.model_copy(update={"llm": cfg.llm.model_copy(update={"model": "qwen2.5-coder:7b"})})
        with pytest.raises(
            CampaignError, match="does not serve this model; it serves qwen2.5-coder:latest, llama3.1:8b"
        ):
            campaigns.start(tagged)
        assert len(server.requests) == sent + 1 and server.requests[-1]["max_tokens"] == 1  # one probe
    assert [c.id for c in campaigns.store.campaigns()] == [cid]


def test_a_reply_slower_than_the_timeout_is_asked_again_and_the_campaign_goes_on(
    tmp_path: Path, quick
) -> None:
    """A server that sends its headers at once and the body later than the client's timeout,
    once, then answers on time: the slow try is recorded as a timeout and retried, and the
    campaign goes on as if nothing happened."""
    late = Reply(proposal("knobs", knobs={"BLOCK_B": 16}), delay_s=3.0, headers_first=True)
    with FakeLLMServer([late], default=knob_replies()) as server:
        campaigns = Campaigns(tmp_path / "home")
        cfg = config(
            tmp_path, server.url, llm={"timeout_s": 0.5}, budget={"max_evaluations": 3, "max_wall_s": 60}
        )
        outcome = campaigns.start(cfg)
    cid = outcome.campaign_id
    assert outcome.stop_reason == "evaluation budget reached (3 of 3)"
    exchanges = campaigns.store.llm_exchanges(cid)
    assert [(e["outcome"], e["attempt"]) for e in exchanges] == [
        ("timeout", 0),
        ("proposal", 1),
        ("proposal", 0),
    ]
    assert exchanges[0]["error"] == "no reply within 0.5 s" and exchanges[0]["response_text"] is None
    assert len(server.requests) == 3
    assert [r.candidate.origin for r in campaigns.store.evaluations(cid)] == ["library", "llm", "llm"]
