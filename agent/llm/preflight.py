"""The pre-flight check of an LLM endpoint, before a campaign spends anything on it: the server
answers, the key works, the configured model is served, and, where the server states the
model's context (vLLM's `max_model_len`, others' `context_length` or `context_window` in
/v1/models), it holds the campaign's largest first prompt beside `max_tokens`. Where the config
says `structured_output = "auto"`, it also finds the first form the server takes: json_schema,
then the propose_kernel tool, else plain JSON instructions.

Servers that list no models (some proxies), or do not list the configured one, get one tiny
chat request instead; Ollama's untagged names (llama3 for the llama3:latest it lists) need none.
Every failure is one sentence naming what to change (LLMConfigError); what was learned is
returned (`Preflight`), for the campaign's client, its store and `recforge llm check`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import openai
from pydantic import BaseModel, ConfigDict

from agent.config import LLMConfig, LLMConfigError
from agent.llm.client import (
    MIN_COMPLETION_TOKENS,
    PROMPT_MARGIN,
    classify_http_error,
    error_message,
    estimate_tokens,
    make_client,
    structured_fields,
)
from agent.llm.proposals import proposal_schema

_CONTEXT_FIELDS = ("max_model_len", "context_length", "context_window", "max_context_length")
# Tried in this order where structured_output is "auto"; "none" where the server refuses both.
PROBED_FORMS = ("json_schema", "tools")
PROBE_TOKENS = 16  # of a probe's completion: enough to start a JSON object or a tool call
_PING = [{"role": "user", "content": "ping"}]


class Preflight(BaseModel):
    """What the endpoint said about itself (recorded per start and resume of a campaign)."""

    model_config = ConfigDict(frozen=True)

    base_url: str
    model: str
    models: tuple[str, ...] = ()  # what the server lists (empty: it lists none)
    context_tokens: int | None = None  # the model's context, where the server says it
    checked_by: Literal["models", "chat"]  # GET /models, or a one-token request
    prompt_tokens: int = 0  # the largest first prompt, estimated as the client does
    prompt_problem: str | None = None  # whose first prompt that is
    structured_output: str  # the form requests use: the config's, or what the probe found
    refused: tuple[str, ...] = ()  # the forms the probe found refused, in the order tried

    def summary(self) -> str:
        """One line for `recforge llm check` and `campaign status`."""
        how = (
            f"listed among {len(self.models)} models"
            if self.checked_by == "models"
            else "answered a chat request"
        )
        context = f"context {self.context_tokens} tokens" if self.context_tokens else "context not stated"
        prompt = f"largest first prompt about {self.prompt_tokens} tokens ({self.prompt_problem})"
        refused = f" ({', '.join(self.refused)} refused)" if self.refused else ""
        return (
            f"{self.base_url} serves {self.model} ({how}; {context}; {prompt}); "
            f"structured output {self.structured_output}{refused}"
        )


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


def _listed(listed: list, model: str):
    """The entry of `model` among those the server lists, or None: itself, or (as Ollama serves
    a name without a tag) its `:latest`."""
    names = [model] if ":" in model else [model, f"{model}:latest"]
    return next((m for name in names for m in listed if m.id == name), None)


def _list_models(config: LLMConfig, client: openai.OpenAI) -> list | None:
    """What GET /models lists; None: the server has no such route (some proxies)."""
    try:
        return list(client.models.list())
    except openai.APIConnectionError as exc:
        raise _fail(
            config, f"no server answers ({exc.__cause__ or exc}); is it running at that URL?"
        ) from None
    except openai.APIStatusError as exc:
        if exc.status_code in (401, 403):
            raise _status_error(config, exc) from None
        return None


def _ask_for_model(config: LLMConfig, client: openai.OpenAI, names: tuple[str, ...]) -> None:
    """One one-token request for the model: LLMConfigError where it is not served."""
    try:
        client.chat.completions.create(model=config.model, messages=_PING, max_tokens=1)
    except openai.APIConnectionError as exc:
        raise _fail(config, f"no server answers ({exc.__cause__ or exc})") from None
    except openai.APIStatusError as exc:
        if exc.status_code == 404 and names:
            shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
            raise _fail(
                config, f"the server does not serve this model; it serves {shown}: set llm.model to one"
            ) from None
        raise _status_error(config, exc) from None


def _check_context(config: LLMConfig, context: int, prompt: int, problem: str | None) -> None:
    """LLMConfigError where the model's context cannot hold the prompt beside max_tokens."""
    if prompt + config.max_tokens + PROMPT_MARGIN <= context:
        return
    most = context - prompt - PROMPT_MARGIN
    fix = (
        f"set llm.max_tokens to {most} or less"
        if most >= MIN_COMPLETION_TOKENS
        else "use a model with a longer context"
    )
    raise _fail(
        config,
        f"its context of {context} tokens cannot hold llm.max_tokens = {config.max_tokens} beside "
        f"the first prompt for {problem} (about {prompt} tokens): {fix}",
    )


def probe_structured_output(
    config: LLMConfig, client: openai.OpenAI, schema: dict
) -> tuple[str, tuple[str, ...]]:
    """(the first form of PROBED_FORMS the server takes, else "none"; the forms it refused), each
    tried with a tiny request constrained to `schema` as the campaign's requests are. Only a
    refusal moves on to the next form: another failure says nothing of it."""
    refused: list[str] = []
    for form in PROBED_FORMS:
        request = {"model": config.model, "messages": _PING, "max_tokens": PROBE_TOKENS}
        request |= structured_fields(form, schema)
        try:
            client.chat.completions.create(**request)
        except openai.APIStatusError as exc:
            if (
                classify_http_error(exc.status_code, error_message(exc), request)
                == "structured_output_refused"
            ):
                refused.append(form)
                continue
        except openai.APIError:
            pass
        return form, tuple(refused)
    return "none", tuple(refused)


def preflight(
    config: LLMConfig, prompts: Mapping[str, list[dict]], client: openai.OpenAI | None = None
) -> Preflight:
    """What the endpoint says about itself; LLMConfigError with the reason if it cannot serve
    the campaign. `prompts`: per problem, the largest first prompt (agent.proposers.llm.first_prompts)."""
    client = client or make_client(config)  # LLMConfigError where the key's variable is unset
    listed = _list_models(config, client)
    names = tuple(m.id for m in listed or ())
    entry = _listed(listed or [], config.model)
    if entry is None:
        _ask_for_model(config, client, names)
    context = _context_of(entry) if entry is not None else None
    tokens, problem = max(((estimate_tokens(m), p) for p, m in prompts.items()), default=(0, None))
    if context is not None:
        _check_context(config, context, tokens, problem)
    form, refused = config.structured_output, ()
    if form == "auto":
        form, refused = probe_structured_output(config, client, proposal_schema())
    return Preflight(
        base_url=config.base_url,
        model=config.model,
        models=names,
        context_tokens=context,
        checked_by="models" if entry is not None else "chat",
        prompt_tokens=tokens,
        prompt_problem=problem,
        structured_output=form,
        refused=refused,
    )
