"""The LLM proposer's parts: proposal parsing and validation, search/replace edits, knobs kept
in a module's source, the client's retries against the loopback server, batch sharing, config."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from llm_helpers import GOOD, KEY, KEY_ENV, config
from llm_server import REFUSALS, UNKNOWN_MODEL, Fail, FakeLLMServer, Garbage, Reply, prompt_tokens, proposal

from agent.config import ConfigError, LLMConfig, load_config, parse_config
from agent.llm.client import ChatClient, LLMConfigError, LLMUnavailable, make_client
from agent.llm.proposals import (
    EditProposal,
    ProposalError,
    SearchReplace,
    allowed_kinds,
    apply_edits,
    parse_proposal,
    to_candidate,
)
from agent.proposers import ProposalRequest, SearchProposer, allocate, propose_batch
from agent.proposers.knob_source import SourceKnobs, knob_values, structure_key, with_knobs
from agent.store import EvaluationRow
from sandbox.candidate import Candidate
from sandbox.result import EvalResult, Status
from search_space.embedding_bag import TEMPLATE


def test_parse_proposal_takes_fenced_json_and_explains_what_is_wrong() -> None:
    text = 'Here you go:\n```json\n{"kind": "knobs", "knobs": {"BLOCK_B": 8, "ACC_3D": true}}\n```\n'
    parsed = parse_proposal(text)
    assert parsed.kind == "knobs" and parsed.knobs == {"BLOCK_B": 8, "ACC_3D": True}
    assert type(parsed.knobs["BLOCK_B"]) is int and type(parsed.knobs["ACC_3D"]) is bool
    with pytest.raises(ProposalError, match="holds no JSON object"):
        parse_proposal("I would make the blocks bigger.")
    with pytest.raises(
        ProposalError, match=r"not valid JSON \(Unterminated string starting at: line 1, column 30\)"
    ):
        parse_proposal('{"kind": "module", "source": "import torch')
    with pytest.raises(
        ProposalError, match=r"schema: kind: Input tag 'rewrite' found using 'kind' does not match"
    ):
        parse_proposal('{"kind": "rewrite", "source": "x"}')
    with pytest.raises(ProposalError, match=r"edit\.edits: List should have at least 1 item"):
        parse_proposal('{"kind": "edit", "edits": []}')
    with pytest.raises(ProposalError, match=r"module\.sourc: Extra inputs"):
        parse_proposal('{"kind": "module", "source": "x", "sourc": "y"}')


def test_edits_apply_once_each_or_say_why_not() -> None:
    source = "a = 1\nb = 2\nb = 2\n    c = 3\n"
    assert apply_edits(source, [SearchReplace(search="a = 1\n", replace="a = 10\n")]).startswith("a = 10\n")
    # Blocks apply in order, each to the text as edited so far.
    edited = apply_edits(
        source,
        [SearchReplace(search="a = 1", replace="z = 0"), SearchReplace(search="z = 0\nb", replace="y")],
    )
    assert edited.startswith("y = 2\n")
    with pytest.raises(ProposalError, match=r"edit 1: search block not found.*'q = 9'"):
        apply_edits(source, [SearchReplace(search="q = 9", replace="")])
    with pytest.raises(ProposalError, match=r"edit 1: search block occurs 2 times \(lines 2, 3\)"):
        apply_edits(source, [SearchReplace(search="b = 2", replace="")])
    with pytest.raises(ProposalError, match="matches if whitespace is ignored"):
        apply_edits(source, [SearchReplace(search="b = 2\nc = 3", replace="")])


def test_proposals_become_candidates_or_errors_for_the_model() -> None:
    base = Candidate(problem="embedding_bag", source=GOOD, entry="embedding_bag", origin="llm")
    knobs = to_candidate(
        parse_proposal(proposal("knobs", knobs={"BLOCK_D": 128})),
        problem="embedding_bag",
        base=None,
        parent_id="p",
    )
    assert (
        knobs.source == TEMPLATE.render({"BLOCK_D": 128}) and knobs.parent_id == "p" and knobs.origin == "llm"
    )
    with pytest.raises(ProposalError, match=r"knobs: knob BLOCK_D=96 is not one of"):
        to_candidate(
            parse_proposal(proposal("knobs", knobs={"BLOCK_D": 96})),
            problem="embedding_bag",
            base=None,
            parent_id=None,
        )
    with pytest.raises(ProposalError, match="constraint"):
        to_candidate(
            parse_proposal(proposal("knobs", knobs={"BLOCK_B": 16, "BLOCK_L": 32, "BLOCK_D": 256})),
            problem="embedding_bag",
            base=None,
            parent_id=None,
        )
    module = to_candidate(
        parse_proposal(proposal("module", source=GOOD)),
        problem="embedding_bag",
        base=None,
        parent_id=None,
        knobs_of=knob_values,
    )
    assert module.knobs == TEMPLATE.defaults()  # read from its KNOBS dict, for the search
    with pytest.raises(ProposalError, match="does not parse: line 1"):
        to_candidate(
            parse_proposal(proposal("module", source="def (")),
            problem="embedding_bag",
            base=None,
            parent_id=None,
        )
    with pytest.raises(ProposalError, match="no top-level function 'embedding_bag'"):
        to_candidate(
            parse_proposal(proposal("module", source="x = 1\n")),
            problem="embedding_bag",
            base=None,
            parent_id=None,
        )
    warps = '"num_warps": None'
    edit = EditProposal(kind="edit", edits=[SearchReplace(search=warps, replace='"num_warps": 4')])
    assert (
        '"num_warps": 4' in to_candidate(edit, problem="embedding_bag", base=base, parent_id=base.id).source
    )
    with pytest.raises(ProposalError, match=r"kind 'edit' is not available.*\['knobs', 'module'\]"):
        to_candidate(edit, problem="embedding_bag", base=None, parent_id=None)
    # A fused variant is an op of its own, not a kind of reply.
    with pytest.raises(ProposalError, match="expected tags: 'knobs', 'module', 'edit'"):
        parse_proposal(proposal("fusion", fusion="x"))
    same = EditProposal(kind="edit", edits=[SearchReplace(search=warps, replace=warps)])
    with pytest.raises(ProposalError, match="unchanged"):
        to_candidate(same, problem="embedding_bag", base=base, parent_id=None)
    # A problem without a template offers no knobs.
    assert allowed_kinds("embedding_bag_backward", None) == ["module"]


def test_knobs_kept_in_a_module_are_tuned_in_place() -> None:
    rendered = TEMPLATE.render(TEMPLATE.defaults())
    knobs = {"BLOCK_B": 8, "EVICT_ROWS": "evict_first", "ACC_3D": True}
    assert with_knobs(rendered, knobs) == TEMPLATE.render(knobs)  # same bytes as the template's
    assert structure_key(TEMPLATE.render(knobs)) == structure_key(rendered) != structure_key(GOOD)
    space = SourceKnobs(TEMPLATE, GOOD.replace('"BLOCK_D": None', '"BLOCK_D": 96'), "embedding_bag")
    assert "BLOCK_D" not in {k.name for k in space.knobs}  # 96 is not a choice: left as written
    tuned = space.render({"BLOCK_B": 2})
    assert knob_values(tuned)["BLOCK_B"] == 2 and knob_values(tuned)["BLOCK_D"] == 96
    assert "LLM-written" in tuned
    with pytest.raises(ValueError, match="unknown knob"):
        space.render({"BLOCK_D": 32})
    assert knob_values("x = 1\n") == {} and knob_values("KNOBS = {'a': f(1)}\n") == {}


def _row(seq: int, candidate: Candidate, score: float | None) -> EvaluationRow:
    from sandbox.result import ShapeTiming, TimingStats

    timings = (
        [
            ShapeTiming(
                shape="s",
                dtype="fp32",
                bucket="d64",
                candidate=TimingStats(median_us=score, p20_us=score, p80_us=score, reps=3),
                flops=1,
                bytes=1,
                achieved_gbps=1,
            )
        ]
        if score
        else []
    )
    status = Status.OK if score else Status.WRONG
    return EvaluationRow(
        seq,
        candidate,
        EvalResult(status=status, problem="embedding_bag", candidate_id=candidate.id, timings=timings),
    )


def test_search_proposer_tunes_the_best_module_or_else_the_template() -> None:
    search = SearchProposer(TEMPLATE, seed=2)
    written = Candidate(
        problem="embedding_bag", source=GOOD, entry="embedding_bag", knobs=knob_values(GOOD), origin="llm"
    )
    rows = [_row(1, written, 10.0)]
    request = ProposalRequest(
        campaign_id="c", problem="embedding_bag", rows=rows, best=rows[0], seen=frozenset({written.id})
    )
    proposed = search.propose(3, request)
    assert len(proposed) == 3
    for c in proposed:
        assert (
            structure_key(c.source) == structure_key(GOOD)
            and c.parent_id == written.id
            and c.origin == "template"
        )
    template_best = Candidate(
        problem="embedding_bag",
        source=TEMPLATE.render({}),
        entry="embedding_bag",
        knobs=TEMPLATE.defaults(),
        origin="template",
    )
    rows = [_row(1, template_best, 10.0)]
    request = ProposalRequest(
        campaign_id="c", problem="embedding_bag", rows=rows, best=rows[0], seen=frozenset({template_best.id})
    )
    for c in search.propose(2, request):
        assert c.source == TEMPLATE.render(c.knobs)


class _Fixed:
    def __init__(self, kind: str, ids: list[str]) -> None:
        self.kind, self.ids, self.asked = kind, ids, []

    def propose(self, n, request):
        self.asked.append(n)
        return [
            Candidate(problem="embedding_bag", source=f"# {i}\n", entry="embedding_bag")
            for i in self.ids[:n]
            if True
        ]


def test_batches_are_shared_and_a_shortfall_passes_on() -> None:
    assert allocate(4, [0.5, 0.5]) == [2, 2]
    assert allocate(1, [0.5, 0.5]) == [1, 0]
    assert allocate(5, [0.25, 0.75]) == [1, 4]
    llm, search = _Fixed("llm", ["a"]), _Fixed("search", ["b", "c", "d", "e"])
    request = ProposalRequest(campaign_id="c", problem="embedding_bag", rows=[], best=None, seen=frozenset())
    batch = propose_batch([llm, search], [0.5, 0.5], 4, request)
    assert llm.asked == [2] and search.asked == [3] and len(batch) == 4


def test_config_of_proposers_and_llm() -> None:
    example = load_config(Path(__file__).resolve().parents[2] / "campaigns" / "llm-example.toml")
    assert example.proposer.kinds == ["llm", "search"] and example.llm.api_key_env == "RECFORGE_LLM_API_KEY"
    base = {"name": "x", "problems": ["embedding_bag"], "budget": {"max_evaluations": 3, "max_wall_s": 60}}
    assert parse_config({**base, "proposer": {"kind": "search"}}).proposer.kinds == [
        "search"
    ]  # older configs
    with pytest.raises(ConfigError, match=r"no \[llm\] section"):
        parse_config({**base, "proposer": {"kinds": ["llm"]}})
    with pytest.raises(ConfigError, match=r"proposer: Value error, shares given for \['llm'\]"):
        parse_config({**base, "proposer": {"kinds": ["search"], "shares": {"llm": 1}}})
    with pytest.raises(ConfigError, match=r"llm\.api_key_env: String should match pattern"):
        parse_config({**base, "llm": {"base_url": "u", "model": "m", "api_key_env": "sk-123"}})
    llm_only = {
        **base,
        "problems": ["embedding_bag_backward"],
        "proposer": {"kinds": ["llm"]},
        "llm": {"base_url": "u", "model": "m"},
    }
    assert parse_config(llm_only).proposer.share("llm") == 1.0  # no template needed without the search
    cfg = parse_config(
        {
            **base,
            "proposer": {"kinds": ["llm", "search"], "shares": {"search": 3}},
            "llm": {"base_url": "u", "model": "m"},
        }
    )
    assert cfg.proposer.share("llm") == 0.25 and cfg.llm.cost(1_000_000, 0) == 0.0


def _client(url: str, **overrides) -> ChatClient:
    settings = {
        "base_url": url,
        "model": "scripted",  # what FakeLLMServer serves by default
        "api_key_env": KEY_ENV,
        "backoff_initial_s": 0.01,
        "backoff_max_s": 0.02,
    }
    return ChatClient(LLMConfig(**(settings | overrides)))


MESSAGES = [{"role": "user", "content": "x" * 400}]


def test_client_retries_what_retrying_can_fix(monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    script = [
        Reply("late", delay_s=0.6),  # beyond the timeout
        Fail(429, {"retry-after": "1"}),  # honoured although above the backoff
        Garbage(body='{"object": "error"}', content_type="application/json"),
        Reply("ok", usage=False),
    ]
    attempts = []
    with FakeLLMServer(script) as server:
        start = time.monotonic()
        reply = _client(server.url, timeout_s=0.3, max_retries=3).complete(
            MESSAGES, schema={}, on_attempt=attempts.append
        )
        elapsed = time.monotonic() - start
    assert [a.outcome for a in attempts] == ["timeout", "rate_limited", "garbage", "replied"]
    assert attempts[1].retry_after_s == 1.0 and elapsed >= 1.3
    assert reply.text == "ok" and (reply.prompt_tokens, reply.completion_tokens) == (100, 0)  # estimated


def test_client_gives_up_and_falls_back(monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    attempts = []
    with FakeLLMServer([Fail(401, message="bad key"), Fail(500), Fail(502)]) as server:
        with pytest.raises(LLMUnavailable, match="auth: .*bad key") as info:
            _client(server.url, max_retries=3).complete(MESSAGES, schema={}, on_attempt=attempts.append)
        assert info.value.outcome == "auth" and info.value.permanent and len(attempts) == 1  # not retried
        with pytest.raises(LLMUnavailable, match="http_502 after 2 attempts"):
            _client(server.url, max_retries=1).complete(MESSAGES, schema={}, on_attempt=attempts.append)
    # A server that refuses response_format is asked again without it, and from then on.
    with FakeLLMServer(
        [Fail(400, message="response_format is not supported"), Reply("a"), Reply("b")]
    ) as server:
        client = _client(server.url, max_retries=0)
        assert client.complete(MESSAGES, schema={"type": "object"}, on_attempt=attempts.append).text == "a"
        assert client.complete(MESSAGES, schema={"type": "object"}, on_attempt=attempts.append).text == "b"
        assert "response_format" in server.requests[0]
        assert "response_format" not in server.requests[1] and "response_format" not in server.requests[2]
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(LLMConfigError, match=f"{KEY_ENV} .* is not set"):
        make_client(LLMConfig(base_url="u", model="m", api_key_env=KEY_ENV))
    assert make_client(LLMConfig(base_url="http://x/v1", model="m", api_key_env=None)).api_key == "unused"


def test_fake_server_lists_models(tmp_path) -> None:
    with FakeLLMServer() as server:
        client = make_client(config(tmp_path, server.url).llm.model_copy(update={"api_key_env": None}))
        assert [m.id for m in client.models.list()] == ["scripted"]


def test_the_prompt_names_the_hardware_and_where_it_runs() -> None:
    from agent.llm.prompting import propose_prompt

    kinds = allowed_kinds("embedding_bag", None)
    text = propose_prompt(
        problem="embedding_bag",
        arch="interpreter",
        best=None,
        base=None,
        attempts=[],
        llm_rows={},
        baselines={},
        kinds=kinds,
    )
    assert "fusion" not in text
    assert "written for sm_90 (NVIDIA H200)" in text and "Triton interpreter on a CPU" in text


def test_an_edit_of_the_default_kernel_keeps_its_entry_point() -> None:
    """The default embedding-bag kernel (an incumbent) defines embedding_bag_forward, not the
    problem's entry name: an edit of it keeps that entry, and the prompt names it."""
    import inspect

    from kernels.embedding_bag import embedding_bag_forward

    source = Path(inspect.getsourcefile(embedding_bag_forward)).read_text()
    base = Candidate(problem="embedding_bag", source=source, entry="embedding_bag_forward", origin="library")
    edit = proposal("edit", edits=[{"search": "num_stages=1,", "replace": "num_stages=2,"}])
    candidate = to_candidate(parse_proposal(edit), problem="embedding_bag", base=base, parent_id=base.id)
    assert candidate.entry == "embedding_bag_forward" and "num_stages=2," in candidate.source
    from agent.llm.prompting import propose_prompt

    text = propose_prompt(
        problem="embedding_bag", arch="interpreter", best=None, base=base, attempts=[], llm_rows={},
        baselines={}, kinds=["edit", "module"],
    )  # fmt: skip
    assert "an edit keeps, is `embedding_bag_forward`" in text


def test_the_prompt_states_the_statistics_a_forward_returns() -> None:
    """A softmax forward's contract includes the lse it saves for the backward; the prompt says
    so (and what lse is), and says nothing of it for ops that save none."""
    from agent.llm.prompting import propose_prompt

    def prompt(problem: str) -> str:
        return propose_prompt(
            problem=problem, arch="interpreter", best=None, base=None, attempts=[], llm_rows={},
            baselines={}, kinds=["module"],
        )  # fmt: skip

    text = prompt("jagged_attention")
    assert "return_lse=True asks for (out, lse)" in text and "return_lse: bool = False" in text
    assert "Statistics for the backward" not in prompt("gdpa")


def test_the_prompt_shows_why_reviewers_rejected_the_ops_kernels() -> None:
    from agent.llm.prompting import propose_prompt

    common = dict(problem="embedding_bag", arch="interpreter", best=None, base=None, attempts=[], llm_rows={},
                  baselines={}, kinds=["module"])  # fmt: skip
    text = propose_prompt(**common, rejected=["reads the weights twice per bag"])
    assert (
        "Kernels of this op that reviewers rejected" in text and "- reads the weights twice per bag" in text
    )
    assert "reviewers rejected" not in propose_prompt(**common)


# What vLLM answers when a prompt plus max_tokens exceeds the model's context.
VLLM_CONTEXT = (
    "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens "
    "(1000 in the messages, 8000 in the completion). Please reduce the length of the messages or completion."
)


@pytest.mark.slow
def test_http_errors_are_told_apart(monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    attempts = []
    # Context overflow: asked again at once with a completion that fits, and kept for later requests.
    with FakeLLMServer([Fail(400, message=VLLM_CONTEXT), Reply("a"), Reply("b")]) as server:
        client = _client(server.url, max_retries=0, max_tokens=8000)
        assert client.complete(MESSAGES, schema={"type": "object"}, on_attempt=attempts.append).text == "a"
        assert client.complete(MESSAGES, schema={"type": "object"}, on_attempt=attempts.append).text == "b"
        assert [a.outcome for a in attempts] == ["context_overflow", "replied", "replied"]
        # The retry gets the room the server stated; later requests what fits beside their own
        # prompt (400 characters, estimated at 3 a token), at most llm.max_tokens.
        assert [r["max_tokens"] for r in server.requests] == [8000, 4096 - 1000 - 16, 4096 - 400 // 3 - 64]
        assert all("response_format" in r for r in server.requests)  # structured output kept
    # vLLM's newer wording is read too; a message that states no numbers halves max_tokens.
    newer = (
        "This model's maximum context length is 4096 tokens. However, you requested 8000 output tokens "
        "and your prompt contains 1500 input tokens, for a total of 9500 tokens."
    )
    with FakeLLMServer(
        [Fail(400, message=newer), Reply("a"), Fail(400, message="prompt is too long"), Reply("b")]
    ) as server:
        assert (
            _client(server.url, max_retries=0, max_tokens=8000)
            .complete(MESSAGES, schema={}, on_attempt=attempts.append)
            .text
            == "a"
        )
        assert (
            _client(server.url, max_retries=0, max_tokens=8000)
            .complete(MESSAGES, schema={}, on_attempt=attempts.append)
            .text
            == "b"
        )
        assert [r["max_tokens"] for r in server.requests] == [8000, 4096 - 1500 - 16, 8000, 4000]
    # No room left for a completion: one clear failure, not retried, not a permanent stop.
    tight = VLLM_CONTEXT.replace("1000 in the messages", "3900 in the messages")
    with FakeLLMServer([Fail(400, message=tight), Reply("never")]) as server:
        with pytest.raises(LLMUnavailable, match="context_overflow: .*no room") as info:
            _client(server.url, max_retries=2).complete(MESSAGES, schema={}, on_attempt=attempts.append)
        assert not info.value.permanent and len(server.requests) == 1
    # Another 400 keeps response_format and is not retried; 404 is an unknown model, for good.
    with FakeLLMServer(
        [Fail(400, message="messages: field required"), Fail(404, message="model m")]
    ) as server:
        with pytest.raises(LLMUnavailable, match="http_400") as info:
            _client(server.url, max_retries=2).complete(
                MESSAGES, schema={"type": "object"}, on_attempt=attempts.append
            )
        with pytest.raises(LLMUnavailable, match="unknown_model") as unknown:
            _client(server.url, max_retries=2).complete(MESSAGES, schema={}, on_attempt=attempts.append)
        assert not info.value.permanent and unknown.value.permanent and len(server.requests) == 2
        assert "response_format" in server.requests[0]


def test_a_context_overflow_shrinks_the_prompt_first_then_max_tokens(monkeypatch) -> None:
    """On a context overflow the prompt gets smaller first (each form `shrink` gives, in turn),
    then the completion; where nothing fits, context_overflow with the reason. Each try is
    recorded with its class, and the reply's request holds the messages that were sent."""
    monkeypatch.setenv(KEY_ENV, KEY)
    forms = [[{"role": "user", "content": "x" * n}] for n in (300, 200)]

    def shrinker():
        left = iter(forms)
        return lambda: next(((m, f"{len(m[0]['content'])} characters") for m in left), None)

    # A prompt of 3000 tokens leaves less than half the context of 4096 for the completion.
    over = Fail(400, message=VLLM_CONTEXT.replace("1000 in the messages", "3000 in the messages"))
    with FakeLLMServer([over, over, over, Reply("a")]) as server:
        attempts = []
        client = _client(server.url, max_retries=0, max_tokens=8000)
        reply = client.complete(MESSAGES, schema={}, on_attempt=attempts.append, shrink=shrinker())
        assert reply.text == "a" and reply.request["messages"] == forms[1]
        assert [len(r["messages"][0]["content"]) for r in server.requests] == [400, 300, 200, 200]
        # Smaller prompts get what fits beside them (estimated, 3 characters a token); the
        # smallest, what the server says is left.
        assert [r["max_tokens"] for r in server.requests] == [8000, 4096 - 100 - 64, 4096 - 66 - 64, 1080]
        assert [a.outcome for a in attempts] == ["context_overflow"] * 3 + ["replied"]
        assert "asking again with a smaller prompt (300 characters)" in attempts[0].error
        assert attempts[2].error.endswith("asking again with max_tokens 1080")
        # The context now known, a later prompt is shrunk before it is sent, with no 400 first.
        server.add(Reply("b"))
        later = client.complete(
            [{"role": "user", "content": "x" * 12000}],
            schema={},
            on_attempt=attempts.append,
            shrink=shrinker(),
        )
        assert later.text == "b" and len(server.requests[-1]["messages"][0]["content"]) == 300
    # Where only max_tokens is too large (1000 prompt tokens of 4096), the prompt stays whole.
    with FakeLLMServer([Fail(400, message=VLLM_CONTEXT), Reply("c")]) as server:
        client = _client(server.url, max_retries=0, max_tokens=8000)
        assert client.complete(MESSAGES, schema={}, on_attempt=attempts.append, shrink=shrinker()).text == "c"
        assert [len(r["messages"][0]["content"]) for r in server.requests] == [400, 400]
    tight = VLLM_CONTEXT.replace("1000 in the messages", "3900 in the messages")
    with FakeLLMServer(default=Fail(400, message=tight)) as server:
        attempts = []
        with pytest.raises(LLMUnavailable, match="context_overflow: .*no room") as info:
            _client(server.url, max_retries=3).complete(
                MESSAGES, schema={}, on_attempt=attempts.append, shrink=shrinker()
            )
        assert (
            info.value.outcome == "context_overflow" and len(server.requests) == 3
        )  # 2 smaller, none retried
        assert [a.outcome for a in attempts] == ["context_overflow"] * 3


def test_preflight_says_in_one_sentence_what_to_change(tmp_path, monkeypatch) -> None:
    """The server answers, the key works, the model is served, and its stated context holds the
    largest of the campaign's first prompts (as the client estimates them) beside max_tokens."""
    from agent.llm.client import PROMPT_MARGIN, estimate_tokens
    from agent.llm.preflight import preflight
    from agent.proposers.llm import first_prompts

    monkeypatch.setenv(KEY_ENV, KEY)
    prompts = first_prompts(["dense_to_jagged", "embedding_bag"], lambda problem: [])
    largest = estimate_tokens(prompts["embedding_bag"])
    assert largest > estimate_tokens(prompts["dense_to_jagged"])
    llm = config(tmp_path, "http://127.0.0.1:9/v1").llm
    with pytest.raises(LLMConfigError, match="no server answers"):
        preflight(llm, prompts)
    served = [
        {"id": "scripted", "object": "model", "max_model_len": 32768},
        {"id": "other", "object": "model"},
    ]
    with FakeLLMServer(models=served) as server:
        found = preflight(llm.model_copy(update={"base_url": server.url}), prompts)
        assert found.models == ("scripted", "other") and found.context_tokens == 32768
        assert (found.prompt_tokens, found.prompt_problem) == (largest, "embedding_bag")
        assert found.structured_output == "json_schema" and found.checked_by == "models"
        fits = 32768 - largest - PROMPT_MARGIN
        with pytest.raises(
            LLMConfigError,
            match=rf"context of 32768 tokens cannot hold llm.max_tokens = {fits + 1} beside the first prompt "
            rf"for embedding_bag \(about {largest} tokens\): set llm.max_tokens to {fits} or less",
        ):
            preflight(llm.model_copy(update={"base_url": server.url, "max_tokens": fits + 1}), prompts)
        preflight(llm.model_copy(update={"base_url": server.url, "max_tokens": fits}), prompts)
        assert not server.requests  # nothing spent on chat
        # A model it does not list is asked for once; not served, the sentence lists what is.
        with pytest.raises(LLMConfigError, match="does not serve this model; it serves scripted, other"):
            preflight(llm.model_copy(update={"base_url": server.url, "model": "scriptd"}), prompts)
        assert server.requests[-1]["max_tokens"] == 1
    with FakeLLMServer(models=Fail(401, message="invalid api key")) as server:
        refused = f"refused the key in {KEY_ENV} \\(HTTP 401"
        with pytest.raises(LLMConfigError, match=refused):
            preflight(llm.model_copy(update={"base_url": server.url}), prompts)
        assert not server.requests
    # A server that lists no models is asked one tiny chat request instead.
    with FakeLLMServer([Fail(404, message="The model `m` does not exist")], models=Fail(404)) as server:
        with pytest.raises(LLMConfigError, match="does not serve this model"):
            preflight(llm.model_copy(update={"base_url": server.url}), prompts)
        assert server.requests[0]["max_tokens"] == 1


@pytest.mark.parametrize(
    ("style", "listed", "refuses", "chosen", "refused"),
    [
        ("openai", "qwen2.5-coder", ["json_schema"], "tools", ["json_schema"]),
        ("openai", "qwen2.5-coder", ["json_schema", "tools"], "none", ["json_schema", "tools"]),
        ("ollama", "qwen2.5-coder:latest", ["tools"], "json_schema", []),
        ("vllm", "qwen2.5-coder", [], "json_schema", []),
    ],
)
def test_preflight_finds_the_structured_output_form_the_server_takes(
    tmp_path, monkeypatch, style, listed, refuses, chosen, refused
) -> None:
    """structured_output = "auto": json_schema, then the propose_kernel tool, else plain JSON
    instructions, each tried with a tiny request constrained by the proposal schema as the
    campaign's requests are; the first the server takes is chosen. (Ollama's untagged name is
    found among the tags it lists, with no request.)"""
    from agent.llm.preflight import PROBE_TOKENS, preflight
    from agent.llm.proposals import proposal_schema

    monkeypatch.setenv(KEY_ENV, KEY)
    llm = config(tmp_path, "u", llm={"structured_output": "auto", "model": "qwen2.5-coder"}).llm
    with FakeLLMServer(default=Reply("{"), style=style, models=[listed], refuses=refuses) as server:
        found = preflight(llm.model_copy(update={"base_url": server.url}), {})
    assert (found.structured_output, list(found.refused), found.checked_by) == (chosen, refused, "models")
    assert [r["max_tokens"] for r in server.requests] == [PROBE_TOKENS] * len(server.requests)
    tried = [("tools" if "tools" in r else r["response_format"]["type"]) for r in server.requests]
    assert tried == ["json_schema", "tools"][: len(refused) + (chosen != "none")]
    for r in server.requests:
        tool = r["tools"][0]["function"] if "tools" in r else None
        sent = tool["parameters"] if tool else r["response_format"]["json_schema"]["schema"]
        assert sent == proposal_schema()


def test_interpreted_timings_never_reach_the_prompt() -> None:
    """On the interpreter the same kernel measured 17 ms and 34 ms in two runs: the prompt says
    which kernels are correct and gives no microseconds, GB/s or speedups from such timings;
    GPU timings are shown as measured."""
    from agent.llm.prompting import propose_prompt
    from sandbox.result import DeviceInfo, TimingStats

    best = _row(
        1, Candidate(problem="embedding_bag", source=GOOD, entry="embedding_bag", origin="llm"), 1234.5
    )
    attempt = _row(2, Candidate(problem="embedding_bag", source=GOOD + "\n", entry="embedding_bag"), 2345.6)
    baselines = {
        "s/fp32": {"torch.embedding_bag": TimingStats(median_us=99.0, p20_us=99.0, p80_us=99.0, reps=3)}
    }

    def prompt(interpreted: bool) -> str:
        def as_run(row):
            device = DeviceInfo(
                name="x", arch="a", torch="t", triton="t", python="p", interpreted=interpreted
            )
            result = row.result.model_copy(update={"device": device})
            return EvaluationRow(row.seq, row.candidate, result)

        return propose_prompt(
            problem="embedding_bag", arch="interpreter" if interpreted else "sm_90", best=as_run(best),
            base=best.candidate, attempts=[as_run(attempt)], llm_rows={}, baselines=baselines,
            kinds=["module"],
        )  # fmt: skip

    cpu, gpu = prompt(True), prompt(False)
    for figure in ("1234.5", "2345.6", "GB/s", "x vs torch.embedding_bag", "us geometric mean"):
        assert figure not in cpu, figure
        assert figure in gpu, figure
    assert "timed on the interpreter only" in cpu and "correct" in cpu


def test_tool_calling_carries_the_proposal_in_the_call_of_propose_kernel(monkeypatch) -> None:
    """structured_output = "tools": each request offers one propose_kernel tool, whose parameters
    are the proposal schema, and forces its call; the reply's proposal is the call's arguments. A
    server that refuses tools is asked again without them, and from then on."""
    from agent.llm.client import TOOL
    from agent.llm.proposals import parse_proposal, proposal_schema

    monkeypatch.setenv(KEY_ENV, KEY)
    knobs = proposal("knobs", knobs={"BLOCK_B": 8})
    with FakeLLMServer([Reply(knobs)]) as server:
        reply = _client(server.url, structured_output="tools").complete(
            MESSAGES, schema=proposal_schema(), on_attempt=lambda a: None
        )
        [sent] = server.requests
    assert (
        sent["tools"][0]["function"]["name"] == TOOL
        and sent["tools"][0]["function"]["parameters"]["type"] == "object"
    )
    assert (
        sent["tool_choice"] == {"type": "function", "function": {"name": TOOL}}
        and "response_format" not in sent
    )
    assert reply.finish_reason == "tool_calls" and parse_proposal(reply.text).knobs == {"BLOCK_B": 8}
    refused = Fail(
        400, message='"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'
    )
    with FakeLLMServer([refused, Reply(knobs), Reply(knobs)]) as server:
        client = _client(server.url, structured_output="tools", max_retries=0)
        attempts = []
        for _ in range(2):
            assert (
                parse_proposal(client.complete(MESSAGES, schema={}, on_attempt=attempts.append).text).kind
                == "knobs"
            )
        assert [a.outcome for a in attempts] == ["structured_output_refused", "replied", "replied"]
        assert "tools" in server.requests[0] and all("tools" not in r for r in server.requests[1:])


def test_a_knobs_reply_tunes_the_kernel_shown_and_the_prompt_lists_its_knobs() -> None:
    """A knobs reply for an LLM-written module writes the values into that module's KNOBS (its
    other knobs as they are), not into the template; the prompt lists the knobs the kernel shown
    keeps, at its values. A module that keeps none offers no knobs reply."""
    from agent.llm.prompting import propose_prompt

    own = with_knobs(GOOD, {"BLOCK_L": 16}).replace('"BLOCK_D": None', '"BLOCK_D": 96')
    base = Candidate(
        problem="embedding_bag", source=own, entry="embedding_bag", knobs=knob_values(own), origin="llm"
    )
    tuned = to_candidate(
        parse_proposal(proposal("knobs", knobs={"BLOCK_B": 2})),
        problem="embedding_bag",
        base=base,
        parent_id=base.id,
        knobs_of=knob_values,
    )
    assert tuned.source == with_knobs(own, {"BLOCK_B": 2}) and "LLM-written" in tuned.source
    assert tuned.knobs["BLOCK_B"] == 2 and tuned.knobs["BLOCK_L"] == 16 and tuned.knobs["BLOCK_D"] == 96
    assert tuned.entry == "embedding_bag" and tuned.parent_id == base.id
    with pytest.raises(ProposalError, match=r"unknown knob\(s\) \['BLOCK_D'\]; this kernel's knobs are"):
        to_candidate(
            parse_proposal(proposal("knobs", knobs={"BLOCK_D": 64})),
            problem="embedding_bag",
            base=base,
            parent_id=base.id,
        )
    # The template's point (the default kernel, a search's) is still rendered by the template,
    # its other knobs kept.
    point = Candidate(
        problem="embedding_bag",
        source=TEMPLATE.render({"BLOCK_L": 16}),
        entry=TEMPLATE.entry,
        knobs=TEMPLATE.validate({"BLOCK_L": 16}),
        origin="template",
    )
    from_point = to_candidate(
        parse_proposal(proposal("knobs", knobs={"BLOCK_B": 2})), problem="embedding_bag", base=point,
        parent_id=point.id,
    )  # fmt: skip
    assert from_point.source == TEMPLATE.render({"BLOCK_L": 16, "BLOCK_B": 2})

    def prompt(shown: Candidate) -> str:
        return propose_prompt(
            problem="embedding_bag", arch="interpreter", best=None, base=shown, attempts=[], llm_rows={},
            baselines={}, kinds=allowed_kinds("embedding_bag", shown),
        )  # fmt: skip

    text = prompt(base)
    section = text[text.index("## Knobs of the kernel above") :].split("\n## ")[0]
    assert "- BLOCK_L: one of" in section and "(now 16)" in section
    assert "BLOCK_D" not in section  # 96 is none of the template's choices: not a knob of this kernel
    # Without a KNOBS dict: no knobs to list, and a knobs reply is refused with what to do instead.
    bare = Candidate(
        problem="embedding_bag", source=GOOD.split("\nKNOBS = {")[0] + "\n" + GOOD.split("\n}\n", 1)[1],
        entry="embedding_bag", origin="llm",
    )  # fmt: skip
    assert knob_values(bare.source) == {} and allowed_kinds("embedding_bag", bare) == ["module", "edit"]
    assert "## Knobs of" not in prompt(bare)
    with pytest.raises(ProposalError, match=r"kind 'knobs' is not available.*\['module', 'edit'\]"):
        to_candidate(
            parse_proposal(proposal("knobs", knobs={"BLOCK_B": 2})), problem="embedding_bag", base=bare,
            parent_id=bare.id,
        )  # fmt: skip


def test_recent_attempts_of_the_lineage_are_its_own_and_others_are_apart() -> None:
    from agent.llm.prompting import lineage, other_attempts, propose_prompt

    def candidate(tag: str, parent: Candidate | None) -> Candidate:
        return Candidate(
            problem="embedding_bag", source=GOOD + f"# {tag}\n", entry="embedding_bag", origin="llm",
            parent_id=parent.id if parent else None,
        )  # fmt: skip

    a = candidate("a", None)
    a1 = candidate("a1", a)
    b = candidate("b", None)
    b1, b2 = candidate("b1", b), candidate("b2", b)
    a2 = candidate("a2", a1)
    rows = [_row(i, c, 10.0 + i) for i, c in enumerate([a, b, a1, b1, b2, a2], 1)]
    parent = rows[2]  # a1
    own = lineage(rows, parent, 6)
    assert [r.candidate.id for r in own] == [a.id, a1.id, a2.id]
    assert [r.candidate.id for r in lineage(rows, parent, 2)] == [a1.id, a2.id]
    others = other_attempts(rows, parent, 6 - len(own))
    assert [r.candidate.id for r in others] == [b.id, b1.id, b2.id]
    text = propose_prompt(
        problem="embedding_bag", arch="interpreter", best=parent, parent=parent, base=parent.candidate,
        attempts=own, others=others, llm_rows={}, baselines={}, kinds=["module", "edit"],
    )  # fmt: skip
    mine = text[text.index("## Recent attempts in this lineage") :].split("\n## ")[0]
    theirs = text[text.index("## Recent attempts of other lineages") :].split("\n## ")[0]
    assert all(f"`{c.id}`" in mine for c in (a, a1, a2)) and not any(c.id in mine for c in (b, b1, b2))
    assert all(f"`{c.id}`" in theirs for c in (b, b1, b2)) and not any(c.id in theirs for c in (a, a1, a2))
    alone = propose_prompt(
        problem="embedding_bag", arch="interpreter", best=parent, parent=parent, base=parent.candidate,
        attempts=own, llm_rows={}, baselines={}, kinds=["module", "edit"],
    )  # fmt: skip
    assert "other lineages" not in alone


def test_errors_in_the_bodies_vllm_and_ollama_send_are_told_apart(monkeypatch) -> None:
    """The `openai` client reads the message of OpenAI's, vLLM's and Ollama's (/v1) error bodies
    but not a bare {"error": "..."} (Ollama's native routes, some proxies): the classes come from
    the server's words in each."""
    monkeypatch.setenv(KEY_ENV, KEY)
    refused = "json_schema response_format is not supported by this model"
    for style in ("openai", "vllm", "ollama", "bare"):
        with FakeLLMServer([Fail(400, message=refused, style=style), Reply("a")]) as server:
            attempts = []
            client = _client(server.url, max_retries=0)
            assert (
                client.complete(MESSAGES, schema={"type": "object"}, on_attempt=attempts.append).text == "a"
            )
            assert attempts[0].outcome == "structured_output_refused" and refused in attempts[0].error, style


@pytest.mark.parametrize(("style", "form"), sorted(REFUSALS))
def test_a_server_that_refuses_a_structured_output_form_is_asked_without_it(monkeypatch, style, form) -> None:
    """vLLM refusing a schema its backend cannot compile, Ollama tools for a model without them,
    OpenAI either for some models: each server's own 400, in its body and words, before any model
    sees the request; the client asks again unconstrained, and from then on."""
    monkeypatch.setenv(KEY_ENV, KEY)
    with FakeLLMServer([Reply("a"), Reply("b")], style=style, refuses=[form]) as server:
        attempts = []
        client = _client(server.url, max_retries=0, structured_output=form)
        for expected in ("a", "b"):
            assert (
                client.complete(MESSAGES, schema={"type": "object"}, on_attempt=attempts.append).text
                == expected
            )
        first, *later = server.requests
    assert [a.outcome for a in attempts] == ["structured_output_refused", "replied", "replied"]
    said = REFUSALS[(style, form)].format(model="scripted")
    assert said in attempts[0].error
    field = "tools" if form == "tools" else "response_format"
    assert field in first and all(field not in r for r in later)


@pytest.mark.parametrize("style", sorted(UNKNOWN_MODEL))
def test_a_model_the_server_does_not_serve_is_its_404_in_its_words(tmp_path, monkeypatch, style) -> None:
    """Each server serves the models it lists and answers any other with its own 404: an
    unknown_model for good in a request, one sentence naming what it serves in the pre-flight.
    Ollama lists its models with their tags and serves a name without one as its :latest."""
    from agent.llm.preflight import preflight

    monkeypatch.setenv(KEY_ENV, KEY)
    with FakeLLMServer([Reply("pong")], style=style, models=["llama3:latest"]) as server:
        words = UNKNOWN_MODEL[style].format(model="qwen2.5-coder")
        with pytest.raises(LLMUnavailable, match="unknown_model") as info:
            _client(server.url, model="qwen2.5-coder").complete(
                MESSAGES, schema={}, on_attempt=lambda a: None
            )
        assert info.value.permanent and words in str(info.value)
        llm = config(tmp_path, server.url).llm.model_copy(update={"model": "qwen2.5-coder"})
        with pytest.raises(LLMConfigError, match="does not serve this model; it serves llama3:latest"):
            preflight(llm, {})
        untagged = _client(server.url, model="llama3", max_retries=0)
        if style == "ollama":
            assert untagged.complete(MESSAGES, schema={}, on_attempt=lambda a: None).text == "pong"
            assert preflight(llm.model_copy(update={"model": "llama3"}), {}).checked_by == "models"
        else:
            with pytest.raises(LLMUnavailable, match="unknown_model"):
                untagged.complete(MESSAGES, schema={}, on_attempt=lambda a: None)
    assert server.requests[-1]["model"] == "llama3"


def test_a_server_that_enforces_its_context_and_a_reasoning_model(monkeypatch) -> None:
    """A server with max_model_len rejects what does not fit with vLLM's 400 (no model sees it);
    the client asks again with what fits. A reasoning model's reply carries its thinking in
    reasoning_content, JSON-like braces and all: the proposal is read from content alone."""
    monkeypatch.setenv(KEY_ENV, KEY)
    answer = proposal("knobs", knobs={"BLOCK_B": 8})
    thinking = 'Maybe {"kind": "module", "source": "import torch"}? No: raise BLOCK_B.'
    with FakeLLMServer([Reply(answer, reasoning=thinking)], max_model_len=4096) as server:
        attempts = []
        reply = _client(server.url, max_retries=0, max_tokens=8000).complete(
            MESSAGES, schema={}, on_attempt=attempts.append
        )
        assert [a.outcome for a in attempts] == ["context_overflow", "replied"]
        assert "maximum context length is 4096 tokens" in attempts[0].error
        prompt = prompt_tokens(server.requests[0])
        assert [r["max_tokens"] for r in server.requests] == [8000, 4096 - prompt - 16]
    assert parse_proposal(reply.text).knobs == {"BLOCK_B": 8} and "Maybe" not in reply.text
    assert reply.completion_tokens == (len(answer) + len(thinking)) // 4  # thinking is billed


def test_a_slow_reply_is_a_timeout_even_with_its_headers_sent(monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    with FakeLLMServer([Reply("late", delay_s=1.0, headers_first=True), Reply("ok")]) as server:
        attempts = []
        start = time.monotonic()
        reply = _client(server.url, timeout_s=0.3, max_retries=1).complete(
            MESSAGES, schema={}, on_attempt=attempts.append
        )
        assert time.monotonic() - start < 0.9 and reply.text == "ok"
        assert [a.outcome for a in attempts] == ["timeout", "replied"]
