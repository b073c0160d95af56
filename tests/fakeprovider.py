"""A scripted model provider: a local HTTP server that speaks the OpenAI API, for tests that
drive the real `openai` client (and SDKs built on it) through a real worker.

The server runs in the test process (a `ThreadingHTTPServer` on 127.0.0.1, an ephemeral
port); a worker subprocess reaches it through the environment variable `FAKE_PROVIDER_URL`
(its base URL, ending in `/v1`, what `openai.OpenAI(base_url=...)` takes). Fixture
`fake_provider` (tests/conftest.py) starts and stops one per test.

The script
----------
A script is a plain list. Each request takes the next entry of its script, in the order
requests arrive (the call number, from 1, is its position); past the end the server
answers 500 "script exhausted", which a test sees. Entries:

- `Reply(text="...", tool_calls=[ToolCall("name", {"arg": 1})], usage=(prompt, completion),
  chunks=N, delay=S)`: a chat completion. Non-streaming: one JSON body. With
  `"stream": true`: server-sent events, the text cut into `chunks` deltas (a role delta
  first, tool calls as an id+name delta then their arguments), a chunk with the
  `finish_reason`, then, when the request asked `stream_options.include_usage`, a final
  chunk with empty `choices` and the `usage`, then `data: [DONE]`.
- `Fault(status, retry_after=None, message="...", delay=S)`: an error response in OpenAI's
  shape (`{"error": {...}}`) with that HTTP status and, if given, a `Retry-After` header
  (a 429 or 503 with it is a provider's "later"; 401 is a bad key; 500 a blip).
- `delay` on either: seconds the server sleeps before it answers (a slow provider, for
  client timeouts).

Scripts are per model: `provider.script([...], model="gpt-a")` sets the script of requests
whose body names `"model": "gpt-a"`; without `model`, the default script, which every
model without its own uses. So runs that call different models run concurrently without
taking each other's entries.

What it saw: `provider.requests` (every request's path and JSON body, in order),
`provider.count(model=None)` (how many requests, of one model or in all).

Adding an endpoint (the Responses API for the OpenAI Agents SDK, Anthropic's Messages):
add a branch to `_Handler.do_POST` on the path and a formatter of `Reply`/`Fault` in the
API's shape; the script format stays the same.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ENV_VAR = "FAKE_PROVIDER_URL"


@dataclass(frozen=True)
class ToolCall:
    """A function call the model asks for; `arguments` is sent as JSON text."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    """A successful completion (see the module's docstring)."""

    text: str = ""
    tool_calls: Sequence[ToolCall] = ()
    usage: tuple[int, int] = (10, 5)  # prompt tokens, completion tokens
    chunks: int = 3
    delay: float = 0.0


@dataclass(frozen=True)
class Fault:
    """An error response (see the module's docstring)."""

    status: int
    retry_after: float | str | None = None
    message: str = ""
    delay: float = 0.0


Entry = Reply | Fault

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


@dataclass
class Seen:
    """One request the server took."""

    path: str
    body: dict[str, Any]


class FakeProvider:
    """The server and its scripts; a context manager (started on enter, stopped on exit)."""

    def __init__(self, script: Sequence[Entry] = ()) -> None:
        self._lock = threading.Lock()
        self._scripts: dict[str | None, list[Entry]] = {None: list(script)}
        self._taken: dict[str | None, int] = {}
        self.requests: list[Seen] = []
        handler = type("Handler", (_Handler,), {"provider": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="fake-provider")

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    def env(self) -> dict[str, str]:
        """What a worker subprocess's environment needs to reach this server."""
        return {ENV_VAR: self.url}

    def script(self, entries: Sequence[Entry], *, model: str | None = None) -> None:
        """Set the script of `model` (None: the default one); its call numbers restart."""
        with self._lock:
            self._scripts[model] = list(entries)
            self._taken[model] = 0

    def count(self, model: str | None = None) -> int:
        with self._lock:
            return sum(1 for seen in self.requests
                       if model is None or seen.body.get("model") == model)

    def take(self, path: str, body: dict[str, Any]) -> Entry | None:
        """Record a request and hand it its script's next entry (None: script exhausted)."""
        with self._lock:
            self.requests.append(Seen(path, body))
            model = body.get("model")
            key = model if model in self._scripts else None
            taken = self._taken.get(key, 0)
            self._taken[key] = taken + 1
            script = self._scripts[key]
            return script[taken] if taken < len(script) else None

    def start(self) -> FakeProvider:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    provider: FakeProvider
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read state
        pass

    def do_POST(self) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._answer()  # suppressed: the client gave up (its timeout), none to answer

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            body = {}
        path = self.path.split("?", 1)[0]
        entry = self.provider.take(path, body)
        if entry is None:
            return self._error(Fault(500, message="fake provider: script exhausted"))
        if entry.delay:
            time.sleep(entry.delay)
        if isinstance(entry, Fault):
            return self._error(entry)
        if not path.endswith("/chat/completions"):
            return self._error(Fault(404, message=f"fake provider: no endpoint {path}"))
        model = str(body.get("model") or "fake-model")
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return self._events(_chat_chunks(entry, model, usage))
        return self._json(200, _chat_completion(entry, model))

    def _json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, fault: Fault) -> None:
        headers = {"x-should-retry": "false"}  # the engine retries, not the client
        if fault.retry_after is not None:
            headers["Retry-After"] = str(fault.retry_after)
        self._json(fault.status, {"error": {
            "message": fault.message or f"fake provider: HTTP {fault.status}",
            "type": _ERROR_TYPES.get(fault.status, "server_error"),
            "param": None, "code": None}}, headers)

    def _events(self, chunks: Iterator[dict[str, Any]]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


def _usage(reply: Reply) -> dict[str, int]:
    prompt, completion = reply.usage
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _tool_calls(reply: Reply) -> list[dict[str, Any]]:
    return [{"id": f"call_{i}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for i, call in enumerate(reply.tool_calls)]


def _finish(reply: Reply) -> str:
    return "tool_calls" if reply.tool_calls else "stop"


def _chat_completion(reply: Reply, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
    if reply.tool_calls:
        message["tool_calls"] = _tool_calls(reply)
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message,
                                         "finish_reason": _finish(reply), "logprobs": None}],
            "usage": _usage(reply)}


def _chat_chunks(reply: Reply, model: str, include_usage: bool) -> Iterator[dict[str, Any]]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                             "logprobs": None}]}

    yield chunk({"role": "assistant", "content": ""})
    for piece in _pieces(reply.text, reply.chunks):
        yield chunk({"content": piece})
    for i, call in enumerate(_tool_calls(reply)):
        function = call["function"]
        yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                     "function": {"name": function["name"], "arguments": ""}}]})
        for piece in _pieces(function["arguments"], 2):
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    yield chunk({}, _finish(reply))
    if include_usage:
        yield {"id": "chatcmpl-fake", "object": "chat.completion.chunk",
               "created": int(time.time()), "model": model, "choices": [],
               "usage": _usage(reply)}


def _pieces(text: str, n: int) -> list[str]:
    """`text` cut into at most `n` non-empty pieces, in order."""
    if not text:
        return []
    size = max(1, -(-len(text) // max(1, n)))
    return [text[i:i + size] for i in range(0, len(text), size)]
