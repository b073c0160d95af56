"""One attempt, start to end: its control, the agent's call, and its recorded outcome.

The worker runs each claimed attempt through an `Executor`: a sync agent in a pool
thread (`run`), an async one as a coroutine on the executor's event loop (`arun`: no
thread per attempt, no executor hop per context call). `run_now` runs its interactive one
through the same call (`Executor.interactive`). The executor decides what happened
(succeeded, failed, stopped and why); `recording` picks the write that records it. Every
write of a worker's attempt goes through its attempt store (`store`), so attempts hold
no database connection. The agent is called outside any transaction: agent code may
take minutes, and a transaction held that long would pin locks (on SQLite, the file).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from asgiref.sync import async_to_sync, sync_to_async
from django.db import close_old_connections, connection

from ..db import aretry_for_half_lease, retry_for_half_lease
from ..exceptions import (
    AttemptStopped,
    AttemptTimeout,
    RunCancelledError,
    UnknownAgentError,
)
from ..models import AgentRun
from ..ops import metrics, tracing
from ..outcomes import AttemptRef, Outcome, OutcomeKind, Settlement, StopReason
from ..payloads import inputs_loaded, load_inputs
from ..queries import load_states, state_loaded
from ..registry import AgentSpec
from ..streaming import chunks
from ..transitions import Result, Write
from ..validation import capped_json
from . import late, recording, steps, versions
from .attempt_store import AttemptStore
from .context import RunContext, entered
from .control import AttemptControl, in_thread
from .handover import Handover

logger = logging.getLogger("django_agentruns.worker")

T = TypeVar("T")


class Executor:
    """Runs attempts for one worker (or for `run_now`): call the agent, record the outcome.

    `store` is the worker's attempt store, through which every write of its attempts goes
    (None: each write runs alone on the calling thread); `known` names the agents the
    worker has, for the error of a run whose agent it lacks. Async agents run on one event
    loop the executor starts on first need (`run_now` uses none: its async agent runs in
    `async_to_sync`, so its writes come back to the caller's thread and transaction).
    """

    def __init__(self, worker_id: str, *, store: AttemptStore | None = None,
                 known: Collection[str] = ()) -> None:
        self.worker_id = worker_id
        self.store = store
        # Where an attempt's last write goes, if not to `store`: the worker's hand-over
        # (a success settled with the next claim, `runtime.handover`).
        self.settles: Handover | None = None
        self.known = list(known)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    def control(self, ref: AttemptRef, timeout: float | None, checkpoints: int,
                ) -> AttemptControl:
        return AttemptControl(ref, timeout, checkpoints, self.store)

    def run(self, run: AgentRun, spec: AgentSpec | None, control: AttemptControl,
            then: late.Then | None = None) -> Settlement | late.Deferred | None:
        """One claimed attempt of a sync agent (or of an agent the worker lacks), in a
        worker thread: None if its outcome could not be written. With `then`, a success
        may be handed off instead (`late.DEFERRED`): `then` gets its settlement later.

        Never raises: storage failing while settling leaves the run running until its
        lease lapses, then the reaper (or a claim) takes it back. Nothing is lost.
        """
        began = time.monotonic()
        try:
            close_old_connections()
            # Current while the agent runs, so the agent's own spans nest in the attempt's.
            with tracing.attempt_span(run, self.worker_id) as span:
                outcome = self.outcome(run, spec, control)
                # The agent may have left this thread's connection broken (the database
                # restarted mid-run): replace it before the outcome is written.
                close_old_connections()
                finish_stream(control, outcome)
                if late.hand_off(self, run, spec, control, outcome, began, span, then,
                                 in_thread=True):
                    return late.DEFERRED
                settlement = self.record(spec, control.ref, outcome)
                span.set_outcome(settlement.value, outcome.error or outcome.stop_reason)
            self.settled(run, control, settlement, outcome, began)
            return settlement
        except BaseException:
            # BaseException: in a pool thread nothing else would ever read it.
            logger.exception("run %s: could not record the attempt's outcome", run.pk,
                             extra=extra(control.ref, run.agent))
            return None

    async def arun(self, run: AgentRun, spec: AgentSpec, control: AttemptControl,
                   then: late.Then | None = None) -> Settlement | late.Deferred | None:
        """One claimed attempt of an async agent, as a coroutine on the executor's loop:
        `run`'s contract, with every write awaited through the store."""
        began = time.monotonic()
        try:
            with tracing.attempt_span(run, self.worker_id) as span:
                outcome = await self._aupgraded(run, spec, control) or \
                    await self._astate(run, control) or \
                    await acall_agent(spec, make_context(run, control), control)
                await control.aflush_end()  # a step's end no later write carried
                await chunks.afinish(control, store=chunks.stores_at_finish(outcome.stop_reason))
                if late.hand_off(self, run, spec, control, outcome, began, span, then,
                                 in_thread=False):
                    return late.DEFERRED
                settlement = await self.arecord(spec, control.ref, outcome)
                span.set_outcome(settlement.value, outcome.error or outcome.stop_reason)
            facts: dict[str, str] = {}
            if settlement in recording.TOLD:
                # The ORM must not run on the loop; its thread keeps no connection.
                facts = await sync_to_async(recording.settlement_facts, thread_sensitive=False)(
                    control.ref, settlement, close=True)
            self.settled(run, control, settlement, outcome, began, facts)
            return settlement
        except Exception:
            logger.exception("run %s: could not record the attempt's outcome", run.pk,
                             extra=extra(control.ref, run.agent))
            return None

    def outcome(self, run: AgentRun, spec: AgentSpec | None,
                control: AttemptControl) -> Outcome:
        if spec is None:
            return Outcome(OutcomeKind.FAILED, error=UnknownAgentError(run.agent, self.known))
        if versions.needs_upgrade(run, spec):
            try:
                versions.upgrade(run, spec, control)
            except BaseException as exc:
                return _raised(control, exc)
        try:
            if not state_loaded(run):  # the claim loop did not read it: a storage call
                control.call(load_states, [run])
            if not inputs_loaded(run):  # nor its input
                control.call(load_inputs, [run])
        except BaseException as exc:
            return _raised(control, exc)
        return call_agent(spec, make_context(run, control), control)

    async def _aupgraded(self, run: AgentRun, spec: AgentSpec,
                         control: AttemptControl) -> Outcome | None:
        """An older run's state migrated (off the loop) before its agent runs; the
        outcome if that failed."""
        if not versions.needs_upgrade(run, spec):
            return None
        try:
            await in_thread(control, versions.upgrade, run, spec, control)
        except BaseException as exc:
            return _raised(control, exc)
        return None

    async def _astate(self, run: AgentRun, control: AttemptControl) -> Outcome | None:
        """The run's resume state read (off the loop) if the claim loop did not; the
        outcome if that failed."""
        try:
            if not state_loaded(run):
                await in_thread(control, load_states, [run])
            if not inputs_loaded(run):
                await in_thread(control, load_inputs, [run])
        except BaseException as exc:
            return _raised(control, exc)
        return None

    def record(self, spec: AgentSpec | None, ref: AttemptRef, outcome: Outcome,
               write: Callable[[Write], Result] | None = None) -> Settlement:
        """Write the outcome, retrying a database error for up to half the lease.

        Each settle is one guarded transaction, so a retry after a commit whose answer was
        lost finds the guard unmatched and writes nothing twice. Past half the lease the
        run is left to lapse and be reclaimed, as if this worker had died. `write`: how
        (default: the hand-over, else the store, else alone on this thread).
        """
        writer = self.settles or self.store
        write = write or (writer.call if writer is not None else None)
        return _retrying(ref, lambda: recording.record(spec, ref, outcome, write=write))

    async def arecord(self, spec: AgentSpec, ref: AttemptRef, outcome: Outcome) -> Settlement:
        """`record` on the event loop: the write awaited through the store."""
        if recording.waiting(outcome):
            return Settlement.WAITING
        step = recording.transition(spec, ref, outcome)
        if step is None:
            # A lost lease writes nothing; its signal's receivers may use the ORM, which
            # must not run on the event loop.
            await sync_to_async(recording.announce_lost, thread_sensitive=False)(ref)
            return Settlement.LOST
        if self.store is None:
            return await sync_to_async(self.record, thread_sensitive=False)(spec, ref, outcome)
        store = self.settles or self.store

        def on_error(exc: Exception, wait: float, spent: bool) -> None:
            if spent:
                raise exc
            _log_retry(ref, exc, wait)

        return recording.settled(
            await aretry_for_half_lease(ref.lease_ttl, lambda: store.acall(step), on_error))

    def interactive(self, spec: AgentSpec, run: AgentRun, control: AttemptControl) -> Outcome:
        """`run_now`'s attempt, in the caller's thread (and transaction, if one is open)."""
        outcome = call_agent(spec, make_context(run, control), control)
        finish_stream(control, outcome)
        recording.record(spec, control.ref, outcome, interactive=True)
        return outcome

    def settled(self, run: AgentRun, control: AttemptControl, settlement: Settlement,
                 outcome: Outcome, began: float,
                 facts: dict[str, str] | None = None) -> None:
        if facts is None:
            facts = recording.settlement_facts(control.ref, settlement)
        recording.log_settlement(control.ref, run.agent, settlement, outcome, facts)
        metrics.observe_settlement(run.agent, settlement.value, metrics.queue_wait(run),
                                   time.monotonic() - began)

    def ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self.loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="agentruns-loop",
                                 daemon=True).start()
                self.loop = loop
            return self.loop

    def close(self) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)


def _retrying(ref: AttemptRef, write: Callable[[], T]) -> T:
    def on_error(exc: Exception, wait: float, spent: bool) -> None:
        if spent:
            raise exc
        _log_retry(ref, exc, wait)
        connection.close()

    return retry_for_half_lease(ref.lease_ttl, write, on_error)


def _log_retry(ref: AttemptRef, exc: BaseException, wait: float) -> None:
    logger.warning("run %s: recording the outcome failed (%s); retrying in %.2fs",
                   ref.run_id, exc, wait, extra=extra(ref, ref.agent))


def finish_stream(control: AttemptControl, outcome: Outcome) -> None:
    """Streamed text not yet stored is, before the outcome is recorded (not if fenced)."""
    chunks.finish(control, store=chunks.stores_at_finish(outcome.stop_reason))


def make_context(run: AgentRun, control: AttemptControl) -> RunContext:
    control.fresh_steps = steps.fresh(run)
    return RunContext(run_id=run.pk, agent=run.agent, input=run.input, attempt=run.attempt,
                      state=run.checkpoint_state, scope=run.scope, control=control,
                      limit_key=run.limit_key)


def call_agent(spec: AgentSpec, ctx: RunContext, control: AttemptControl) -> Outcome:
    """Run the agent's code in this thread and say how it ended. Never raises for the
    agent's errors. An async agent here is `run_now`'s: its storage calls come back to
    this thread (see context._in_thread), so they join the caller's transaction."""
    try:
        if spec.is_async:
            result = async_to_sync(_with_timeout)(spec, ctx, control)
        else:
            with entered(ctx):
                result = spec.func(ctx)
    except BaseException as exc:
        return _raised(control, exc)
    return _returned(spec, control, result)


async def acall_agent(spec: AgentSpec, ctx: RunContext, control: AttemptControl) -> Outcome:
    """`call_agent` for an async agent on the running loop: a task the control can cancel
    from any thread (the lease keeper's stops)."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(_with_timeout(spec, ctx, control))
    control.future = _LoopTask(loop, task)
    if control.stop_reason is not None:
        task.cancel()
    try:
        result = await task
    except BaseException as exc:
        return _raised(control, exc)
    return _returned(spec, control, result)


class _LoopTask:
    """A task's `cancel()`, safe from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
        self.loop, self.task = loop, task

    def cancel(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)


def _raised(control: AttemptControl, exc: BaseException) -> Outcome:
    if isinstance(exc, AttemptStopped | asyncio.CancelledError | concurrent.futures.CancelledError):
        if control.stop_reason is None and not isinstance(exc, AttemptStopped):
            return Outcome(OutcomeKind.FAILED, error=exc)  # the agent's own cancellation
        return Outcome(OutcomeKind.STOPPED, stop_reason=control.stop_reason or StopReason.SHUTDOWN,
                       detail=control.over_budget or "")
    # BaseException: an agent's SystemExit or KeyboardInterrupt is its failure too, and
    # must be recorded like any other (the caller of `run_now` still gets it raised).
    if control.stop_reason in (StopReason.LEASE_LOST, StopReason.CANCELLED,
                               StopReason.INTERRUPTED, StopReason.WAITING, StopReason.BUDGET):
        # The agent turned our stop into an error of its own: the stop is what happened.
        return Outcome(OutcomeKind.STOPPED, stop_reason=control.stop_reason,
                       detail=control.over_budget or "")
    return Outcome(OutcomeKind.FAILED, error=exc.error if isinstance(exc, _Escaped) else exc)


def _returned(spec: AgentSpec, control: AttemptControl, result: Any) -> Outcome:
    if control.stop_reason in (StopReason.LEASE_LOST, StopReason.CANCELLED,
                               StopReason.WAITING):
        # A cancel the attempt was told of wins even if the agent then returned without
        # reaching another step boundary: the operator asked for it to stop.
        return Outcome(OutcomeKind.STOPPED, stop_reason=control.stop_reason)
    try:
        # Capped before anything is written: one oversized output must not reach (and
        # fail) the statement that settles the worker's other successes with it.
        capped_json(result, f"Output of agent {spec.name!r}", "MAX_OUTPUT_BYTES")
    except Exception as exc:  # an output object may raise anything while being encoded
        return Outcome(OutcomeKind.FAILED, error=exc)
    return Outcome(OutcomeKind.SUCCEEDED, output=result)


class _Escaped(Exception):
    """Carries an async agent's SystemExit or KeyboardInterrupt out of its task: raised
    as they are, asyncio would re-raise them in the event loop and stop it."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(type(error).__name__)
        self.error = error


async def _contained(spec: AgentSpec, ctx: RunContext) -> Any:
    try:
        with entered(ctx):
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


def stopped_error(spec: AgentSpec, outcome: Outcome) -> BaseException:
    """The exception `run_now` raises for an attempt that was stopped, not failed."""
    if outcome.stop_reason is StopReason.TIMEOUT:
        return AttemptTimeout(f"attempt exceeded its timeout of {spec.timeout}s")
    return RunCancelledError(f"run of {spec.name!r} stopped: {outcome.stop_reason}")


def extra(ref: AttemptRef, agent: str) -> dict[str, Any]:
    """The log record fields of one attempt."""
    return {"run_id": ref.run_id, "agent": agent, "attempt": ref.attempt,
            "worker_id": ref.worker_id}
