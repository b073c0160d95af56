"""What every framework integration needs of the run: its context, steps, waits and spans.

A framework runs its agent on an event loop of its own making. Inside an async agent that
loop is the worker's, and the context's async calls (`astep`, `arecord_usage`...) are
awaited on it. Inside a sync agent (`run_sync`) the framework's loop is a private one, and
the context's sync calls are made from a thread while that loop stays free: a step's body,
the model call, is handed back to the framework's loop and waited for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import importlib.util
import re
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.db import connections

from ..exceptions import InvalidInputError
from ..outcomes import Approval
from ..runtime.context import RunContext, current_context

try:
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, StatusCode
except ImportError:  # the `otel` extra is not installed: no spans
    trace = None  # type: ignore[assignment]

TRACER_NAME = "django_agentruns.integrations"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]+")


def require(module: str, extra: str) -> None:
    """An ImportError naming the extra to install, instead of a bare one deep in an import."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"django_agentruns.integrations needs {module!r}: install the "
                          f"extra, pip install 'django-agentruns[{extra}]'")


def step_name(*parts: str) -> str:
    """A step name made of `parts` (a tool's name, a call id): only the characters a step
    name may hold, at most 200 of them."""
    return ".".join(_UNSAFE.sub("-", part) or "-" for part in parts)[:200]


@dataclass(frozen=True)
class Usage:
    """Tokens (and cost, where priced) a model call reported, recorded inside its step."""

    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0
    model: str = ""


StepBody = Callable[[], Awaitable[tuple[Any, Usage | None]]]


class RunBridge:
    """The run, as code on a framework's event loop reaches it (see the module docstring)."""

    def __init__(self, ctx: RunContext, *, threaded: bool) -> None:
        self.ctx = ctx
        self.threaded = threaded

    @classmethod
    def current(cls, *, threaded: bool, entry: str) -> RunBridge:
        ctx = current_context()
        if ctx is None:
            raise InvalidInputError(f"{entry} runs inside an agent run (an @agent function "
                                    f"a worker executes); none is running here")
        return cls(ctx, threaded=threaded)

    async def step(self, name: str, body: StepBody) -> Any:
        """`body` as durable step `name`: its JSON result (stored, or replayed from the
        record without calling `body`), its usage recorded inside the step."""
        ctx = self.ctx
        if not self.threaded:
            async def execute() -> Any:
                payload, usage = await body()
                if usage is not None:
                    await ctx.arecord_usage(input_tokens=usage.input_tokens,
                                           output_tokens=usage.output_tokens,
                                           cost=usage.cost, model=usage.model)
                return payload
            return await ctx.astep(name, execute)
        loop = asyncio.get_running_loop()

        def execute_in_thread() -> Any:
            payload, usage = _on_loop(loop, body)
            if usage is not None:
                ctx.record_usage(input_tokens=usage.input_tokens,
                                 output_tokens=usage.output_tokens, cost=usage.cost,
                                 model=usage.model)
            return payload
        return await asyncio.to_thread(closing_connections, ctx.step, name, execute_in_thread)

    async def request_approval(self, key: str, proposal: Any) -> Approval:
        """The answer to `proposal`; until there is one, the run waits (the attempt ends)."""
        if not self.threaded:
            return await self.ctx.arequest_approval(key, proposal)
        return await asyncio.to_thread(closing_connections, self.ctx.request_approval, key,
                                       proposal)

    async def stream(self, text: str) -> None:
        if text:
            if self.threaded:
                self.ctx.stream(text)
            else:
                await self.ctx.astream(text)


def _on_loop(loop: asyncio.AbstractEventLoop, body: StepBody) -> tuple[Any, Usage | None]:
    """Run `body` on the framework's `loop` from this (the step's) thread and wait for it,
    in this thread's context: the step's key and span are current for the body too."""
    context = contextvars.copy_context()
    done: concurrent.futures.Future[tuple[Any, Usage | None]] = concurrent.futures.Future()

    def finished(task: asyncio.Task[tuple[Any, Usage | None]]) -> None:
        if task.cancelled():
            done.set_exception(asyncio.CancelledError())
        elif (error := task.exception()) is not None:
            done.set_exception(error)
        else:
            done.set_result(task.result())

    def start() -> None:
        async def run() -> tuple[Any, Usage | None]:
            return await body()
        loop.create_task(run(), context=context).add_done_callback(finished)

    loop.call_soon_threadsafe(start)
    return done.result()


def closing_connections(func: Callable[..., Any], *args: Any) -> Any:
    """A context call on a thread of the loop's executor, its connections closed after it
    (the thread is not the worker's)."""
    try:
        return func(*args)
    finally:
        connections.close_all()


@contextmanager
def genai_span(operation: str, *, system: str, model: str = "", tool: str = "",
               call_id: str = "") -> Iterator[Any]:
    """A CLIENT (model call) or INTERNAL (tool call) span with the OpenTelemetry GenAI
    semantic conventions' attributes, a child of the current span (the step's, under the
    attempt's); set the usage on it with `set_usage`."""
    if trace is None:
        yield None
        return
    attributes, name, kind = _genai(operation, system, model, tool, call_id)
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(name, kind=kind, attributes=attributes) as span:
        try:
            yield span
        except BaseException as exc:
            span.set_status(StatusCode.ERROR, f"{type(exc).__name__}")
            raise


def _genai(operation: str, system: str, model: str, tool: str,
           call_id: str) -> tuple[dict[str, str], str, Any]:
    attributes: dict[str, str] = {"gen_ai.operation.name": operation,
                                  "gen_ai.provider.name": system, "gen_ai.system": system}
    if model:
        attributes["gen_ai.request.model"] = model
    if tool:
        attributes["gen_ai.tool.name"] = tool
    if call_id:
        attributes["gen_ai.tool.call.id"] = call_id
    kind = SpanKind.CLIENT if operation == "chat" else SpanKind.INTERNAL
    return attributes, f"{operation} {model or tool}".strip(), kind


def start_genai_span(operation: str, *, system: str, model: str = "", tool: str = "",
                     call_id: str = "") -> Any:
    """`genai_span` for callbacks that see a call's start and end apart (LangChain's):
    started under the current span, not made current; end it with `end_span`."""
    if trace is None:
        return None
    attributes, name, kind = _genai(operation, system, model, tool, call_id)
    return trace.get_tracer(TRACER_NAME).start_span(name, kind=kind, attributes=attributes)


def end_span(span: Any, error: BaseException | None = None) -> None:
    if span is None:
        return
    if error is not None:
        span.set_status(StatusCode.ERROR, type(error).__name__)
    span.end()


def set_usage(span: Any, usage: Usage, response_model: str = "") -> None:
    if span is None:
        return
    span.set_attribute("gen_ai.usage.input_tokens", usage.input_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)
    if response_model:
        span.set_attribute("gen_ai.response.model", response_model)
