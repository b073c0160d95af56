"""OpenTelemetry spans, with the optional `otel` extra (opentelemetry-api).

One span per attempt, following OpenTelemetry's messaging conventions: a run is a message,
its queue the destination, the worker the consumer. The span is current while the agent
runs, so spans the agent's own code makes (model calls, HTTP, SQL) become its children,
for sync and async agents alike (`run_coroutine_threadsafe` carries the context over).
The application configures the SDK and the exporter; without opentelemetry-api, or with
no SDK configured, the spans cost next to nothing and go nowhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, StatusCode
except ImportError:  # the `otel` extra is not installed: spans are no-ops
    trace = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from ..models import AgentRun

AVAILABLE = trace is not None
"""Whether opentelemetry-api is importable (the `otel` extra)."""

SYSTEM = "django-agentruns"
"""`messaging.system` of every span."""

TRACER_NAME = "django_agentruns"

_MISSING = object()
_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
_configured = False


def configured() -> bool:
    """Whether the application has set a tracer provider: until it has, every span is a
    no-op that still costs tens of microseconds, which a durable step skips. Once set, a
    provider cannot be unset. While none is, the API's global is read directly (its
    `get_tracer_provider` looks the environment up on every call); a provider named in
    the environment, or an API without that global, is asked the public way."""
    global _configured
    if _configured or trace is None:
        return _configured
    if getattr(trace, "_TRACER_PROVIDER", _MISSING) is None and not _FROM_ENV:
        return False
    _configured = not isinstance(trace.get_tracer_provider(),
                                 trace.ProxyTracerProvider | trace.NoOpTracerProvider)
    return _configured


FAILED_OUTCOMES = frozenset({"requeued", "dead_lettered"})
"""Settlements of an attempt that failed; their spans get status ERROR."""


class AttemptSpan:
    """The current attempt's span, or nothing: the worker reports the outcome through it."""

    def __init__(self, span: Any = None) -> None:
        self.span = span

    def set_outcome(self, outcome: str, error: BaseException | str | None = None) -> None:
        """Record the settlement (`transitions.Settlement` value) and, for a failed attempt,
        what failed: the exception, or a stop reason such as "timeout"."""
        if self.span is None:
            return
        self.span.set_attribute("agentruns.outcome", outcome)
        if outcome not in FAILED_OUTCOMES:
            return
        if isinstance(error, BaseException):
            cls = type(error)
            kind = cls.__qualname__ if cls.__module__ == "builtins" else \
                f"{cls.__module__}.{cls.__qualname__}"
            try:
                self.span.record_exception(error)
                description = f"{kind}: {error}"
            except Exception:  # an error whose __str__ raises is still a failed attempt
                description = f"{kind}: <str() raised>"
        else:
            kind = error or "_OTHER"
            description = kind
        self.span.set_attribute("error.type", kind)
        self.span.set_status(StatusCode.ERROR, description[:500])


@contextmanager
def attempt_span(run: AgentRun, worker_id: str | None = None) -> Iterator[AttemptSpan]:
    """A CONSUMER span named `process <queue>` around one attempt of `run` (as claimed).

    An exception escaping the block is recorded on the span (status ERROR) and re-raised.
    With no SDK configured there is no span at all: it would record nothing, yet cost
    Python per run.
    """
    if trace is None or not configured():
        yield AttemptSpan()
        return
    attributes: dict[str, str | int] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": run.queue,
        "messaging.message.id": str(run.pk),
        "agentruns.agent": run.agent,
        "agentruns.attempt": run.attempt,
    }
    if worker_id:
        attributes["messaging.client.id"] = worker_id
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(f"process {run.queue}", kind=SpanKind.CONSUMER,
                                      attributes=attributes) as span:
        yield AttemptSpan(span)


@contextmanager
def step_span(agent: str, name: str, occurrence: int, key: str) -> Iterator[Any]:
    """An INTERNAL span `step <name>` around one execution of a durable step, a child of
    the attempt's span; an exception escaping it is recorded (status ERROR). A step
    returned from its record is not executed, so it has no span."""
    if not configured():
        # No tracer provider configured: the span would be a no-op, yet cost tens of
        # microseconds, a step's largest cost in the worker after its write.
        yield None
        return
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(f"step {name}", kind=SpanKind.INTERNAL, attributes={
            "agentruns.agent": agent, "agentruns.step.name": name,
            "agentruns.step.occurrence": occurrence, "agentruns.step.key": key}) as span:
        yield span
