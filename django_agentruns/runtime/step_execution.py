"""Executing one step's function for `runtime.steps`: its span, a timeout (a thread for a
sync function, cancellation for an async one), the backoff between its retries inside the
attempt, waited out in slices so a stop ends it early."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..conf import app_settings
from ..db import close_all_connections
from ..exceptions import StepTimeout
from ..ops import tracing
from ..registry import find_agent
from ..rules import policy
from .recording import classify_for

if TYPE_CHECKING:
    from .context import RunContext
    from .control import AttemptControl
    from .steps import ActiveStep


@contextmanager
def span(ctx: RunContext, step: ActiveStep) -> Iterator[None]:
    """The step's execution's span, when a tracer is configured (`steps.run_step`)."""
    with tracing.step_span(ctx.agent, step.name, step.occurrence, step.key):
        yield


def call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
          timeout: float | None, step: ActiveStep) -> Any:
    """`fn` here, or with a timeout in a thread of its own: past the timeout the step has
    failed (`StepTimeout`) and the thread runs on until `fn` returns; what it returns
    then is discarded (Python cannot stop a thread)."""
    if timeout is None:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}
    finished = threading.Event()
    context = contextvars.copy_context()  # ctx.step_key and usage attribution carry over

    def execute() -> None:
        try:
            box["result"] = context.run(fn, *args, **kwargs)
        except BaseException as exc:
            box["error"] = exc
        finally:
            close_all_connections()  # this thread is the step's alone
            finished.set()

    threading.Thread(target=execute, daemon=True, name=f"agentruns-step-{step.key}"[:60]).start()
    if not finished.wait(timeout):
        raise StepTimeout(f"step {step.key!r} took longer than its timeout of {timeout}s")
    if "error" in box:
        raise box["error"]
    return box["result"]


async def acall(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 timeout: float | None, step: ActiveStep) -> Any:
    value = fn(*args, **kwargs)
    if not inspect.isawaitable(value):
        return value
    if timeout is None:
        return await value
    try:
        return await asyncio.wait_for(value, timeout)  # cancelled past the timeout
    except TimeoutError:
        raise StepTimeout(f"step {step.key!r} took longer than its timeout of {timeout}s") \
            from None


def retry_delay(ctx: RunContext, exc: BaseException, failures: int,
                 retries: int) -> float | None:
    """Seconds before the step's next execution in this attempt, or None: the error goes
    to the agent (and fails the attempt, unless the agent catches it). A rate limit with
    Retry-After is not retried here: it snoozes the run (and closes its key), as an
    attempt's error does."""
    if failures >= retries or not isinstance(exc, Exception):
        return None
    failure = classify_for(find_agent(ctx.agent), exc)
    if failure.snooze or not failure.retryable:
        return None
    if failure.delay is not None:
        return failure.delay
    return policy.backoff(failures, base=float(app_settings.BACKOFF_BASE),
                          cap=float(app_settings.BACKOFF_CAP),
                          jitter=float(app_settings.BACKOFF_JITTER))


def backoff_sleep(control: AttemptControl, delay: float) -> None:
    """Wait out a step's backoff in slices, so a stop (cancel, shutdown) ends it early."""
    until = time.monotonic() + delay
    while (left := until - time.monotonic()) > 0:
        control.check()
        time.sleep(min(0.1, left))
    control.check()


async def abackoff_sleep(control: AttemptControl, delay: float) -> None:
    until = time.monotonic() + delay
    while (left := until - time.monotonic()) > 0:
        control.check()
        await asyncio.sleep(min(0.1, left))
    control.check()
