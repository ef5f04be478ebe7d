"""The one module that builds the LLM client and sends it requests.

Any OpenAI-compatible endpoint works (a hosted API, vLLM, SGLang, Ollama): base URL, model, and
an API key read from the environment variable the config names. The key is passed to the
`openai` client and nowhere else: it is not in the config, the store or any message.

Retries are done here rather than inside the `openai` client, so that every attempt is seen
(and recorded by the caller), a 200 whose body is not a chat completion is retried like a 5xx,
and the backoff is the config's: exponential from `backoff_initial_s` up to `backoff_max_s`,
or the server's Retry-After when it asks for longer.
"""

from __future__ import annotations

import dataclasses
import email.utils
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import openai
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from agent.config import LLMConfig, LLMConfigError

# Without `usage` in a reply (some servers leave it out), tokens are estimated from characters.
CHARS_PER_TOKEN = 4
ERROR_CHARS = 400


# Outcomes that no later request to the same server, model and key will change: the LLM
# proposer stops for good with the reason instead of pausing and trying again.
PERMANENT = ("auth", "unknown_model")
# The smallest completion worth asking for when a prompt leaves less of the context.
MIN_COMPLETION_TOKENS = 512
# Tokens kept free beside a prompt's estimate and its completion (the chat template's own).
PROMPT_MARGIN = 64
_CONTEXT = re.compile(
    r"maximum context length|context length|context window|max_model_len|prompt is too long|"
    r"too many tokens|exceeds the model|input is too long|longer than the model",
    re.IGNORECASE,
)
_STRUCTURED = re.compile(
    r"response_format|json_schema|guided|structured|grammar|schema|tool[ _-]?(choice|call)|tools|function",
    re.IGNORECASE,
)
TOOL = "propose_kernel"  # the tool a reply calls where structured_output is "tools"
_LIMIT = re.compile(r"maximum context length is (\d+)", re.IGNORECASE)
# The prompt's tokens, as vLLM (older and newer wording) and OpenAI-style APIs give them.
_PROMPT = re.compile(
    r"(\d+) (?:tokens )?in the messages|prompt contains (\d+) input tokens|messages resulted in (\d+) tokens",
    re.IGNORECASE,
)


# Immediate re-asks of one try: without structured output, with each smaller prompt, with fewer
# max_tokens; beyond these the try has failed.
MAX_REASKS = 12
# The next smaller form of a request's messages and what it leaves out, or None: there is none.
Shrink = Callable[[], tuple[list[dict], str] | None]


def estimate_tokens(messages: list[dict]) -> int:
    """A prompt's tokens on the safe side: 3 characters a token."""
    return sum(len(str(m.get("content", ""))) for m in messages) // 3


def structured_fields(form: str, schema: dict) -> dict:
    """The fields of a request that constrain its reply to `schema`, in structured-output form
    `form` (LLMConfig.structured_output; "auto" and "none": none)."""
    if form == "json_schema":
        return {
            "response_format": {"type": "json_schema", "json_schema": {"name": "proposal", "schema": schema}}
        }
    if form == "json_object":
        return {"response_format": {"type": "json_object"}}
    if form == "tools":
        tool = {
            "name": TOOL,
            "description": "Propose one kernel change: its arguments are the proposal.",
            "parameters": schema,
        }
        return {
            "tools": [{"type": "function", "function": tool}],
            "tool_choice": {"type": "function", "function": {"name": TOOL}},
        }
    return {}


def _said(attempt: Attempt, then: str) -> str:
    """The server's message and what comes of it, within ERROR_CHARS."""
    return (attempt.error or "")[: max(0, ERROR_CHARS - len(then))] + then


class LLMUnavailable(RuntimeError):
    """No usable reply for one request: retries exhausted, or an error retrying cannot fix
    (`permanent`: nor will any later request, see PERMANENT)."""

    def __init__(self, message: str, outcome: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.permanent = outcome in PERMANENT


def classify_http_error(code: int, message: str, request: dict) -> str:
    """The outcome of an HTTP error, by what servers say: a 400 may be a prompt plus max_tokens
    over the model's context (vLLM, SGLang, hosted APIs), a refused response_format, or another
    bad request; 401 and 403 a key that does not work; 404 a model the server does not serve;
    429 a rate limit (retried after the server's Retry-After)."""
    if code == 429:
        return "rate_limited"
    if code == 400 and _CONTEXT.search(message):
        return "context_overflow"
    constrained = "response_format" in request or "tools" in request
    if code in (400, 422) and constrained and _STRUCTURED.search(message):
        return "structured_output_refused"
    if code in (401, 403):
        return "auth"
    if code == 404:
        return "unknown_model"
    return f"http_{code}"


def context_limits(message: str) -> tuple[int | None, int | None]:
    """(the model's context, the prompt's tokens) from a context-overflow message, each None
    where the message does not say it."""
    limit, prompt = _LIMIT.search(message), _PROMPT.search(message)
    return (
        int(limit.group(1)) if limit else None,
        int(next(g for g in prompt.groups() if g)) if prompt else None,
    )


def error_message(exc: openai.APIStatusError) -> str:
    """What the server said about an HTTP error, in any of the bodies servers send: the
    `openai` client reads OpenAI's {"error": {"message": ...}} (which Ollama's /v1 routes send
    too) and vLLM's and SGLang's top-level {"object": "error", "message": ...}, but not a bare
    {"error": "..."} (Ollama's native routes, some proxies) nor a plain-text body, whose words (a
    context overflow, a refused response_format) would otherwise be lost."""
    body = exc.body
    said = None
    if isinstance(body, dict):
        error = body.get("error", body)
        said = error if isinstance(error, str) else error.get("message") if isinstance(error, dict) else None
        said = said or (body.get("detail") if isinstance(body.get("detail"), str) else None)
    elif isinstance(body, str):
        said = body.strip()
    if not said or said in exc.message:
        return exc.message
    return f"{exc.message} - {said}"


def api_key(config: LLMConfig) -> str:
    if config.api_key_env is None:
        return "unused"  # local servers take any key; the client insists on one
    key = os.environ.get(config.api_key_env)
    if not key:
        raise LLMConfigError(
            f"environment variable {config.api_key_env} (llm.api_key_env) is not set: export the API key "
            f"there, or set llm.api_key_env to the variable that holds it"
        )
    return key


def make_client(config: LLMConfig) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=config.base_url, api_key=api_key(config), timeout=config.timeout_s, max_retries=0
    )


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One HTTP request and what came of it."""

    number: int  # 0 for the first try of a request, then 1, 2, ... for its retries
    # replied, timeout, connection, garbage, or an HTTP error's class (classify_http_error):
    # context_overflow, structured_output_refused, auth, unknown_model, rate_limited, http_<code>
    outcome: str
    latency_s: float
    request: dict  # what was sent (model, messages, sampling), never the key
    text: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    retry_after_s: float | None = None
    transient: bool = False  # worth retrying: a timeout, 408, 409, 429, 5xx or garbage
    # Of a context overflow: (the model's context, the prompt's tokens) where the server says them.
    stated: tuple[int | None, int | None] = (None, None)


class _Transient(Exception):
    def __init__(self, attempt: Attempt) -> None:
        super().__init__(attempt.error)
        self.attempt = attempt


def _retry_after(headers) -> float | None:
    """Seconds the server asks to wait: retry-after-ms, or retry-after in seconds or as a date."""
    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return max(0.0, float(value) * scale)
        except ValueError:
            when = email.utils.parsedate_to_datetime(value) if name == "retry-after" else None
            if when is not None:
                return max(0.0, when.timestamp() - time.time())
    return None


class ChatClient:
    def __init__(
        self,
        config: LLMConfig,
        client: openai.OpenAI | None = None,
        *,
        context_tokens: int | None = None,
        structured_output: str | None = None,
    ) -> None:
        """`context_tokens`: the model's context where the pre-flight learned it;
        `structured_output`: the form the pre-flight chose where the config says "auto" (without
        one, "auto" starts with json_schema and falls back to none on a refusal)."""
        self.config = config
        self._client = client or make_client(config)
        form = structured_output or config.structured_output
        self.response_format = "json_schema" if form == "auto" else form
        # The model's context, from the pre-flight or once a context overflow has told it: each
        # prompt is then shrunk before it is sent where it leaves too little for the completion,
        # and each request's completion fits beside its own prompt (never more than llm.max_tokens).
        self.context_tokens = context_tokens
        self._room: int | None = None  # the completion tokens of the next try of this request
        self._backoff = wait_exponential(multiplier=config.backoff_initial_s, max=config.backoff_max_s)

    def _wait(self, retry_state) -> float:
        backoff = self._backoff(retry_state)
        exc = retry_state.outcome.exception()
        asked = exc.attempt.retry_after_s if isinstance(exc, _Transient) else None
        return max(backoff, min(asked, self.config.retry_after_max_s)) if asked is not None else backoff

    def complete(
        self,
        messages: list[dict],
        *,
        schema: dict,
        on_attempt: Callable[[Attempt], None],
        shrink: Shrink | None = None,
    ) -> Attempt:
        """The attempt that got a reply (its request holds the messages sent). `on_attempt` sees
        every attempt, failed ones included. LLMUnavailable after `max_retries` retries of
        transient failures, or at once on another HTTP error (401, 404, ...).

        A prompt plus max_tokens over the model's context is asked again at once: with a smaller
        prompt from `shrink` while it gives one (the next smaller form of these messages and what
        was left out, None when there is none), then with fewer max_tokens; where neither fits,
        LLMUnavailable with outcome context_overflow. Once the context is known, a prompt is
        shrunk before it is sent where it would leave less than llm.max_tokens."""
        number = 0
        current = self._fit(list(messages), shrink)

        def once() -> Attempt:
            nonlocal number, current
            for _ in range(MAX_REASKS + 1):
                attempt = self._once(current, schema, number)
                number += 1
                if attempt.outcome == "context_overflow":
                    attempt, current = self._overflowed(attempt, current, shrink)
                on_attempt(attempt)
                if attempt.outcome not in ("structured_output_refused", "context_overflow"):
                    break
                if not attempt.transient:
                    raise LLMUnavailable(f"{attempt.outcome}: {attempt.error}", attempt.outcome)
                # Without response_format, a smaller prompt or a completion that fits: ask again at once.
            if attempt.outcome == "replied":
                return attempt
            if attempt.transient:
                raise _Transient(attempt)
            raise LLMUnavailable(f"{attempt.outcome}: {attempt.error}", attempt.outcome)

        retrying = Retrying(
            stop=stop_after_attempt(self.config.max_retries + 1),
            wait=self._wait,
            retry=retry_if_exception_type(_Transient),
            reraise=True,
        )
        try:
            return retrying(once)
        except _Transient as exc:
            a = exc.attempt
            raise LLMUnavailable(f"{a.outcome} after {number} attempts: {a.error}", a.outcome) from None

    def _fit(self, messages: list[dict], shrink: Shrink | None) -> list[dict]:
        """`messages`, shrunk while the known context leaves too small a completion beside them
        (see _wanted)."""

        while (
            shrink is not None
            and self.context_tokens is not None
            and estimate_tokens(messages) + self._wanted(self.context_tokens) + PROMPT_MARGIN
            > self.context_tokens
        ):
            smaller = shrink()
            if smaller is None:
                break
            messages = smaller[0]
        return messages

    def _wanted(self, context: int) -> int:
        """The completion a prompt is shrunk to make room for: llm.max_tokens, or half the
        context where that is less (a completion that does not fit the context with any
        prompt is lowered instead)."""
        return min(self.config.max_tokens, context // 2)

    def _overflowed(
        self, attempt: Attempt, messages: list[dict], shrink: Shrink | None
    ) -> tuple[Attempt, list[dict]]:
        """A context overflow, and the messages of the next try: a smaller prompt while the
        prompt is what does not fit (it leaves less than `_wanted` for the completion, or the
        server does not say) and `shrink` gives one; else the same with a completion that fits
        (the room the server states, else half of what was asked); not transient when neither is
        left."""
        limit, prompt = attempt.stated
        self.context_tokens = limit or self.context_tokens
        context = self.context_tokens
        too_long = context is None or (prompt or estimate_tokens(messages)) + self._wanted(context) > context
        smaller = shrink() if shrink is not None and too_long else None
        if smaller is not None:
            said = _said(attempt, f"; asking again with a smaller prompt ({smaller[1]})")
            return dataclasses.replace(attempt, error=said, transient=True), smaller[0]
        asked = attempt.request["max_tokens"]
        room = limit - prompt - 16 if limit and prompt else asked // 2
        if MIN_COMPLETION_TOKENS <= room < asked:
            self._room = room
            said = _said(attempt, f"; asking again with max_tokens {room}")
            return dataclasses.replace(attempt, error=said, transient=True), messages
        said = _said(attempt, " (the prompt leaves no room for a completion)")
        return dataclasses.replace(attempt, error=said, transient=False), messages

    def _request(self, messages: list[dict], schema: dict) -> dict:
        request = {
            "model": self.config.model,
            "messages": messages,
            "temperature": self.config.temperature,
            "max_tokens": self._max_tokens(messages),
        }
        request.update(structured_fields(self.response_format, schema))
        return request

    def _max_tokens(self, messages: list[dict]) -> int:
        """llm.max_tokens, or less where the model's context is known to be too small for it
        beside this prompt (estimated at 3 characters a token, on the safe side)."""
        if self._room is not None:
            room, self._room = self._room, None
            return room
        if self.context_tokens is None:
            return self.config.max_tokens
        return max(
            MIN_COMPLETION_TOKENS,
            min(self.config.max_tokens, self.context_tokens - estimate_tokens(messages) - PROMPT_MARGIN),
        )

    def _once(self, messages: list[dict], schema: dict, number: int) -> Attempt:
        request = self._request(messages, schema)
        start = time.monotonic()

        def failed(outcome: str, error: str, **kw) -> Attempt:
            return Attempt(
                number=number,
                outcome=outcome,
                latency_s=time.monotonic() - start,
                request=request,
                error=error[:ERROR_CHARS],
                **kw,
            )

        try:
            completion = self._client.chat.completions.create(**request)
        except openai.APITimeoutError:
            return failed("timeout", f"no reply within {self.config.timeout_s:g} s", transient=True)
        except openai.APIConnectionError as exc:
            return failed("connection", f"{exc}: {exc.__cause__ or ''}", transient=True)
        except openai.APIStatusError as exc:
            code = exc.status_code
            exc.message = error_message(exc)
            outcome = classify_http_error(code, exc.message, request)
            if outcome == "structured_output_refused":
                self.response_format = "none"  # for the rest of the campaign: recorded per attempt
                return failed(outcome, f"{exc.message}; asking again unconstrained", transient=True)
            if outcome == "context_overflow":  # what to do next is complete's (_overflowed)
                return failed(outcome, exc.message, stated=context_limits(exc.message))
            return failed(
                outcome,
                exc.message,
                retry_after_s=_retry_after(exc.response.headers),
                transient=code in (408, 409, 429) or code >= 500,
            )
        except (openai.APIResponseValidationError, ValueError, TypeError) as exc:
            return failed("garbage", f"the reply is not a chat completion: {exc}", transient=True)
        choices = getattr(completion, "choices", None)
        text = _reply_text(choices[0].message) if choices else None
        if text is None:
            body = completion if isinstance(completion, str) else repr(completion)
            return failed("garbage", f"the reply is not a chat completion: {body[:200]}", transient=True)
        usage = getattr(completion, "usage", None)
        if usage is not None and usage.prompt_tokens is not None:
            prompt_tokens, completion_tokens = usage.prompt_tokens, usage.completion_tokens or 0
        else:
            prompt_tokens = sum(len(str(m.get("content", ""))) for m in messages) // CHARS_PER_TOKEN
            completion_tokens = len(text) // CHARS_PER_TOKEN
        return Attempt(
            number=number,
            outcome="replied",
            latency_s=time.monotonic() - start,
            request=request,
            text=text,
            finish_reason=choices[0].finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )


def _reply_text(message) -> str | None:
    """What the model said: the arguments of its propose_kernel call where it made one, else its
    content (None: neither, not a chat completion's message)."""
    for call in getattr(message, "tool_calls", None) or []:
        function = getattr(call, "function", None)
        if getattr(function, "name", None) == TOOL and isinstance(getattr(function, "arguments", None), str):
            return function.arguments
    content = getattr(message, "content", None)
    return content if isinstance(content, str) else None
