"""The pre-flight check of an LLM endpoint, before a campaign spends anything on it: the server
answers, the key works, the configured model is served, and, where the server states the
model's context (vLLM's `max_model_len`, others' `context_length` or `context_window` in
/v1/models), the completion budget leaves room for a prompt.

Servers that list no models (some proxies), or do not list the configured one (an alias such as
Ollama's llama3 for llama3:latest), get one tiny chat request instead. Every failure is
one sentence naming what to change (LLMConfigError); what was learned is returned for
`recforge llm check` to show.
"""

from __future__ import annotations

from dataclasses import dataclass

import openai

from agent.config import LLMConfig, LLMConfigError
from agent.llm.client import error_message, make_client

# The prompts' size, in tokens, that the context must hold beside max_tokens: a prompt shows a
# kernel of up to about 25k characters plus the problem, its shapes and recent attempts.
PROMPT_TOKENS = 10_000
_CONTEXT_FIELDS = ("max_model_len", "context_length", "context_window", "max_context_length")


@dataclass(frozen=True)
class Preflight:
    base_url: str
    model: str
    models: tuple[str, ...]  # what the server lists (empty: it lists none)
    context_tokens: int | None  # the model's context, where the server says it
    checked_by: str  # "models" (GET /models) or "chat" (a one-token request)


def _fail(config: LLMConfig, what: str) -> LLMConfigError:
    return LLMConfigError(f"LLM endpoint {config.base_url} (model {config.model}): {what}")


def _context_of(entry) -> int | None:
    data = entry.model_dump() if hasattr(entry, "model_dump") else dict(entry)
    extra = getattr(entry, "model_extra", None) or {}
    for name in _CONTEXT_FIELDS:
        value = data.get(name, extra.get(name))
        if isinstance(value, int) and value > 0:
            return value
    return None


def _status_error(config: LLMConfig, exc: openai.APIStatusError) -> LLMConfigError:
    exc.message = error_message(exc)  # a bare {"error": "..."} too
    if exc.status_code in (401, 403):
        key = f"the key in {config.api_key_env}" if config.api_key_env else "a request without a key"
        return _fail(config, f"the server refused {key} (HTTP {exc.status_code}: {exc.message[:200]})")
    if exc.status_code == 404:
        return _fail(config, f"the server does not serve this model (HTTP 404: {exc.message[:200]})")
    return _fail(config, f"HTTP {exc.status_code} from the server: {exc.message[:200]}")


def preflight(config: LLMConfig, client: openai.OpenAI | None = None) -> Preflight:
    """What the endpoint says about itself; LLMConfigError with the reason if it cannot serve
    the campaign."""
    client = client or make_client(config)  # LLMConfigError where the key's variable is unset
    try:
        listed = list(client.models.list())
    except openai.APIConnectionError as exc:
        raise _fail(
            config, f"no server answers ({exc.__cause__ or exc}); is it running at that URL?"
        ) from None
    except openai.APIStatusError as exc:
        if exc.status_code in (401, 403):
            raise _status_error(config, exc) from None
        listed = None  # a server without /models: a tiny request says what it must
    names = tuple(m.id for m in listed or ())
    if not listed or config.model not in names:
        # A server without /models, or one that serves the model under a name it does not list
        # (Ollama lists llama3:latest and serves llama3): one tiny request says what it must.
        try:
            client.chat.completions.create(
                model=config.model, messages=[{"role": "user", "content": "ping"}], max_tokens=1
            )
        except openai.APIConnectionError as exc:
            raise _fail(config, f"no server answers ({exc.__cause__ or exc})") from None
        except openai.APIStatusError as exc:
            if exc.status_code == 404 and names:
                shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
                raise _fail(
                    config, f"the server does not serve this model; it serves {shown}: set llm.model to one"
                ) from None
            raise _status_error(config, exc) from None
        return Preflight(config.base_url, config.model, names, None, "chat")
    entry = next(m for m in listed if m.id == config.model)
    context = _context_of(entry)
    if context is not None and config.max_tokens + PROMPT_TOKENS > context:
        most = context - PROMPT_TOKENS
        fix = f"set llm.max_tokens to {most} or less" if most >= 512 else "use a model with a longer context"
        raise _fail(
            config,
            f"its context of {context} tokens cannot hold llm.max_tokens = {config.max_tokens} beside "
            f"a prompt of about {PROMPT_TOKENS} tokens: {fix}",
        )
    return Preflight(config.base_url, config.model, names, context, "models")
