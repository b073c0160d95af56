"""Durable steps: `ctx.step(name, fn, ...)` runs `fn` once per run and keeps its result.

Each call of a name is its next occurrence (1, 2, 3... in call order), so a loop of model
calls is a sequence of steps. Before executing, a fenced start write asks the run's
record: a step done already (by an earlier attempt, or copied by a replaying fork)
answers its stored result and `fn` is not called. Otherwise `fn` runs (outside any
transaction: a model call may take minutes), and a fenced end write stores its JSON
result, the usage recorded inside it, and one `run.step` event. A worker that lost the
run records nothing, so the step's next execution is the new owner's, under the same
idempotency key (`ctx.step_key`, e.g. "run-42/draft/1").

A fresh run's first attempt has nothing to ask: its start is held (`_held`) and written
by its end, one row, unless a write inside the step or the lease keeper writes it first.
A crash while it is held re-executes the step with the same key, as after a recorded
start; only a recorded end makes a step done (docs/steps.md). An async step's end there
is held too, and carried by the attempt's next write (`AttemptControl.hold_end`).

An attempt resuming from a checkpoint does not call the steps before it again: the first
call of each name counts the run's steps of that name started before the checkpoint
(`transitions.steps`), so the occurrences go on where they were.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from django.db import connection

from .. import transitions
from ..conf import SETTING_NAME, app_settings
from ..exceptions import AttemptStopped, InvalidInputError, LimitExceeded
from ..models import AgentRun, step_key
from ..ops import metrics, tracing
from ..outcomes import Renewal, StepStart
from ..registry import NAME_PATTERN
from ..validation import capped_json
from . import step_execution as execution

if TYPE_CHECKING:
    from .context import RunContext
    from .control import AttemptControl

START_HELD = 1.0
"""Seconds a fresh run's step runs before the lease keeper writes its start (`_held`)."""
END_HELD = 0.0
"""Seconds an async step's held end waits for a write to carry it before the lease keeper
writes it: none (its next pass); a test raises it to kill a worker while one is held."""


@dataclass
class ActiveStep:
    """The step being executed in this context: its key, and the usage recorded in it."""

    name: str
    occurrence: int
    key: str
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0
    checkpoint: int = 0
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))


_active: contextvars.ContextVar[ActiveStep | None] = contextvars.ContextVar(
    "agentruns_step", default=None)


def current_key() -> str | None:
    """`ctx.step_key`: the key of the step executing here, None outside a step."""
    active = _active.get()
    return None if active is None else active.key


def attribute_usage(input_tokens: int, output_tokens: int, cost: float) -> None:
    """Usage recorded (`ctx.record_usage`) inside a step is the step's too."""
    active = _active.get()
    if active is not None:
        active.input_tokens += input_tokens
        active.output_tokens += output_tokens
        active.cost += cost


def run_step(ctx: RunContext, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any], retries: int, timeout: float | None) -> Any:
    """`ctx.step`: the stored result, or `fn`'s, executed and stored."""
    control = _checked(ctx, name, fn, retries, timeout)
    control.write_held_end()
    start = _start_write(control, name)
    started = _held(control, start) or _took(control, control.write(start), name)
    if started.done:
        return _replayed(ctx, started)
    failures = 0
    while True:
        step = ActiveStep(name, started.occurrence, step_key(ctx.run_id, name, started.occurrence),
                          checkpoint=start.checkpoint)
        began = time.monotonic()
        token = _active.set(step)
        try:
            try:
                if tracing.configured():
                    with execution.span(ctx, step):
                        text, result = _stored_form(
                            name, execution.call(fn, args, kwargs, timeout, step))
                else:
                    text, result = _stored_form(
                        name, execution.call(fn, args, kwargs, timeout, step))
            finally:
                # A start still held is the end's to write (or, for an attempt stopping,
                # nobody's: the next attempt executes the step again).
                _active.reset(token)
                control.take_step_start()
        except (AttemptStopped, asyncio.CancelledError):
            raise  # the attempt stops: the step stays started, the next attempt runs it
        except BaseException as exc:
            control.apply(control.write(_end_write(control, step, began, exc)))
            metrics.observe_step(ctx.agent, "failed")
            delay = execution.retry_delay(ctx, exc, failures, retries)
            if delay is None:
                raise
            failures += 1
            execution.backoff_sleep(control, delay)
            started = _took(control, control.write(_restart(start, step)), name)
            continue
        control.apply(control.write(_end_write(control, step, began, None, text)))
        metrics.observe_step(ctx.agent, "done")
        return result


async def arun_step(ctx: RunContext, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any], retries: int, timeout: float | None) -> Any:
    """`ctx.astep`: `run_step` for an async `fn` (or any `fn` returning an awaitable), its
    writes awaited through the attempt store; a timeout cancels the execution."""
    control = _checked(ctx, name, fn, retries, timeout)
    await control.await_held_end()
    start = _start_write(control, name)
    started = _held(control, start, on_loop=True) or \
        _took(control, await control.awrite(start), name)
    if started.done:
        return _replayed(ctx, started)
    failures = 0
    while True:
        step = ActiveStep(name, started.occurrence, step_key(ctx.run_id, name, started.occurrence),
                          checkpoint=start.checkpoint)
        began = time.monotonic()
        token = _active.set(step)
        try:
            try:
                if tracing.configured():
                    with execution.span(ctx, step):
                        text, result = _stored_form(
                            name, await execution.acall(fn, args, kwargs, timeout, step))
                else:
                    text, result = _stored_form(
                        name, await execution.acall(fn, args, kwargs, timeout, step))
            finally:
                # A start still held is the end's to write (or, for an attempt stopping,
                # nobody's: the next attempt executes the step again).
                _active.reset(token)
                control.take_step_start()
        except (AttemptStopped, asyncio.CancelledError):
            raise
        except BaseException as exc:
            control.apply(await control.awrite(_end_write(control, step, began, exc)))
            metrics.observe_step(ctx.agent, "failed")
            delay = execution.retry_delay(ctx, exc, failures, retries)
            if delay is None:
                raise
            failures += 1
            await execution.abackoff_sleep(control, delay)
            started = _took(control, await control.awrite(_restart(start, step)), name)
            continue
        end = _end_write(control, step, began, None, text)
        if control.fresh_steps and control.store is not None:
            control.hold_end(end)  # carried by the attempt's next write (`hold_end`)
            control.check()
        else:
            control.apply(await control.awrite(end))
        metrics.observe_step(ctx.agent, "done")
        return result


# ----------------------------------------------------------------------- the checks


def _checked(ctx: RunContext, name: Any, fn: Any, retries: Any,
             timeout: Any) -> AttemptControl:
    control = ctx._control
    if control.done.is_set():
        raise InvalidInputError(f"ctx.step({name!r}) is a call of a running attempt; this "
                                f"one has ended")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidInputError(f"A step name must be 1-200 characters of letters, digits "
                                f"and _ . : -, not {name!r:.120}")
    if not callable(fn):
        raise InvalidInputError(f"Step {name!r}: fn must be callable, not {fn!r:.80}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise InvalidInputError(f"Step {name!r}: retries must be a whole number >= 0, "
                                f"not {retries!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or not math.isfinite(timeout) or timeout <= 0):
        raise InvalidInputError(f"Step {name!r}: timeout must be seconds > 0, not {timeout!r}")
    active = _active.get()
    if active is not None:
        raise InvalidInputError(f"Step {name!r} was called inside step {active.key!r}: steps "
                                f"do not nest (make it one step, or two after each other)")
    control.check()
    return control


def _stored_form(name: str, result: Any) -> tuple[str, Any]:
    """The result as JSON text, and as it is stored and as a replay returns it (JSON: a
    tuple comes back a list), so the first execution and every replay see the same value
    (a copy: what the agent does to it after is not stored)."""
    text = capped_json(result, f"Result of step {name!r}", "MAX_OUTPUT_BYTES")
    return text, json.loads(text)


# ----------------------------------------------------------------------- the writes


def _start_write(control: AttemptControl, name: str) -> transitions.StepStartWrite:
    return transitions.StepStartWrite(
        control.ref, name, control.step_counts.get(name, 0) + 1 if name in control.step_counts
        else None, control.checkpoints, int(app_settings.MAX_STEPS_PER_RUN))


def _restart(start: transitions.StepStartWrite,
             step: ActiveStep) -> transitions.StepStartWrite:
    """The start of a retry: the same occurrence, known by now."""
    return transitions.StepStartWrite(start.ref, start.name, step.occurrence, start.checkpoint,
                                      start.max_steps)


def _held(control: AttemptControl, start: transitions.StepStartWrite,
          on_loop: bool = False) -> StepStart | None:
    """The start of a fresh run's step, held by the attempt instead of written (None: it
    must be written, and its answer awaited).

    A fresh run (its first attempt, not a fork: `control.fresh_steps`) holds no step
    records but this attempt's, so none of its steps can be done already, its occurrence
    is this attempt's count, and its cap is checked here. The start is written with the
    step's end (one row, done or failed), or ahead of the attempt's next write, or by the
    lease keeper once the step has run `START_HELD` seconds; a crash before then leaves
    no record, and the step is executed again with the same key, as one whose start was
    recorded would be. `on_loop`: an async step's, where no transaction is open (and
    Django's `connection` would be made anew for each task)."""
    if not control.fresh_steps or control.store is None or \
            (not on_loop and connection.in_atomic_block):
        return None
    occurrence = start.occurrence or 1
    if sum(control.step_counts.values()) >= start.max_steps:
        raise LimitExceeded(f"run {control.ref.run_id} holds {start.max_steps} steps, the "
                            f"most {SETTING_NAME}['MAX_STEPS_PER_RUN'] allows; the step "
                            f"{start.name!r} was not started")
    write = transitions.StepStartWrite(start.ref, start.name, occurrence, start.checkpoint,
                                       start.max_steps)
    control.step_counts[start.name] = occurrence
    control.pending_step = (write, time.monotonic())
    return StepStart(Renewal.OK, occurrence)


def fresh(run: AgentRun) -> bool:
    """Whether `run` holds no step records yet: its first attempt, and not a fork given
    its origin's. Asked of the claimed row (a field not loaded answers False)."""
    return run.attempt == 1 and run.__dict__.get("steps_copied") is False


def flush_held(control: AttemptControl, now: float) -> None:
    """The lease keeper's pass: write the held start of a step running `START_HELD`
    seconds, so the run's page shows it (and a step's start costs a row of its own only
    when the step is long)."""
    held = control.pending_step
    if (control.pending_end is not None and now - control.pending_end_at >= END_HELD) or \
            (held is not None and now - held[1] >= START_HELD):
        control.flush_step()


def _took(control: AttemptControl, result: transitions.Result, name: str) -> StepStart:
    assert isinstance(result, StepStart), result
    control.apply(result.renewal)
    control.step_counts[name] = result.occurrence
    return result


def _end_write(control: AttemptControl, step: ActiveStep, began: float,
               error: BaseException | None, text: str | None = None) -> transitions.StepEndWrite:
    described = ""
    if error is not None:
        try:
            described = f"{type(error).__name__}: {error}"[:2000]
        except Exception:
            described = type(error).__name__
    return transitions.StepEndWrite(
        control.ref, step.name, step.occurrence, done=error is None, result_json=text,
        error=described.replace("\x00", ""), input_tokens=step.input_tokens,
        output_tokens=step.output_tokens, cost=step.cost,
        duration_ms=int((time.monotonic() - began) * 1000),
        max_events=int(app_settings.MAX_EVENTS_PER_RUN), checkpoint=step.checkpoint,
        started_at=step.started_at)


def _replayed(ctx: RunContext, started: StepStart) -> Any:
    metrics.observe_step(ctx.agent, "replayed")
    return started.result
