"""LLM proposer: asks a model behind an OpenAI-compatible endpoint for kernel variants.

One `LLMEndpoint` per campaign holds what the problems share: the client, the record of every
exchange in the store (so token and money budgets survive a kill), the budgets, and the outage
pause. One `LLMProposer` per problem holds the conversation logic:

- a fresh proposal: system prompt (reply format, screen rules) and a task prompt (problem,
  reference, shapes, hardware ceilings, the kernel to improve with its timings, roofline
  fraction and bound, recent attempts of its lineage with their errors and mismatches, and
  apart from them, to fill `history`, those of other lineages); the kernel to improve is one
  of the campaign's diverse elites (`choose_parent`), the best every other time, so that other
  lineages keep being improved too;
- validation before anything runs (`agent.llm.proposals`); an unusable reply goes back to the
  model with the reason, at most `format_retries` times, then the conversation is recorded as
  given up;
- repair turns: an LLM kernel that failed (compile error, runtime error, wrong, rejected by the
  screen, timed out) goes back into its own conversation with the evaluation's message,
  mismatches and log tail, up to `repair_depth` times along one lineage;
- nothing paid for is lost: every reply is recorded before it is read, a proposal with its
  candidate in one transaction, and the conversations live in the store: one cut short (a kill,
  an outage) continues from its recorded turns, a reply not yet read first.
"""

from __future__ import annotations

import itertools
import json
import math
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from agent.config import BudgetConfig, LLMConfig
from agent.failpoints import failpoint
from agent.incumbents import campaign_arch
from agent.llm import prompting
from agent.llm.client import Attempt, ChatClient, LLMUnavailable, Shrink
from agent.llm.proposals import ProposalError, allowed_kinds, parse_proposal, proposal_schema, to_candidate
from agent.proposers.base import ProposalRequest
from agent.proposers.knob_source import knob_values
from agent.store import EvaluationRow, LLMReply, Store
from sandbox.candidate import Candidate
from sandbox.result import Status
from search_space import get_problem
from search_space.template import get_template

# Failures the model can act on, given the message: these go back to it for repair.
REPAIRABLE = (
    Status.COMPILE_ERROR,
    Status.RUNTIME_ERROR,
    Status.WRONG,
    Status.STATIC_REJECTED,
    Status.TIMEOUT,
)


def choose_parent(elites: list[EvaluationRow], *, seed: int, turn: int) -> EvaluationRow | None:
    """The elite a fresh proposal improves: with `i = seed + turn`, the best (`elites[0]`) when
    `i` is even, else the other elites in turn. `turn` counts the problem's fresh LLM proposals
    so far (read from the store, so a resumed campaign continues the rotation); `seed` is the
    campaign's `proposer.seed`."""
    if not elites:
        return None
    i = seed + turn
    if len(elites) == 1 or i % 2 == 0:
        return elites[0]
    return elites[1 + (i // 2) % (len(elites) - 1)]


def _smaller_prompts(
    own: list[EvaluationRow], others: list[EvaluationRow], base: Candidate | None
) -> list[tuple[str, dict]]:
    """The smaller forms of a fresh prompt, each smaller than the one before, with what it
    leaves out: other lineages' attempts, then the older half of the lineage's own, then all of
    them, then the end of the kernel's source (showing half, then a quarter of its lines)."""
    forms = []
    if others:
        forms.append(("no attempts of other lineages", {"others": []}))
    if len(own) > 1:
        kept = own[len(own) - len(own) // 2 :]
        dropped = len(own) - len(kept)
        fewer = {"others": [], "attempts": kept, "left_out": dropped}
        forms.append((f"{dropped} of the lineage's attempts left out", fewer))
    none = {"others": [], "attempts": [], "left_out": len(own)}
    if own:
        forms.append(("no recent attempts", none))
    lines = len(base.source.strip().splitlines()) if base is not None else 0
    for part in (2, 4):
        if lines // part >= 20:
            shown = lines // part
            forms.append((f"the kernel's first {shown} of {lines} lines", none | {"source_lines": shown}))
    return forms


def starting_point(problem: str) -> Candidate | None:
    """What a fresh proposal improves before anything is evaluated: the problem's template at its
    defaults (None: it has none, and the model writes a whole module)."""
    if get_problem(problem).template is None:
        return None
    template = get_template(problem)
    return Candidate(
        problem=problem,
        source=template.render(template.defaults()),
        entry=template.entry,
        knobs=template.defaults(),
        origin="template",
    )


def fresh_messages(problem: str, base: Candidate | None, **shown) -> list[dict]:
    """The messages of a fresh proposal improving `base`: the system prompt and the task
    (`shown`: the rest of prompting.propose_prompt's arguments)."""
    kinds = allowed_kinds(problem, base)
    prompt = prompting.propose_prompt(problem=problem, arch=campaign_arch(), base=base, kinds=kinds, **shown)
    return [
        {"role": "system", "content": prompting.system_prompt(problem, kinds)},
        {"role": "user", "content": prompt},
    ]


def first_prompts(
    problems: Iterable[str], incumbents: Callable[[str], list[Candidate]]
) -> dict[str, list[dict]]:
    """Per problem, the largest of the messages its first fresh proposal may send: nothing
    evaluated yet, improving what the campaign starts from (the template at its defaults, or one
    of `incumbents(problem)`, the kernels dispatch runs today, once they are measured)."""
    out = {}
    for problem in problems:
        forms = [
            fresh_messages(problem, base, best=None, attempts=[], llm_rows={}, baselines={})
            for base in (starting_point(problem), *incumbents(problem))
        ]
        out[problem] = max(forms, key=lambda m: sum(len(x["content"]) for x in m))
    return out


class _Events:
    def message(self, text: str) -> None:
        pass


class LLMEndpoint:
    """The endpoint as a campaign uses it: every attempt recorded, budgets checked before each
    request, and after `outage_failures` requests in a row that failed (after their retries)
    a pause of `outage_cooldown_s`, recorded, during which the LLM proposers propose nothing."""

    def __init__(
        self,
        config: LLMConfig,
        budget: BudgetConfig,
        store: Store,
        campaign_id: str,
        events=None,
        client: ChatClient | None = None,
    ) -> None:
        self.config, self.budget, self.store, self.campaign_id = config, budget, store, campaign_id
        self.events = events or _Events()
        self.client = client or ChatClient(config)
        self.schema = proposal_schema()
        self.failures_in_a_row = 0

    def paused_until(self) -> float | None:
        """When the current pause ends (None: no pause, or stopped for good, see stopped)."""
        pauses = self.store.llm_pauses(self.campaign_id)
        until = max((u for _, u, _ in pauses if u != math.inf), default=None)
        if self.stopped() is not None:
            return None
        return until if until is not None and until > time.time() else None

    def budget_reached(self) -> str | None:
        spent = self.store.llm_spent(self.campaign_id)
        return self.budget.llm_reached(spent.tokens, spent.cost)

    def ask(
        self,
        messages: list[dict],
        *,
        problem: str,
        conversation: str,
        turn: int,
        shrink: Shrink | None = None,
    ) -> LLMReply:
        """The reply to `messages` (or to a smaller form from `shrink`, where the model's context
        needs one: the reply's request holds what was sent), as recorded in the store;
        LLMUnavailable if none. A prompt that fits the context in no form is no outage: it is
        left to the caller (`stop`, or give up the conversation)."""
        rows: list[int] = []

        def record(a: Attempt) -> None:
            rows.append(
                self.store.add_llm_exchange(
                    self.campaign_id,
                    problem=problem,
                    conversation=conversation,
                    turn=turn,
                    attempt=a.number,
                    model=self.config.model,
                    request_json=json.dumps(a.request),
                    response_text=a.text,
                    finish_reason=a.finish_reason,
                    outcome=a.outcome,
                    error=a.error,
                    prompt_tokens=a.prompt_tokens,
                    completion_tokens=a.completion_tokens,
                    cost=self.config.cost(a.prompt_tokens, a.completion_tokens),
                    latency_s=a.latency_s,
                )
            )

        try:
            attempt = self.client.complete(messages, schema=self.schema, on_attempt=record, shrink=shrink)
        except LLMUnavailable as exc:
            if exc.outcome == "context_overflow":
                raise
            if exc.permanent:
                self._stop(str(exc))
                raise
            self.failures_in_a_row += 1
            if self.failures_in_a_row >= self.config.outage_failures:
                self._pause(str(exc))
            raise
        self.failures_in_a_row = 0
        failpoint("after-reply-recorded")
        return LLMReply(
            seq=rows[-1],
            turn=turn,
            request=attempt.request,
            text=attempt.text or "",
            finish_reason=attempt.finish_reason,
            outcome=attempt.outcome,
            error=None,
        )

    def stopped(self) -> str | None:
        """Why the LLM proposer stopped for good (a key that does not work, a model the server
        does not serve), or None."""
        pauses = self.store.llm_pauses(self.campaign_id)
        return next((reason for _, until, reason in pauses if until == math.inf), None)

    def stop(self, error: str) -> None:
        """Stop the LLM proposer for good, with the reason (recorded; lifted by a resume whose
        pre-flight passes)."""
        self._stop(error)

    def _stop(self, error: str) -> None:
        reason = f"the LLM proposer stopped: {error}"
        self.store.add_llm_pause(self.campaign_id, time.time(), math.inf, reason)
        self.events.message(reason)

    def _pause(self, last_error: str) -> None:
        now = time.time()
        until = now + self.config.outage_cooldown_s
        reason = f"{self.failures_in_a_row} requests in a row failed after retries; last: {last_error}"
        self.store.add_llm_pause(self.campaign_id, now, until, reason)
        self.failures_in_a_row = 0
        self.events.message(
            f"LLM proposer paused for {self.config.outage_cooldown_s:.0f} s ({reason}); other proposers go on"
        )


@dataclass
class _Conversation:
    """One ask for a proposal: a fresh proposal's conversation, or a repair turn that continues
    the conversation of the kernel it repairs."""

    id: str
    base: Candidate | None  # what knobs and edits apply to
    parent_id: str | None
    kinds: list[str]
    messages: list[dict]  # what the next request sends
    turn: int = 0  # assistant replies so far in the conversation
    first_turn: int = 0  # where this ask began
    depth: int = 0  # repairs along the lineage
    repair_of: str | None = None
    unread: LLMReply | None = None  # a reply recorded before a kill and not yet read

    @property
    def replies(self) -> int:
        """The replies this ask has had."""
        return self.turn - self.first_turn

    def answered(self, reply: LLMReply, error: str | None = None) -> None:
        """The conversation after `reply`, and where it was unusable, the reason going back."""
        self.messages = [*reply.request["messages"], {"role": "assistant", "content": reply.text}]
        if error is not None:
            self.messages.append({"role": "user", "content": prompting.invalid_prompt(error, self.kinds)})


class LLMProposer:
    kind = "llm"

    def __init__(
        self,
        problem: str,
        endpoint: LLMEndpoint,
        *,
        seed: int = 0,
        rejections: Callable[[str], list[str]] | None = None,
    ) -> None:
        """`rejections(op)`: the reasons reviewers gave for rejecting the op's kernels (shown in
        every fresh prompt)."""
        self.problem = problem
        self.rejections = rejections
        self.endpoint = endpoint
        self.seed = seed
        self.config = endpoint.config
        self.store = endpoint.store
        self.campaign_id = endpoint.campaign_id
        self.empty_rounds = 0
        self._stalled = False  # the endpoint failed or a budget ran out during this round

    @property
    def exhausted(self) -> str | None:
        stopped = self.endpoint.stopped()
        if stopped is not None:
            return stopped
        if self.empty_rounds >= self.config.max_empty_rounds:
            return (
                f"the LLM proposed nothing usable for {self.problem} in {self.empty_rounds} rounds in a row"
            )
        return None

    def paused_until(self) -> float | None:
        return self.endpoint.paused_until()

    def _usable(self) -> bool:
        if self.endpoint.paused_until() is not None or self.endpoint.budget_reached() is not None:
            self._stalled = True
        return not self._stalled

    def propose(self, n: int, request: ProposalRequest) -> list[Candidate]:
        if n <= 0:
            return []
        seen = set(request.seen)
        out: list[Candidate] = []

        def take(candidate: Candidate | None) -> None:
            if candidate is not None:
                out.append(candidate)
                seen.add(candidate.id)

        # What was paid for and not evaluated (a kill between the reply and its evaluation) first,
        # even where the LLM has stopped since.
        for stored in self.store.unevaluated_llm_proposals(self.campaign_id, self.problem):
            if len(out) < n and stored.id not in seen:
                take(stored)
        if self.exhausted:
            return out
        self._stalled = False
        # Then the conversations cut short with replies in hand, and repairs: a failure with its
        # error in hand is the most informed next step.
        for conversation in itertools.chain(self._cut_short(), self._repairs()):
            if len(out) >= n or not self._usable():
                break
            take(self._converse(conversation, seen))
        for _ in range(n - len(out)):
            if not self._usable():
                break
            take(self._fresh(request, seen))
        if out:
            self.empty_rounds = 0
        elif not self._stalled:
            self.empty_rounds += 1
        return out

    def _fresh(self, request: ProposalRequest, seen: set[str]) -> Candidate | None:
        llm_rows = self.store.llm_proposals(self.campaign_id, self.problem)
        elites = request.elites or ([request.best] if request.best is not None else [])
        parent = choose_parent(elites, seed=self.seed, turn=sum(r.depth == 0 for r in llm_rows.values()))
        # What an edit applies to and the prompt shows: the chosen elite, else the starting point.
        base = parent.candidate if parent is not None else starting_point(self.problem)
        kinds = allowed_kinds(self.problem, base)
        own = prompting.lineage(request.rows, parent, self.config.history)
        others = prompting.other_attempts(request.rows, parent, self.config.history - len(own))

        # The timings the prompt shows (the parent's, else the best's), beside the baselines of
        # their kind of device.
        shown = parent or request.best
        baselines = self.store.baselines(self.campaign_id, self.problem, shown.result.kind) if shown else {}

        def messages(**smaller) -> list[dict]:
            return fresh_messages(
                self.problem,
                base,
                best=request.best,
                parent=parent,
                llm_rows=llm_rows,
                baselines=baselines,
                rejected=self.rejections(self.problem) if self.rejections else None,
                **({"attempts": own, "others": others} | smaller),
            )

        forms = iter(_smaller_prompts(own, others, base))

        def shrink() -> tuple[list[dict], str] | None:
            form = next(forms, None)
            return None if form is None else (messages(**form[1]), form[0])

        parent_id = parent.candidate.id if parent is not None else None
        conversation = _Conversation(
            id=secrets.token_hex(6), base=base, parent_id=parent_id, kinds=kinds, messages=messages()
        )
        self.store.add_llm_conversation(
            self.campaign_id, conversation.id, problem=self.problem, parent_id=parent_id
        )
        return self._converse(conversation, seen, shrink=shrink)

    def _cut_short(self) -> Iterator[_Conversation]:
        """Fresh conversations cut short after a reply (a kill, an outage), as their recorded
        turns leave them."""
        for conversation, parent_id in self.store.open_llm_conversations(self.campaign_id, self.problem):
            parent = self.store.candidate(self.campaign_id, parent_id) if parent_id is not None else None
            base = parent if parent is not None else starting_point(self.problem)
            kinds = allowed_kinds(self.problem, base)
            yield self._continued(
                _Conversation(id=conversation, base=base, parent_id=parent_id, kinds=kinds, messages=[])
            )

    def _repairs(self) -> Iterator[_Conversation]:
        """The failed LLM kernels whose repair has not concluded, each sent back into its own
        conversation with the evaluation's error, or where that repair was cut short, as its
        recorded turns leave it."""
        for failed in self.store.llm_repairables(
            self.campaign_id, self.problem, tuple(s.value for s in REPAIRABLE), self.config.repair_depth
        ):
            candidate = self.store.candidate(self.campaign_id, failed.candidate_id)
            [row] = [
                r
                for r in self.store.evaluations(self.campaign_id, self.problem)
                if r.candidate.id == candidate.id
            ]
            kinds = allowed_kinds(self.problem, candidate)
            turn = sum(m["role"] == "assistant" for m in failed.messages)
            repair = {"role": "user", "content": prompting.repair_prompt(candidate, row.result, kinds)}
            yield self._continued(
                _Conversation(
                    id=failed.conversation,
                    base=candidate,
                    parent_id=candidate.id,
                    kinds=kinds,
                    messages=[*failed.messages, repair],
                    turn=turn,
                    first_turn=turn,
                    depth=failed.depth + 1,
                    repair_of=candidate.id,
                )
            )

    def _continued(self, conversation: _Conversation) -> _Conversation:
        """`conversation` after the latest reply recorded since its ask began, if any: one not
        yet read is read first, an unusable one is asked again with the recorded reason."""
        last = self.store.last_llm_reply(self.campaign_id, conversation.id, conversation.first_turn)
        if last is None:
            return conversation
        conversation.turn = last.turn + 1
        if last.outcome == "replied":
            conversation.unread = last
        else:
            conversation.answered(last, last.error)
        return conversation

    def _converse(
        self, conversation: _Conversation, seen: set[str], shrink: Shrink | None = None
    ) -> Candidate | None:
        """The first usable proposal of up to 1 + format_retries replies to this ask (those
        recorded before a kill included). The ask concludes (in the store) with a proposal or
        when it gives up, not when the endpoint or a budget cuts it short: then it continues
        later from its recorded turns. `shrink` gives smaller forms of the first request (a
        fresh proposal's prompt).

        A request that fits the model's context in no form ends the conversation: a fresh
        proposal's (its smallest prompt does not fit) stops the LLM proposer for good, with the
        reason, since every fresh prompt is about as long; a repair or re-ask (a longer
        conversation) is given up."""
        reply = conversation.unread  # read before anything is asked
        while True:
            if reply is None:
                if conversation.replies >= 1 + self.config.format_retries:
                    self.endpoint.events.message(
                        f"{self.problem}: the LLM gave no usable proposal in {conversation.replies} replies "
                        f"(conversation {conversation.id}); see the store's llm_exchanges"
                    )
                    break
                if not self._usable():
                    return None
                try:
                    reply = self._ask(conversation, shrink)
                except LLMUnavailable as exc:
                    if exc.outcome != "context_overflow":
                        self._stalled = True
                        return None
                    self._overflowed(conversation, exc)
                    break
            candidate = self._read(reply, conversation, seen)
            if candidate is not None:
                return candidate
            reply = None
        self.store.conclude_llm_ask(self.campaign_id, conversation.id, conversation.repair_of)
        return None

    def _ask(self, conversation: _Conversation, shrink: Shrink | None) -> LLMReply:
        reply = self.endpoint.ask(
            conversation.messages,
            problem=self.problem,
            conversation=conversation.id,
            turn=conversation.turn,
            shrink=shrink if conversation.turn == 0 else None,
        )
        conversation.turn += 1
        return reply

    def _overflowed(self, conversation: _Conversation, exc: LLMUnavailable) -> None:
        if conversation.turn == 0 and conversation.repair_of is None:
            self.endpoint.stop(f"{exc}: even the smallest prompt of a fresh proposal does not fit")
        else:
            self.endpoint.events.message(
                f"{self.problem}: conversation {conversation.id} given up: it no longer fits "
                f"the model's context ({exc})"
            )

    def _read(self, reply: LLMReply, conversation: _Conversation, seen: set[str]) -> Candidate | None:
        """The proposal in `reply`, stored with its candidate; None where it is unusable (the
        reason recorded and, in the conversation, going back to the model)."""
        try:
            if reply.finish_reason == "length":
                raise ProposalError(
                    f"the reply was cut off at {reply.request.get('max_tokens')} tokens; send a shorter "
                    "reply (an edit instead of a whole module)"
                )
            proposal = parse_proposal(reply.text)
            candidate = to_candidate(
                proposal,
                problem=self.problem,
                base=conversation.base,
                parent_id=conversation.parent_id,
                knobs_of=knob_values,
            )
            if candidate.id in seen:
                raise ProposalError(
                    f"that kernel is identical to one already evaluated or proposed ({candidate.id}); "
                    "propose something different"
                )
        except ProposalError as exc:
            self.store.set_llm_outcome(reply.seq, "invalid", str(exc))
            failpoint("mid-repair" if conversation.repair_of else "mid-reask")
            conversation.answered(reply, str(exc))
            return None
        conversation.answered(reply)
        self.store.add_llm_proposal(
            self.campaign_id,
            seq=reply.seq,
            candidate=candidate,
            problem=self.problem,
            conversation=conversation.id,
            kind=proposal.kind,
            rationale=proposal.rationale,
            depth=conversation.depth,
            repair_of=conversation.repair_of,
            messages=conversation.messages,
        )
        failpoint("after-outcome")
        return candidate
