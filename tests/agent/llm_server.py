"""A real OpenAI-compatible HTTP server on loopback that answers from a scripted policy.

Tests point the real `openai` client at it, so retries, timeouts, structured-output parsing,
repair turns and budgets run end to end without a hosted model. Each POST to
/v1/chat/completions takes the next step of the script (or `default` once it is used up); a
step is a behaviour, or a function of the request's JSON that returns one.

Where real servers differ, it can behave as they do: error bodies in OpenAI's, vLLM's or
Ollama's form (`Fail.style`); a context limit the server enforces itself (`max_model_len`:
a prompt, counted at 4 characters a token, plus max_tokens over it gets vLLM's 400, and the
script is not consumed, as no model saw the request); replies of reasoning models, with their
thinking in `reasoning_content` beside the answer (`Reply.reasoning`); and slow replies, whole
after `delay_s` or with the headers sent at once and the body after it (`Reply.headers_first`).
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
    # The error body's form: "openai" {"error": {"message", "type", "code"}}; "vllm" (and
    # SGLang) {"object": "error", "message", "type", "code"} at the top level; "ollama"
    # {"error": "message"}.
    style: str = "openai"

    def body(self) -> str:
        if self.style == "vllm":
            kind = (
                "BadRequestError"
                if self.status == 400
                else "NotFoundError"
                if self.status == 404
                else "Error"
            )
            return json.dumps(
                {"object": "error", "message": self.message, "type": kind, "param": None, "code": self.status}
            )
        if self.style == "ollama":
            return json.dumps({"error": self.message})
        return json.dumps({"error": {"message": self.message, "type": "scripted", "code": self.status}})


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
        models: list[dict] | Fail | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """`models`: what GET /v1/models answers, a list of model entries (vLLM's carry
        max_model_len) or a Fail; default one model, "scripted". `max_model_len`: the context
        this server enforces, as vLLM does (None: none)."""
        self.script: list[Step] = list(script)
        self.max_model_len = max_model_len
        self.default = default
        self.models = (
            [{"id": "scripted", "object": "model", "owned_by": "test"}] if models is None else models
        )
        self.requests: list[dict] = []  # bodies of the chat requests, in order
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

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
            if self.max_model_len is not None:
                prompt, completion = prompt_tokens(body), int(body.get("max_tokens") or 0)
                if prompt + completion > self.max_model_len:
                    return vllm_context_error(self.max_model_len, prompt, completion)
            step = self.script.pop(0) if self.script else self.default
        if step is None:
            return Fail(503, message="the scripted policy has no more replies")
        return step(body) if callable(step) else step

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
