"""One attempt: call the agent outside any transaction, then hand the outcome to storage.

The executor decides (succeeded, failed and how, cancelled, abandoned, lease lost);
`transitions` writes. Nothing here builds SQL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asgiref.sync import async_to_sync

from . import policy, signals, transitions
from .conf import app_settings
from .context import AttemptControl, RunContext, StopReason, capped_json, storable_text
from .exceptions import AttemptStopped, AttemptTimeout, RunCancelledError
from .models import AgentRun
from .registry import AgentSpec
from .transitions import AttemptRef, ErrorInfo, Settlement

logger = logging.getLogger("django_agentruns.worker")


@dataclass
class Outcome:
    """What the attempt came to, before storage is told."""

    kind: str  # "succeeded" | "failed" | "stopped"
    output: Any = None
    error: BaseException | None = None
    stop_reason: str | None = None
    detail: str = ""  # what passed the budget, for a budget stop


def make_context(run: AgentRun, control: AttemptControl) -> RunContext:
    return RunContext(run_id=run.pk, agent=run.agent, input=run.input, attempt=run.attempt,
                      state=run.checkpoint_state, scope=run.scope, control=control)


def call_agent(
    spec: AgentSpec, ctx: RunContext, control: AttemptControl,
    loop: asyncio.AbstractEventLoop | None,
) -> Outcome:
    """Run the agent's code and say how it ended. Never raises for the agent's errors."""
    # The worker calls this with no transaction open: agent code may take minutes, and
    # a transaction held that long would pin locks (and, on SQLite, the whole database).
    try:
        if spec.is_async:
            if loop is None:
                # `run_now`: the agent's storage calls come back to this thread (see
                # context._in_thread), so they join the caller's transaction.
                result = async_to_sync(_with_timeout)(spec, ctx, control)
            else:
                future = asyncio.run_coroutine_threadsafe(_with_timeout(spec, ctx, control), loop)
                control.future = future
                if control.stop_reason is not None:
                    future.cancel()
                result = future.result()
        else:
            result = spec.func(ctx)
    except (AttemptStopped, asyncio.CancelledError, concurrent.futures.CancelledError) as exc:
        if control.stop_reason is None and not isinstance(exc, AttemptStopped):
            return Outcome("failed", error=exc)  # the agent's own cancellation, not a stop
        reason = control.stop_reason or StopReason.SHUTDOWN
        return Outcome("stopped", stop_reason=reason, detail=control.over_budget or "")
    except BaseException as exc:
        # BaseException: an agent's SystemExit or KeyboardInterrupt is its failure too, and
        # must be recorded like any other (the caller of `run_now` still gets it raised).
        if control.stop_reason in (StopReason.LEASE_LOST, StopReason.CANCELLED,
                                   StopReason.INTERRUPTED, StopReason.BUDGET):
            # The agent turned our stop into an error of its own: the stop is what happened.
            return Outcome("stopped", stop_reason=control.stop_reason,
                           detail=control.over_budget or "")
        return Outcome("failed", error=exc.error if isinstance(exc, _Escaped) else exc)
    if control.stop_reason in (StopReason.LEASE_LOST, StopReason.CANCELLED):
        # A cancel the attempt was told of wins even if the agent then returned without
        # reaching another step boundary: the operator asked for it to stop.
        return Outcome("stopped", stop_reason=control.stop_reason)
    try:
        # Capped before anything is written: one oversized output must not reach (and
        # fail) the statement that settles the worker's other successes with it.
        capped_json(result, f"Output of agent {spec.name!r}", "MAX_OUTPUT_BYTES")
    except Exception as exc:  # an output object may raise anything while being encoded
        return Outcome("failed", error=exc)
    return Outcome("succeeded", output=result)


class _Escaped(Exception):
    """Carries an async agent's SystemExit or KeyboardInterrupt out of its task: raised
    as they are, asyncio would re-raise them in the event loop and stop it."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(type(error).__name__)
        self.error = error


async def _contained(spec: AgentSpec, ctx: RunContext) -> Any:
    try:
        return await spec.func(ctx)
    except (SystemExit, KeyboardInterrupt) as exc:
        raise _Escaped(exc) from None


async def _with_timeout(spec: AgentSpec, ctx: RunContext, control: AttemptControl) -> Any:
    if control.deadline is None:
        return await _contained(spec, ctx)
    try:
        return await asyncio.wait_for(_contained(spec, ctx), timeout=spec.timeout)
    except TimeoutError:
        control.request_stop(StopReason.TIMEOUT)
        raise AttemptStopped(StopReason.TIMEOUT) from None


def record(
    spec: AgentSpec | None, ref: AttemptRef, outcome: Outcome, *, interactive: bool = False,
    succeed: Callable[[AttemptRef, Any], Settlement] | None = None,
) -> Settlement:
    """Hand the outcome to storage; a stop for a lost lease writes nothing at all.

    `succeed` writes a success (the worker passes its group commit).
    """
    settlement = _store(spec, ref, outcome, interactive, succeed)
    if settlement is Settlement.LOST:
        signals.send_after_commit(signals.run_lease_lost, run_id=ref.run_id, agent=ref.agent,
                                  attempt=ref.attempt, worker_id=ref.worker_id)
    return settlement


def _store(
    spec: AgentSpec | None, ref: AttemptRef, outcome: Outcome, interactive: bool,
    succeed: Callable[[AttemptRef, Any], Settlement] | None,
) -> Settlement:
    if outcome.kind == "succeeded":
        return (succeed or transitions.settle_succeeded)(ref, outcome.output)
    if outcome.kind == "stopped":
        if outcome.stop_reason == StopReason.LEASE_LOST:
            return Settlement.LOST
        if outcome.stop_reason == StopReason.CANCELLED:
            return transitions.settle_cancelled(ref)
        if outcome.stop_reason == StopReason.SHUTDOWN:
            # Flow control: a graceful stop is an interruption, not a failure (no budget).
            return transitions.interrupt(ref, "the worker stopped")
        if outcome.stop_reason == StopReason.INTERRUPTED:
            return transitions.interrupt(ref, "the database was out of reach")
        if outcome.stop_reason == StopReason.BUDGET:  # flow control
            return transitions.exhaust_budget(ref, _over_budget(outcome))
        error: BaseException = AttemptTimeout(
            f"attempt exceeded its timeout of {spec.timeout if spec else '?'}s")
    else:
        assert outcome.error is not None
        error = outcome.error
    failure = classify_for(spec, error)
    if failure.snooze and not interactive:  # flow control: no budget spent
        return transitions.snooze(ref, failure, describe(error))
    return transitions.settle_failed(ref, failure, describe(error), interactive=interactive)


def _over_budget(outcome: Outcome) -> str:
    return outcome.detail or "usage passed the budget"


def classify_for(spec: AgentSpec | None, error: BaseException) -> policy.Failure:
    custom: Callable[[BaseException], bool | None] | None = None
    if spec is not None and spec.classify is not None:
        custom = spec.classify
    else:
        custom = app_settings.classifier()
    unknown = bool(app_settings.UNKNOWN_ERRORS_RETRYABLE)
    try:
        return policy.classify(error, custom=custom, unknown_retryable=unknown)
    except Exception:
        # A classifier (or an attribute of the error) that raises must not leave the
        # attempt unrecorded: treat the error as one nothing recognises.
        logger.exception("classifying %s raised; treated as unrecognised", type(error))
        return policy.Failure(retryable=unknown)


def describe(error: BaseException) -> ErrorInfo:
    cls = type(error)
    name = cls.__qualname__ if cls.__module__ == "builtins" else \
        f"{cls.__module__}.{cls.__qualname__}"
    try:
        trace = "".join(traceback.format_exception(error))
    except Exception as exc:
        trace = f"<traceback unavailable: {type(exc).__name__}>"
    # storable_text: an agent's error may carry any text; a NUL or a lone surrogate in it
    # must not make the outcome impossible to record (the run would stay running).
    return ErrorInfo(
        type=storable_text(name),
        message=storable_text(error_text(error)[:10000]),
        traceback=storable_text(trace[-20000:]),
    )


def error_text(error: BaseException) -> str:
    """`str(error)`, or what it raised: an error whose `__str__` fails is still recorded."""
    try:
        return str(error)
    except Exception as exc:
        return f"<{type(error).__name__}: str() raised {type(exc).__name__}>"


def log_settlement(ref: AttemptRef, agent: str, settlement: Settlement, outcome: Outcome) -> None:
    extra = {"run_id": ref.run_id, "agent": agent, "attempt": ref.attempt,
             "worker_id": ref.worker_id, "outcome": settlement.value}
    if settlement is Settlement.LOST:
        logger.warning("run %s %s attempt %s: lease lost (%s); nothing recorded",
                       ref.run_id, agent, ref.attempt, outcome.stop_reason or outcome.kind,
                       extra=extra)
        return
    detail = ""
    level = logging.INFO
    if outcome.error is not None:
        detail = f": {type(outcome.error).__name__}: {error_text(outcome.error)}"
        if not isinstance(outcome.error, Exception):
            level = logging.WARNING  # SystemExit, KeyboardInterrupt: rarely meant
    elif outcome.stop_reason:
        detail = f" ({outcome.stop_reason})"
    logger.log(level, "run %s %s attempt %s %s%s", ref.run_id, agent, ref.attempt,
               settlement.value, detail, extra=extra)


def stopped_error(spec: AgentSpec, outcome: Outcome) -> BaseException:
    """The exception `run_now` raises for an attempt that was stopped, not failed."""
    if outcome.stop_reason == StopReason.TIMEOUT:
        return AttemptTimeout(f"attempt exceeded its timeout of {spec.timeout}s")
    return RunCancelledError(f"run of {spec.name!r} stopped: {outcome.stop_reason}")
