"""An attempt's control: its fence, its deadline, its stop switch, and its writes.

Shared by the executor (which makes one per attempt), the lease keeper (which stops it)
and `RunContext` (whose calls write through it). A worker's attempts write through its
attempt store (`store`): they hold no database connection of their own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections, connection

from .. import transitions
from ..db import (
    aretry_for_half_lease,
    close_all_connections,
    retry_for_half_lease,
    storage_unreachable,
)
from ..exceptions import AttemptStopped
from ..outcomes import AttemptRef, Renewal, StopReason
from ..rules.limits import Budget
from ..transitions import Result, Write, apply_alone
from .attempt_store import AttemptStore, StoreUnreachable

T = TypeVar("T")

logger = logging.getLogger("django_agentruns.worker")


class AttemptControl:
    """The worker's handle on one attempt: its fence, its deadline, and a stop switch."""

    def __init__(self, ref: AttemptRef, timeout: float | None, checkpoints: int,
                 store: AttemptStore | None = None) -> None:
        self.ref = ref
        self.store = store  # None: each write runs alone, on the calling thread
        self.deadline = None if not timeout else time.monotonic() + timeout
        self.checkpoints = checkpoints
        self.position = 0
        self.stop_reason: StopReason | None = None
        self.future: Any = None  # an async attempt's task handle, cancelled to stop it
        self.done = threading.Event()
        self.in_storage = 0
        self._lock = threading.Lock()
        # Flow control (django_agentruns.runtime.usage arms these): the run's budget, what it has
        # recorded so far, and what passed the budget once it has.
        self.budget: Budget | None = None
        self.spent: tuple[int, float] = (0, 0.0)
        self.over_budget: str | None = None
        # Durable steps (runtime.steps): the last occurrence of each step name called.
        self.step_counts: dict[str, int] = {}
        # A fresh run (its first attempt, not a fork) holds no step records but this
        # attempt's, so a step's start need not ask storage whether it is done: it is held
        # here (`pending_step`, with when it began) until the step's end, which writes
        # both, or the attempt's next write or the lease keeper flush it (`flush_step`).
        self.fresh_steps = False
        self.pending_step: tuple[Write, float] | None = None
        # Its steps' ends, likewise, are held (`hold_end`) and carried by the attempt's
        # next write (`CarriedEnd`: one queued write for both), or flushed by the lease
        # keeper, a storage call, or the attempt's end (`aflush_end`).
        self.pending_end: transitions.StepEndWrite | None = None
        self.pending_end_at = 0.0  # when it was held (time.monotonic)
        self.usage_calls = 0  # record_usage calls so far: each write's key (run, attempt, n)

    def request_stop(self, reason: StopReason) -> None:
        """Ask the attempt to stop; the first reason wins."""
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = reason
            future = self.future
        if future is not None:
            with suppress(RuntimeError):  # its loop is closed: nothing left to stop
                future.cancel()

    def end_waiting(self) -> None:
        """The attempt's wait is recorded: that is why it stops, whatever a lease keeper that
        saw the lease released since may have said."""
        with self._lock:
            self.stop_reason = StopReason.WAITING

    def timed_out(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def check(self) -> None:
        if self.stop_reason is None and self.timed_out():
            self.request_stop(StopReason.TIMEOUT)
        if self.stop_reason is None and self.over_budget is not None:
            self.request_stop(StopReason.BUDGET)
        if self.stop_reason is not None:
            raise AttemptStopped(self.stop_reason)

    def apply(self, result: Result) -> None:
        """Take what a write answered: a lost lease or a cancel request stops the attempt."""
        assert isinstance(result, Renewal), result
        renewal = result
        if renewal is Renewal.LOST:
            self.request_stop(StopReason.LEASE_LOST)
        elif renewal is Renewal.CANCEL_REQUESTED:
            self.request_stop(StopReason.CANCELLED)
        self.check()

    def take_step_start(self) -> bool:
        """The step's end is here: its start, if still held, is written with it (True)."""
        with self._lock:
            held, self.pending_step = self.pending_step, None
        return held is not None

    def hold_end(self, end: transitions.StepEndWrite) -> None:
        """Hold a step's end for the attempt's next write to carry; one held already (two
        steps with no write between) is submitted now, ahead of it."""
        with self._lock:  # submitted under the lock, as `flush_step` does: in order
            previous, self.pending_end = self.pending_end, end
            self.pending_end_at = time.monotonic()
            future = None if previous is None or self.store is None \
                else self.store.submit(previous)
        if future is not None:
            future.add_done_callback(self._flushed)

    def carried(self, write: Write) -> Write:
        """`write`, carrying the step end held, if any (not by another step's end, whose
        `run.step` event could not share its round: `flush_step` writes the held one
        ahead of it)."""
        if isinstance(write, transitions.StepEndWrite):
            return write
        with self._lock:
            end, self.pending_end = self.pending_end, None
        return write if end is None else transitions.CarriedEnd(end, write)

    async def await_held_end(self) -> None:
        """Before another step executes: the earlier step's held end, carried by a renewal
        and awaited, so no step's function runs while an earlier step's completion is
        still unrecorded (a crash then repeats only the step it interrupted)."""
        if self.pending_end is not None and self.store is not None:
            self.apply(await self.awrite(transitions.RenewWrite(self.ref)))
            self.check()

    def write_held_end(self) -> None:
        """`await_held_end` for a sync step (an async agent's `ctx.step`)."""
        if self.pending_end is not None and self.store is not None:
            self.apply(self.write(transitions.RenewWrite(self.ref)))
            self.check()

    async def aflush_end(self) -> None:
        """At the attempt's end, before its outcome is written: a step end still held is
        written, carried by a renewal, and awaited. Never raises: what the end could not
        record (a lost lease) the next attempt executes again."""
        if self.pending_end is None or self.store is None:
            return
        with suppress(Exception, AttemptStopped):
            await self.awrite(transitions.RenewWrite(self.ref))

    def flush_step(self, wait: bool = False, on_loop: bool = False) -> None:
        """Submit the held start of the step executing, if any, to the store, ahead of
        the attempt's writes that follow (the store keeps one run's writes in order).
        `wait`: until it has committed, for a write that does not go through the store.
        Inside the agent's own transaction it joins that transaction instead, as the
        write that follows does (a store writer could wait on the transaction's locks).
        `on_loop`: called on the event loop, where no transaction is open (nor asked)."""
        with self._lock:
            held, self.pending_step = self.pending_step, None
            end, self.pending_end = self.pending_end, None
            if (held is None and end is None) or self.store is None:
                return
            joins = not on_loop and connection.in_atomic_block
            # A held end is an earlier step's: written first.
            writes = [w for w in (end, held and held[0]) if w is not None]
            futures = [] if joins else [self.store.submit(w) for w in writes]
        if joins:
            for write in writes:
                started = self.call(apply_alone, write)
                self.apply(getattr(started, "renewal", started))
            return
        for future in futures:
            future.add_done_callback(self._flushed)
        if wait:
            with suppress(Exception):
                futures[-1].result()

    def _flushed(self, future: Any) -> None:
        """A flushed start's answer (in a writer thread): a lost lease stops the attempt.
        A start that could not be written is not retried: the step's end writes it whole."""
        with suppress(Exception):
            result = future.result()
            if getattr(result, "renewal", None) is Renewal.LOST:
                self.request_stop(StopReason.LEASE_LOST)

    def call(self, write: Callable[..., T], *args: Any) -> T:
        """One storage call of the attempt, retried on a fresh connection while the
        database is out of reach (a restart, a killed session, lock contention).

        The engine's storage failures are not the agent's: past half the lease the attempt
        stops as interrupted, and is requeued without spending its budget. Each write is
        one guarded, idempotent transaction, so a retry after a lost commit adds nothing.
        Interactive runs (no lease, maybe in the caller's transaction) are not retried.
        """
        raw = None
        self.flush_step(wait=True)

        def attempt() -> T:
            nonlocal raw
            raw = connection.connection
            with self.storage():
                return write(*args)

        def on_error(exc: Exception, wait: float, spent: bool) -> None:
            if self.ref.lease_ttl is None or connection.in_atomic_block \
                    or not storage_unreachable(exc, raw):
                raise exc
            with suppress(Exception):
                connection.close()  # broken: the next try opens a fresh one
            self._unreachable(exc, wait, spent)

        return retry_for_half_lease(self.ref.lease_ttl, attempt, on_error)

    def write(self, write: Write) -> Result:
        """One write of the attempt, from its thread: through the worker's attempt store
        (committed with other attempts' writes), or alone on this thread's connection.

        Through the store, a database out of reach (its writer reconnects first) is
        retried until half the lease is spent, then the attempt stops as interrupted.
        Called inside the agent's own `transaction.atomic()`, the write joins it instead
        (on the agent's connection), so the agent's writes and a checkpoint commit
        together or not at all.
        """
        if self.store is None or connection.in_atomic_block:
            return self.call(apply_alone, write)
        write = self.carried(write)
        self.flush_step()
        store = self.store

        def attempt() -> Result:
            with self.storage():
                return store.call(write)

        try:
            return retry_for_half_lease(self.ref.lease_ttl, attempt, self._unreachable,
                                        (StoreUnreachable,))
        except BaseException:
            self._put_back(write)
            raise

    async def awrite(self, write: Write) -> Result:
        """`write`, awaited on the event loop: no thread, no executor hop."""
        if self.store is None:
            return await in_thread(self, self.write, write)
        write = self.carried(write)
        self.flush_step(on_loop=True)
        store = self.store

        async def attempt() -> Result:
            with self.storage():
                return await store.acall(write)

        try:
            return await aretry_for_half_lease(self.ref.lease_ttl, attempt, self._unreachable,
                                               (StoreUnreachable,))
        except BaseException:
            self._put_back(write)
            raise

    def _put_back(self, write: Write) -> None:
        """A carrier that failed (its event past the cap, say) took its step end down with
        it: held again, for the next write, the keeper or the attempt's end. Written twice
        if it had committed after all, it changes nothing (the record is ended already)."""
        if not isinstance(write, transitions.CarriedEnd):
            return
        with self._lock:
            if self.pending_end is None:
                self.pending_end, self.pending_end_at = write.end, time.monotonic()
                return
            future = None if self.store is None else self.store.submit(write.end)
        if future is not None:
            future.add_done_callback(self._flushed)

    def _unreachable(self, exc: Exception, wait: float, spent: bool) -> None:
        """After a write the store could not make: stop, or let the caller wait `wait`."""
        if self.stop_reason is not None:
            raise AttemptStopped(self.stop_reason) from exc
        if spent:
            self.request_stop(StopReason.INTERRUPTED)
            raise AttemptStopped(StopReason.INTERRUPTED) from exc
        logger.warning("run %s: storage call failed (%s); retrying in %.2fs",
                       self.ref.run_id, exc, wait)

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


async def in_thread(control: AttemptControl, func: Callable[..., T], *args: Any) -> T:
    """Run a storage call off the event loop: the ORM is synchronous."""
    if control.ref.lease_ttl is None:
        # `run_now` (no lease): back in the caller's thread, which waits in async_to_sync,
        # so the write uses the caller's connection and joins any transaction it is in.
        return await sync_to_async(func, thread_sensitive=True)(*args)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, functools.partial(_storage_call, func, *args))


def _storage_call(func: Callable[..., T], *args: Any) -> T:
    """One call on a thread of the loop's default executor (a wait, a spawn, a task's
    bookkeeping). Its connection is closed after it, whatever CONN_MAX_AGE says: those
    threads are not the worker's, and a worker's attempts hold no connection between
    calls (its connections stay the few `Worker.connections()` counts)."""
    close_old_connections()
    try:
        return func(*args)
    finally:
        close_all_connections()
