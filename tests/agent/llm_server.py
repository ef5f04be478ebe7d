"""A real OpenAI-compatible HTTP server on loopback that answers from a scripted policy.

Tests point the real `openai` client at it, so retries, timeouts, structured-output parsing,
repair turns and budgets run end to end without a hosted model. Each POST to
/v1/chat/completions that a model would see takes the next step of the script (or `default`
once it is used up); a step is a behaviour, or a function of the request's JSON that returns one.

It behaves as the server it stands for (`style`: "openai", "vllm" or "ollama") does before any
model sees a request, answering these itself without taking a step of the script:

- it serves the models it lists (`models`) and answers any other with that server's 404
  (Ollama also serves a name without a tag as its `:latest`, which is what it lists);
- a structured-output form it refuses (`refuses`: "json_schema", "tools") gets that server's
  400 and words (see REFUSALS);
- a prompt, counted at 4 characters a token, plus max_tokens over its context (`max_model_len`)
  gets vLLM's 400, and vLLM's listing states that context;
- a streamed request (`stream`) gets a 400: the client never streams (agent/llm/client.py), so
  what matters is slow replies that are not streamed, scripted as `Reply.delay_s` (the first byte
  late) and `Reply.headers_first` (the headers at once, the body late).

Scripted errors (`Fail`) have each server's error body (`Fail.style`), and replies of reasoning
models carry their thinking in `reasoning_content` beside the answer (`Reply.reasoning`).
Everything is bounded: the server listens on 127.0.0.1 only and every delay is the script's.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Reply:
    """A chat completion whose message content is `content`."""

    content: str
    prompt_tokens: int | None = None  # None: a quarter of the request's characters
    completion_tokens: int | None = None  # None: a quarter of the content's characters
    delay_s: float = 0.0  # beyond the client's timeout, this is a timeout
    finish_reason: str = "stop"
    usage: bool = True
    # As the arguments of a call of the tool the request forces (tool_choice), as servers with
    # tool calling answer; None: so where the request forces one, False: as content regardless.
    as_tool: bool | None = None
    # A reasoning model's thinking, in the message's reasoning_content (vLLM's and SGLang's
    # reasoning parsers, DeepSeek's API), beside the answer in content.
    reasoning: str | None = None
    # The status line and headers at once, the body after delay_s (a server that holds the
    # connection open while it generates): the client's read timeout still applies.
    headers_first: bool = False


@dataclass
class Fail:
    """An HTTP error (500, 429 with Retry-After, 401, ...)."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    message: str = "scripted failure"
    style: str = "openai"  # the error body's form: see error_body

    def body(self) -> str:
        return json.dumps(error_body(self.style, self.status, self.message))


def error_body(style: str, status: int, message: str) -> dict:
    """An error body as each server sends it: "openai" {"error": {"message", "type", "param",
    "code"}}; "vllm" (and SGLang) {"object": "error", "message", "type", "param", "code"} at the
    top level; "ollama" OpenAI's form with Ollama's three types (its /v1 routes wrap its errors
    so); "bare" {"error": "message"} (Ollama's native /api routes, some proxies)."""
    if style == "vllm":
        kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "Error")
        return {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    if style == "ollama":
        kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "api_error")
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}
    if style == "bare":
        return {"error": message}
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


# What each server says of a model it does not serve, with a 404.
UNKNOWN_MODEL = {
    "openai": "The model `{model}` does not exist or you do not have access to it.",
    "vllm": "The model `{model}` does not exist.",
    "ollama": 'model "{model}" not found, try pulling it first',
}
# What each server says, with a 400, of a structured-output form it refuses. vLLM's guided
# decoding refuses schemas its backend cannot compile. Ollama takes a json_schema
# response_format (as its `format`) for every model, but refuses tools for a model whose template
# has none with this 400 rather than ignoring them (its chat handler's capability check).
REFUSALS = {
    ("openai", "json_schema"): (
        "Invalid parameter: 'response_format' of type 'json_schema' is not supported with this model."
    ),
    ("openai", "tools"): "Unsupported parameter: 'tools' is not supported with this model.",
    ("vllm", "json_schema"): "The provided JSON schema contains features not supported by xgrammar.",
    ("ollama", "tools"): "registry.ollama.ai/library/{model} does not support tools",
}


def vllm_context_error(limit: int, prompt: int, completion: int) -> Fail:
    """vLLM's 400 for a prompt plus max_tokens over the model's context (max_model_len)."""
    return Fail(
        400,
        message=(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the completion). "
            "Please reduce the length of the messages or completion."
        ),
        style="vllm",
    )


def prompt_tokens(request: dict) -> int:
    """A request's prompt tokens as this server counts them: 4 characters a token."""
    return sum(len(str(m.get("content") or "")) for m in request.get("messages", [])) // 4


@dataclass
class Garbage:
    """A 200 whose body is not a chat completion."""

    body: str = "<html><body>upstream proxy error</body></html>"
    content_type: str = "text/html"


Behaviour = Reply | Fail | Garbage
Step = Behaviour | Callable[[dict], Behaviour]


def proposal(kind: str, rationale: str = "scripted", **fields) -> str:
    """A reply's content: one proposal as JSON."""
    return json.dumps({"kind": kind, "rationale": rationale, **fields})


class FakeLLMServer:
    def __init__(
        self,
        script: Iterable[Step] = (),
        default: Step | None = None,
        *,
        style: str = "openai",
        models: list[str | dict] | Fail | None = None,
        max_model_len: int | None = None,
        refuses: Iterable[str] = (),
    ) -> None:
        """`style`: the server it behaves as, "openai", "vllm" or "ollama". `models`: what GET
        /v1/models lists and the chat route serves, names (listed as that server lists them) or
        whole entries; default one model, "scripted"; a Fail: the listing fails, and any model
        is served. `max_model_len`: the context this server enforces, as vLLM does (None: none).
        `refuses`: the structured-output forms it refuses, "json_schema" or "tools", each one
        that server refuses (REFUSALS)."""
        unknown = [form for form in refuses if (style, form) not in REFUSALS]
        if style not in UNKNOWN_MODEL or unknown:
            raise ValueError(f"a {style} server refusing {unknown} is not modelled (see REFUSALS)")
        self.script: list[Step] = list(script)
        self.default = default
        self.style = style
        self.max_model_len = max_model_len
        self.refuses = frozenset(refuses)
        listed = ["scripted"] if models is None else models
        self.models = listed if isinstance(listed, Fail) else [self._entry(m) for m in listed]
        self.requests: list[dict] = []  # bodies of the chat requests, in order, refused ones too
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _entry(self, model: str | dict) -> dict:
        """A /v1/models entry as this server lists it: vLLM's states its context."""
        if isinstance(model, dict):
            return model
        entry = {"id": model, "object": "model", "created": 1_700_000_000}
        if self.style == "vllm":
            context = {} if self.max_model_len is None else {"max_model_len": self.max_model_len}
            return entry | {"owned_by": "vllm", "root": model, "parent": None} | context
        return entry | {"owned_by": "library" if self.style == "ollama" else "system"}

    def served(self, model: str) -> str | None:
        """The name the server serves `model` under, or None: it does not serve it. Ollama takes
        a name without a tag as its `:latest` (it lists llama3:latest and serves llama3)."""
        if isinstance(self.models, Fail):
            return model
        names = {m["id"] for m in self.models}
        if model in names:
            return model
        tagged = f"{model}:latest"
        return tagged if self.style == "ollama" and ":" not in model and tagged in names else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> FakeLLMServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, *steps: Step) -> None:
        with self._lock:
            self.script.extend(steps)

    def _next(self, body: dict, headers: dict[str, str]) -> Behaviour:
        with self._lock:
            self.requests.append(body)
            self.headers.append(headers)
            refused = self._refusal(body)
            if refused is not None:
                return refused
            step = self.script.pop(0) if self.script else self.default
        if step is None:
            return Fail(503, message="the scripted policy has no more replies")
        return step(body) if callable(step) else step

    def _refusal(self, body: dict) -> Fail | None:
        """What the server answers itself, before a model sees the request (no step is taken):
        a streamed request, a model it does not serve, a structured-output form it refuses, a
        prompt over its context; None: a model sees it."""
        if body.get("stream"):
            return Fail(400, message="this test server does not stream", style=self.style)
        model = self.served(str(body.get("model")))
        if model is None:
            return Fail(
                404, message=UNKNOWN_MODEL[self.style].format(model=body.get("model")), style=self.style
            )
        form = _structured_form(body)
        if form in self.refuses:
            return Fail(400, message=REFUSALS[(self.style, form)].format(model=model), style=self.style)
        if self.max_model_len is not None:
            prompt, completion = prompt_tokens(body), int(body.get("max_tokens") or 0)
            if prompt + completion > self.max_model_len:
                return vllm_context_error(self.max_model_len, prompt, completion)
        return None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(
                self,
                status: int,
                body: str,
                content_type: str,
                headers: dict | None = None,
                delay_s: float = 0,
            ) -> None:
                data = body.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    if delay_s:
                        self.wfile.flush()
                        time.sleep(delay_s)
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout): nothing to answer

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    if isinstance(server.models, Fail):
                        self._send(server.models.status, server.models.body(), "application/json")
                        return
                    self._send(200, json.dumps({"object": "list", "data": server.models}), "application/json")
                else:
                    self._send(404, json.dumps({"error": {"message": "not found"}}), "application/json")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                raw = self.rfile.read(length)
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, json.dumps({"error": {"message": "not found"}}), "application/json")
                    return
                body = json.loads(raw)
                behaviour = server._next(body, {k.lower(): v for k, v in self.headers.items()})
                if isinstance(behaviour, Fail):
                    self._send(behaviour.status, behaviour.body(), "application/json", behaviour.headers)
                elif isinstance(behaviour, Garbage):
                    self._send(200, behaviour.body, behaviour.content_type)
                elif behaviour.headers_first:
                    self._send(
                        200,
                        json.dumps(_completion(body, behaviour)),
                        "application/json",
                        delay_s=behaviour.delay_s,
                    )
                else:
                    if behaviour.delay_s:
                        time.sleep(behaviour.delay_s)
                    self._send(200, json.dumps(_completion(body, behaviour)), "application/json")

        return Handler


def _structured_form(request: dict) -> str | None:
    """How a request constrains the reply: "tools", "json_schema", "json_object" or None."""
    if request.get("tools"):
        return "tools"
    return (request.get("response_format") or {}).get("type")


def _completion(request: dict, reply: Reply) -> dict:
    prompt = reply.prompt_tokens if reply.prompt_tokens is not None else prompt_tokens(request)
    thought = len(reply.reasoning or "")  # reasoning tokens count as completion tokens, as servers bill them
    completion = (
        reply.completion_tokens
        if reply.completion_tokens is not None
        else (len(reply.content) + thought) // 4
    )
    out = {
        "id": f"chatcmpl-{time.monotonic_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.get("model", "scripted"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply.content},
                "finish_reason": reply.finish_reason,
            }
        ],
    }
    if reply.reasoning is not None:
        out["choices"][0]["message"]["reasoning_content"] = reply.reasoning
    forced = (
        (request.get("tool_choice") or {}).get("function", {}).get("name")
        if isinstance(request.get("tool_choice"), dict)
        else None
    )
    if forced and reply.as_tool is not False:
        call = {"id": "call_0", "type": "function", "function": {"name": forced, "arguments": reply.content}}
        out["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
        out["choices"][0]["finish_reason"] = "tool_calls"
    if reply.usage:
        out["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
    return out
