"""OpenTelemetry: one CONSUMER span per attempt, named and attributed by the messaging
conventions, with the outcome, current while the agent runs (sync and async).

Spans are read back from the SDK's in-memory exporter; attempts are run by an in-process
worker so their spans end in this process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from django_agentruns import Retryable, enqueue
from django_agentruns.models import AgentRun
from django_agentruns.ops import tracing
from django_agentruns.runtime.worker import Worker

try:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode
except ImportError:  # the skip below says what to install
    trace = None

# In CI (CI=true) a missing extra is a failure, not a skip: the `test` extra installs it.
MAY_SKIP = not os.environ.get("CI")
pytestmark = pytest.mark.skipif(MAY_SKIP and trace is None, reason="opentelemetry-sdk is not "
                                "installed: pip install 'django-agentruns[test]'")



@pytest.fixture(scope="module")
def _exporter() -> Iterator[InMemorySpanExporter]:
    # The global provider can be set once per process; reuse one a previous module set.
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


@pytest.fixture
def spans(_exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    _exporter.clear()
    return _exporter


def attempt_spans(exporter: InMemorySpanExporter, run: AgentRun) -> list[ReadableSpan]:
    return sorted((s for s in exporter.get_finished_spans()
                   if s.attributes and s.attributes.get("messaging.message.id") == str(run.pk)),
                  key=lambda s: s.attributes["agentruns.attempt"] if s.attributes else 0)


def burst() -> None:
    Worker(burst=True, reap_interval=0).run(install_signals=False)


def a_run(**fields: Any) -> AgentRun:
    return AgentRun(**{"pk": 41, "agent": "tests.noop", "queue": "reports", "attempt": 2,
                       **fields})


# --------------------------------------------------------------------------- the span


def test_the_span_follows_the_messaging_conventions(spans: InMemorySpanExporter) -> None:
    with tracing.attempt_span(a_run(), "host:1:abc") as span:
        span.set_outcome("succeeded")

    (recorded,) = spans.get_finished_spans()
    assert recorded.name == "process reports"
    assert recorded.kind == SpanKind.CONSUMER
    assert dict(recorded.attributes or {}) == {
        "messaging.system": "django-agentruns",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "reports",
        "messaging.message.id": "41",
        "messaging.client.id": "host:1:abc",
        "agentruns.agent": "tests.noop",
        "agentruns.attempt": 2,
        "agentruns.outcome": "succeeded",
    }
    assert recorded.status.status_code == StatusCode.UNSET


@pytest.mark.parametrize(("outcome", "error", "error_type"), [
    ("dead_lettered", PermissionError("401 from the model provider"), "PermissionError"),
    ("requeued", Retryable("429 Too Many Requests"), "django_agentruns.exceptions.Retryable"),
    ("requeued", "timeout", "timeout"),
])
def test_a_failed_attempt_is_an_error_span_naming_what_failed(
        spans: InMemorySpanExporter, outcome: str, error: Any, error_type: str | None) -> None:
    with tracing.attempt_span(a_run()) as span:
        span.set_outcome(outcome, error)

    (recorded,) = spans.get_finished_spans()
    assert recorded.status.status_code == StatusCode.ERROR
    assert (recorded.attributes or {})["error.type"] == error_type
    assert (recorded.attributes or {})["agentruns.outcome"] == outcome
    recorded_exceptions = [e for e in recorded.events if e.name == "exception"]
    assert len(recorded_exceptions) == (1 if isinstance(error, BaseException) else 0)


@pytest.mark.parametrize("outcome", ["succeeded", "cancelled", "lost"])
def test_other_outcomes_are_not_errors(spans: InMemorySpanExporter, outcome: str) -> None:
    with tracing.attempt_span(a_run()) as span:
        span.set_outcome(outcome, "cancelled")
    (recorded,) = spans.get_finished_spans()
    assert recorded.status.status_code == StatusCode.UNSET
    assert "error.type" not in (recorded.attributes or {})


def test_an_exception_escaping_the_attempt_is_recorded_and_raised(
        spans: InMemorySpanExporter) -> None:
    with pytest.raises(ConnectionError), tracing.attempt_span(a_run()):
        raise ConnectionError("database went away while settling")
    (recorded,) = spans.get_finished_spans()
    assert recorded.status.status_code == StatusCode.ERROR
    assert [e.name for e in recorded.events] == ["exception"]


def test_spans_made_inside_the_attempt_are_its_children(spans: InMemorySpanExporter) -> None:
    with tracing.attempt_span(a_run()) as span:
        with trace.get_tracer("tests").start_as_current_span("model call"):
            pass
        span.set_outcome("succeeded")
    child, parent = spans.get_finished_spans()
    assert child.parent is not None
    assert parent.context is not None
    assert child.parent.span_id == parent.context.span_id


# --------------------------------------------------------------------------- from a worker


def test_a_worker_makes_one_span_per_attempt_with_its_outcome(
        spans: InMemorySpanExporter, transactional_db: None) -> None:
    flaky = enqueue("tests.flaky", {"succeed_on": 2})
    burst()
    first, second = attempt_spans(spans, flaky)
    assert [(s.attributes or {})["agentruns.attempt"] for s in (first, second)] == [1, 2]
    assert [(s.attributes or {})["agentruns.outcome"] for s in (first, second)] == \
        ["requeued", "succeeded"]
    assert first.status.status_code == StatusCode.ERROR
    assert (first.attributes or {})["error.type"] == "django_agentruns.exceptions.Retryable"
    assert second.status.status_code == StatusCode.UNSET
    assert {s.name for s in (first, second)} == {"process default"}
    assert (first.attributes or {})["messaging.client.id"] == \
        AgentRun.objects.get(pk=flaky.pk).claimed_by


@pytest.mark.parametrize("agent", ["tests.traced", "tests.async_traced"])
def test_the_agents_own_spans_nest_in_the_attempt_span(
        spans: InMemorySpanExporter, transactional_db: None, agent: str) -> None:
    run = enqueue(agent)
    burst()
    (attempt,) = attempt_spans(spans, run)
    (inner,) = [s for s in spans.get_finished_spans() if s.name.endswith("model call")]
    assert inner.parent is not None
    assert attempt.context is not None
    assert inner.parent.span_id == attempt.context.span_id
    assert (attempt.attributes or {})["agentruns.outcome"] == "succeeded"
