"""A canned model for the demo: a tiny local server that speaks OpenAI's chat-completions API,
so the chat page's Pydantic AI agent runs through its real client without a key or network.

It answers by rule, from the conversation it is sent (so any number of chats work, in any
order, in any process):

- a customer's message, with a `refund` tool offered: a short sentence and a call of the
  tool, with the order number and amount found in the message (1042 and 20 otherwise);
- the tool's result (or its refusal) back: one sentence saying how it went;
- anything else: a few sentences on durable runs.

Streamed (`"stream": true`) as server-sent events, a word per event with a short pause, so
the page shows the text arriving; the usage (words counted as tokens) in a final event
when asked, as OpenAI sends it. `base_url()` starts it, once per process, on 127.0.0.1 and a
free port, in a daemon thread: the worker that runs the agent starts its own.

Why not the test suite's fake provider (tests/fakeprovider.py): that one plays a fixed
script per test and answers 500 once it is used up, which is right for a test and wrong for
a page where people ask what they like; and the example project is meant to be copied
without the repository's tests.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WORD_DELAY = 0.02  # seconds between streamed words: visible on the page, quick in `make demo`
GENERAL_ANSWER = (
    "A run is claimed with a lease, so one worker owns it at a time. Each model call and "
    "tool call is a step stored as it ends, so a retry or a crash resumes after the last "
    "one instead of paying for it again."
)

_lock = threading.Lock()
_server: ThreadingHTTPServer | None = None


def base_url() -> str:
    """The server's base URL (what `OpenAIProvider(base_url=...)` takes), started on first
    use in this process."""
    global _server
    with _lock:
        if _server is None:
            _server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
            _server.daemon_threads = True
            threading.Thread(target=_server.serve_forever, daemon=True,
                             name="demo-model-server").start()
        host, port = _server.server_address[:2]
    return f"http://{host!s}:{port}/v1"


def answer(body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The reply's text and tool calls, from the request's messages and tools."""
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    if last.get("role") == "tool":
        result = _text(last.get("content"))
        if "refunded" in result:
            return f"All set: {result}. Anything else?", []
        return f"I could not do that. {result}", []
    tools = {tool.get("function", {}).get("name") for tool in body.get("tools") or []}
    question = _text(last.get("content"))
    if "refund" in tools and "refund" in question.lower():
        numbers = [int(n) for n in re.findall(r"\d+", question)]
        order = next((n for n in numbers if n >= 1000), 1042)
        amount = next((n for n in numbers if n < 1000), 20)
        call = {"id": "call_refund", "type": "function", "function": {
            "name": "refund", "arguments": json.dumps({"order": order, "amount": amount})}}
        return f"I will ask for a refund of {amount} EUR on order {order}.", [call]
    return GENERAL_ANSWER, []


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content or "")


def _usage(body: dict[str, Any], text: str) -> dict[str, int]:
    prompt = sum(len(_text(m.get("content")).split()) for m in body.get("messages") or [])
    completion = len(text.split()) or 1
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # the worker's log stays clean
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if not self.path.split("?", 1)[0].endswith("/chat/completions"):
            return self._json(404, {"error": {"message": f"no endpoint {self.path}",
                                              "type": "not_found_error"}})
        text, calls = answer(body)
        model = str(body.get("model") or "demo-model")
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return self._events(_chunks(body, model, text, calls, usage))
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return self._json(200, {
            "id": "chatcmpl-demo", "object": "chat.completion", "created": int(time.time()),
            "model": model, "usage": _usage(body, text),
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "tool_calls" if calls else "stop"}]})

    def _json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _events(self, chunks: Iterator[dict[str, Any]]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


def _chunks(body: dict[str, Any], model: str, text: str, calls: list[dict[str, Any]],
            include_usage: bool) -> Iterator[dict[str, Any]]:
    def chunk(delta: dict[str, Any] | None, finish: str | None = None) -> dict[str, Any]:
        choices = [] if delta is None else [
            {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        return {"id": "chatcmpl-demo", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model, "choices": choices}

    yield chunk({"role": "assistant", "content": ""})
    for i, word in enumerate(text.split(" ")):
        time.sleep(WORD_DELAY)  # the model "writing" the next word
        yield chunk({"content": word if i == 0 else " " + word})
    for i, call in enumerate(calls):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, "tool_calls" if calls else "stop")
    if include_usage:
        yield {**chunk(None), "usage": _usage(body, text)}
