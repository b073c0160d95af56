"""One attempt, start to end: its control, the agent's call, and its recorded outcome.

The worker runs each claimed attempt through an `Executor` (in a pool thread); `run_now`
runs its interactive one through the same call (`Executor.interactive`). The executor
decides what happened (succeeded, failed, stopped and why); `recording` picks the
transition that writes it. The agent is called outside any transaction: agent code may
take minutes, and a transaction held that long would pin locks (on SQLite, the file).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from asgiref.sync import async_to_sync
from django.db import DatabaseError, close_old_connections, connection

from . import metrics, recording, tracing
from .context import RunContext
from .db import storage_unreachable
from .exceptions import (
    AttemptStopped,
    AttemptTimeout,
    RunCancelledError,
    UnknownAgentError,
)
from .models import AgentRun
from .outcomes import AttemptRef, Outcome, OutcomeKind, Renewal, Settlement, StopReason
from .registry import AgentSpec
from .validation import capped_json

logger = logging.getLogger("django_agentruns.worker")

Succeed = Callable[[AttemptRef, Any], Settlement]


class AttemptControl:
    """The worker's handle on one attempt: its fence, its deadline, and a stop switch."""

    def __init__(self, ref: AttemptRef, timeout: float | None, checkpoints: int) -> None:
        self.ref = ref
        self.deadline = None if not timeout else time.monotonic() + timeout
        self.checkpoints = checkpoints
        self.position = 0
        self.stop_reason: StopReason | None = None
        self.future: Any = None  # an async attempt's concurrent future, cancelled to stop it
        self.done = threading.Event()
        self.in_storage = 0
        self._lock = threading.Lock()

    def request_stop(self, reason: StopReason) -> None:
        """Ask the attempt to stop; the first reason wins."""
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = reason
            future = self.future
        if future is not None:
            future.cancel()

    def timed_out(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def check(self) -> None:
        if self.stop_reason is None and self.timed_out():
            self.request_stop(StopReason.TIMEOUT)
        if self.stop_reason is not None:
            raise AttemptStopped(self.stop_reason)

    def apply(self, renewal: Renewal) -> None:
        if renewal is Renewal.LOST:
            self.request_stop(StopReason.LEASE_LOST)
        elif renewal is Renewal.CANCEL_REQUESTED:
            self.request_stop(StopReason.CANCELLED)
        self.check()

    def call(self, write: Callable[..., Renewal], *args: Any) -> Renewal:
        """One storage call of the attempt, retried on a fresh connection while the
        database is out of reach (a restart, a killed session, lock contention).

        The engine's storage failures are not the agent's: past half the lease the attempt
        stops as interrupted, and is requeued without spending its budget. Each write is
        one guarded, idempotent transaction, so a retry after a lost commit adds nothing.
        Interactive runs (no lease, maybe in the caller's transaction) are not retried.
        """
        deadline = time.monotonic() + (self.ref.lease_ttl or 0.0) / 2
        wait = 0.05
        while True:
            raw = connection.connection
            try:
                with self.storage():
                    return write(*args)
            except DatabaseError as exc:
                if self.ref.lease_ttl is None or connection.in_atomic_block \
                        or not storage_unreachable(exc, raw):
                    raise
                with suppress(Exception):
                    connection.close()  # broken: the next try opens a fresh one
                if self.stop_reason is not None:
                    raise AttemptStopped(self.stop_reason) from exc
                if time.monotonic() + wait > deadline:
                    self.request_stop(StopReason.INTERRUPTED)
                    raise AttemptStopped(StopReason.INTERRUPTED) from exc
                logger.warning("run %s: storage call failed (%s); retrying in %.2fs",
                               self.ref.run_id, exc, wait)
                time.sleep(wait)
                wait = min(1.0, wait * 2)

    @contextmanager
    def storage(self) -> Iterator[None]:
        """Count storage calls in flight, so a stop never lands inside one."""
        with self._lock:
            self.in_storage += 1
        try:
            yield
        finally:
            with self._lock:
                self.in_storage -= 1


class Executor:
    """Runs attempts for one worker (or for `run_now`): call the agent, record the outcome.

    `succeed` writes a success (the worker passes its group commit); `known` names the
    agents the worker has, for the error of a run whose agent it lacks. Async agents run
    on one event loop the executor starts on first need (`run_now` uses none: its async
    agent runs in `async_to_sync`, so its writes come back to the caller's thread).
    """

    def __init__(self, worker_id: str, *, succeed: Succeed | None = None,
                 known: Collection[str] = ()) -> None:
        self.worker_id = worker_id
        self.succeed = succeed
        self.known = list(known)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    def run(self, run: AgentRun, spec: AgentSpec | None,
            control: AttemptControl) -> Settlement | None:
        """One claimed attempt, in a worker thread: None if its outcome could not be written.

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
                settlement = self.record(spec, control.ref, outcome)
                span.set_outcome(settlement.value, outcome.error or outcome.stop_reason)
            recording.log_settlement(control.ref, run.agent, settlement, outcome)
            metrics.observe_settlement(run.agent, settlement.value, metrics.queue_wait(run),
                                       time.monotonic() - began)
            return settlement
        except BaseException:
            # BaseException: in a pool thread nothing else would ever read it.
            logger.exception("run %s: could not record the attempt's outcome", run.pk,
                             extra=extra(control.ref, run.agent))
            return None

    def outcome(self, run: AgentRun, spec: AgentSpec | None,
                control: AttemptControl) -> Outcome:
        if spec is None:
            return Outcome(OutcomeKind.FAILED, error=UnknownAgentError(run.agent, self.known))
        loop = self.ensure_loop() if spec.is_async else None
        return call_agent(spec, make_context(run, control), control, loop)

    def record(self, spec: AgentSpec | None, ref: AttemptRef, outcome: Outcome) -> Settlement:
        """Write the outcome, retrying a database error for up to half the lease.

        Each settle is one guarded transaction, so a retry after a commit whose answer was
        lost finds the guard unmatched and writes nothing twice. Past half the lease the
        run is left to lapse and be reclaimed, as if this worker had died.
        """
        deadline = time.monotonic() + (ref.lease_ttl or 0.0) / 2
        wait = 0.05
        while True:
            try:
                return recording.record(spec, ref, outcome, succeed=self.succeed)
            except DatabaseError as exc:
                if time.monotonic() + wait > deadline:
                    raise
                logger.warning("run %s: recording the outcome failed (%s); retrying in %.2fs",
                               ref.run_id, exc, wait, extra=extra(ref, ref.agent))
                connection.close()
                time.sleep(wait)
                wait = min(1.0, wait * 2)

    def interactive(self, spec: AgentSpec, run: AgentRun, control: AttemptControl) -> Outcome:
        """`run_now`'s attempt, in the caller's thread (and transaction, if one is open)."""
        outcome = call_agent(spec, make_context(run, control), control, None)
        recording.record(spec, control.ref, outcome, interactive=True)
        return outcome

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


def make_context(run: AgentRun, control: AttemptControl) -> RunContext:
    return RunContext(run_id=run.pk, agent=run.agent, input=run.input, attempt=run.attempt,
                      state=run.checkpoint_state, scope=run.scope, control=control)


def call_agent(
    spec: AgentSpec, ctx: RunContext, control: AttemptControl,
    loop: asyncio.AbstractEventLoop | None,
) -> Outcome:
    """Run the agent's code and say how it ended. Never raises for the agent's errors."""
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
            return Outcome(OutcomeKind.FAILED, error=exc)  # the agent's own cancellation
        return Outcome(OutcomeKind.STOPPED, stop_reason=control.stop_reason or StopReason.SHUTDOWN)
    except BaseException as exc:
        # BaseException: an agent's SystemExit or KeyboardInterrupt is its failure too, and
        # must be recorded like any other (the caller of `run_now` still gets it raised).
        if control.stop_reason in (StopReason.LEASE_LOST, StopReason.CANCELLED,
                                   StopReason.INTERRUPTED):
            # The agent turned our stop into an error of its own: the stop is what happened.
            return Outcome(OutcomeKind.STOPPED, stop_reason=control.stop_reason)
        return Outcome(OutcomeKind.FAILED, error=exc.error if isinstance(exc, _Escaped) else exc)
    if control.stop_reason in (StopReason.LEASE_LOST, StopReason.CANCELLED):
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
