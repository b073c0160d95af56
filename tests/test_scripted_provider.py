"""The real `openai` client against a scripted provider (tests/fakeprovider.py), through a
real worker: streamed text, usage from the final chunk, and what a 429 with Retry-After, a
401 and a 500 do to a run. Also how the engine classifies `openai`'s own exception classes.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2 as httpx
import openai
import pytest

from django_agentruns import enqueue, transitions
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.rules.policy import classify
from tests import helpers
from tests.fakeprovider import FakeProvider, Fault, Reply, ToolCall

SETTINGS = {"BACKOFF_BASE": 0.0, "BACKOFF_CAP": 0.0, "POLL_INTERVAL": 0.05}


def run(run_id: int) -> AgentRun:
    return AgentRun.objects.get(pk=run_id)


def finished(run_id: int) -> bool:
    return run(run_id).status in (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)


@pytest.mark.slow
def test_a_streamed_model_call_through_a_worker_completes_snoozes_retries_and_dead_letters(
    worker_env: dict[str, str], fake_provider: FakeProvider,
) -> None:
    fake_provider.script([Reply("Hello, world!", usage=(12, 7), chunks=4)], model="ok")
    fake_provider.script([Fault(429, retry_after=1), Reply("later", usage=(3, 2))],
                         model="limited")
    fake_provider.script([Fault(401, message="Incorrect API key")], model="badkey")
    fake_provider.script([Fault(500), Reply("again", usage=(4, 1))], model="blip")
    runs = {model: enqueue("tests.openai_chat", {"model": model}).pk
            for model in ("ok", "limited", "badkey", "blip")}
    env = {**worker_env, **fake_provider.env(), "AGENTRUNS_TEST_SETTINGS": json.dumps(SETTINGS)}
    with helpers.start_manage(["runworker", "--concurrency", "4"], env) as worker:
        helpers.wait_until(lambda: all(finished(pk) for pk in runs.values()), timeout=60,
                           message="every run to finish")
        assert worker.returncode is None, worker.output()

    ok = run(runs["ok"])
    assert ok.status == Status.SUCCEEDED, ok.error_message
    assert ok.output == {"text": "Hello, world!", "attempt": 1}
    # Usage is what the provider's final chunk reported, recorded once.
    assert (ok.input_tokens, ok.output_tokens) == (12, 7)
    usage = RunEvent.objects.filter(run_id=ok.pk, type=transitions.USAGE).get()
    assert (usage.payload["input_tokens"], usage.payload["output_tokens"]) == (12, 7)
    streamed = RunEvent.objects.filter(run_id=ok.pk, type="stream")
    assert "".join(e.payload["text"] for e in streamed.order_by("seq")) == "Hello, world!"

    # A 429 with Retry-After snoozes the run: no requeue budget spent; it then finishes.
    limited = run(runs["limited"])
    assert limited.status == Status.SUCCEEDED, limited.error_message
    assert (limited.requeue_count, limited.snooze_count, limited.attempt) == (0, 1, 2)
    snoozed = RunEvent.objects.filter(run_id=limited.pk, type=transitions.SNOOZED).get()
    assert snoozed.payload["delay"] == 1.0
    assert snoozed.payload["error_type"] == "openai.RateLimitError"
    assert (limited.input_tokens, limited.output_tokens) == (3, 2)

    # A 401 (openai.AuthenticationError) dead-letters at once, not retryable.
    badkey = run(runs["badkey"])
    assert (badkey.status, badkey.reason, badkey.attempt) == (
        Status.FAILED, Reason.NOT_RETRYABLE, 1)
    assert badkey.error_type == "openai.AuthenticationError"
    assert fake_provider.count("badkey") == 1

    # A 500 is retried, spending one requeue, and then succeeds.
    blip = run(runs["blip"])
    assert blip.status == Status.SUCCEEDED, blip.error_message
    assert (blip.requeue_count, blip.attempt) == (1, 2)
    assert fake_provider.count("blip") == 2


def test_the_fake_provider_answers_the_openai_client_with_tool_calls_and_faults(
    fake_provider: FakeProvider,
) -> None:
    """The server itself, through the client: non-streaming, streamed tool calls, faults
    by call number, a slow answer, and its request count."""
    client = openai.OpenAI(base_url=fake_provider.url, api_key="sk-test", max_retries=0)
    fake_provider.script([
        Reply("plain", usage=(5, 2)),
        Reply(tool_calls=[ToolCall("lookup", {"id": 7})]),
        Fault(429, retry_after=2),
        Reply("slow", delay=1.0),
    ])
    plain = client.chat.completions.create(model="m", messages=[])
    assert plain.choices[0].message.content == "plain"
    assert plain.usage is not None
    assert plain.usage.total_tokens == 7
    stream = client.chat.completions.create(model="m", messages=[], stream=True)
    calls: dict[int, dict[str, str]] = {}
    for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += (call.function and call.function.name) or ""
            entry["arguments"] += (call.function and call.function.arguments) or ""
    assert calls == {0: {"name": "lookup", "arguments": '{"id": 7}'}}
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="m", messages=[])
    assert limited.value.response.headers["retry-after"] == "2"
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.2).chat.completions.create(model="m", messages=[])
    with pytest.raises(openai.InternalServerError, match="script exhausted"):
        client.chat.completions.create(model="m", messages=[])
    assert fake_provider.count() == 5  # the slow one, then "exhausted"


def _status_error(cls: type[openai.APIStatusError], status: int,
                  headers: dict[str, str] | None = None) -> openai.APIStatusError:
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    response = httpx.Response(status, headers=headers or {}, request=request)
    return cls("boom", response=response, body=None)


@pytest.mark.parametrize(("error", "retryable", "snooze"), [
    (lambda: _status_error(openai.AuthenticationError, 401), False, False),
    (lambda: _status_error(openai.PermissionDeniedError, 403), False, False),
    (lambda: _status_error(openai.BadRequestError, 400), False, False),
    (lambda: _status_error(openai.NotFoundError, 404), False, False),
    (lambda: _status_error(openai.UnprocessableEntityError, 422), False, False),
    (lambda: _status_error(openai.ConflictError, 409), True, False),
    (lambda: _status_error(openai.RateLimitError, 429), True, False),
    (lambda: _status_error(openai.RateLimitError, 429, {"retry-after": "3"}), True, True),
    (lambda: _status_error(openai.RateLimitError, 429, {"retry-after-ms": "1500"}), True, True),
    (lambda: _status_error(openai.InternalServerError, 500), True, False),
    (lambda: _status_error(openai.InternalServerError, 503, {"retry-after": "2"}), True, True),
    (lambda: openai.APIConnectionError(request=httpx.Request("POST", "http://x")), True, False),
    (lambda: openai.APITimeoutError(request=httpx.Request("POST", "http://x")), True, False),
])
def test_openai_exception_classes_are_classified_by_what_they_mean(
    error: Any, retryable: bool, snooze: bool,
) -> None:
    failure = classify(error(), unknown_retryable=False)
    assert (failure.retryable, failure.snooze) == (retryable, snooze)


def test_an_openai_retry_after_in_milliseconds_is_taken_as_seconds() -> None:
    failure = classify(_status_error(openai.RateLimitError, 429, {"retry-after-ms": "1500"}))
    assert failure.delay == 1.5
