"""The worker's attempt store: every write its attempts make, on a few connections.

Attempts hold no database connection. Their writes (events, checkpoints, renewals,
successes; `transitions.batched`) queue here, and a writer thread, with its own
connection, takes every write waiting and commits them in one transaction (group commit,
as databases do it for their log): no timer, so a lone write goes at once and a burst
costs one commit. The other `WRITER_CONNECTIONS` - 1 writers are spares: each takes a
batch while another is in flight only once a full batch waits (a burst). A caller's
`call()` / `await acall()` returns once its write has committed, so every guarantee of the
single-write path stands. Each write keeps its own fence: a lost lease is that write's
result (`LOST`), never the batch's failure. On SQLite the writers' IMMEDIATE transactions
take turns on the file's one write lock.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    OperationalError,
    connection,
    connections,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper

from ..conf import app_settings
from ..db import connection_answers, is_transient_lock_error
from ..transitions import batched
from ..transitions.batched import Result, Write
from ..transitions.plans import plan_by_index

logger = logging.getLogger("django_agentruns.store")

Apply = Callable[[Sequence[Write]], list[Result]]


class StoreUnreachable(OperationalError):
    """The database stayed out of reach for this write: its writer's connection broke past
    its reconnects, or the write met locks past its retries. Not the write's fault: the
    attempt may submit it again (it is fenced and idempotent), or stop as interrupted."""


@dataclass
class _Queued:
    """A write and who waits for it: a thread (`future`) or a coroutine (`afuture`)."""

    write: Write
    future: Future[Result] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    afuture: asyncio.Future[Result] | None = None

    def wanted(self) -> bool:
        """False once its caller gave up before the write was taken: it is not written."""
        if self.future is not None:
            return self.future.set_running_or_notify_cancel()
        return self.afuture is not None and not self.afuture.cancelled()


Outcome = tuple[_Queued, Result | BaseException]


class AttemptStore:
    """`writers` threads committing queued writes in group commits.

    `apply` runs a batch inside the writer's transaction (tests wrap it to fail on cue).
    A batch whose transaction fails for any other reason than a lock or a broken
    connection is retried write by write, each alone, so a write the database rejects
    fails only its own caller.
    """

    def __init__(self, writers: int | None = None, *, max_batch: int = 256,
                 apply: Apply | None = None, lock_retries: int = 8,
                 reconnects: int = 5) -> None:
        self.writers = int(app_settings.WRITER_CONNECTIONS) if writers is None else writers
        if self.writers < 1:
            raise ValueError("an attempt store needs at least one writer")
        self._max_batch = max_batch
        self._apply = apply or _apply_writes
        self._lock_retries = lock_retries
        self._reconnects = reconnects
        self._cond = threading.Condition()
        self._queue: list[_Queued] = []
        self._busy: set[int] = set()  # runs with a write in a writer's hands
        self._writing = 0  # writers with a batch in hand
        self.wrappers: list[BaseDatabaseWrapper] = []  # each writer's connection (tests)
        self._closed = False
        self.batches = 0  # transactions committed, for tests and the benchmark
        self.writes = 0  # writes committed (a LOST result counts: it was answered)
        self.alone = 0  # writes retried alone after their batch failed
        self._threads = [threading.Thread(target=self._write_loop, daemon=True,
                                          name=f"agentruns-writer-{n}")
                         for n in range(self.writers)]
        for thread in self._threads:
            thread.start()

    @property
    def waiting(self) -> int:
        """Writes queued behind the batches in flight."""
        with self._cond:
            return len(self._queue)

    def submit(self, write: Write) -> Future[Result]:
        """Queue `write`; the future resolves once it has committed (or raises its error)."""
        future: Future[Result] = Future()
        self._enqueue(_Queued(write, future=future))
        return future

    def call(self, write: Write) -> Result:
        """Write and wait for the commit, from a thread (never the event loop's)."""
        return self.submit(write).result()

    async def acall(self, write: Write) -> Result:
        """Write and await the commit, on the event loop itself: no executor thread. The
        writer wakes the loop once per batch (`call_soon_threadsafe`), not once per write.

        A cancelled `acall` withdraws its write if no writer has taken it yet; one taken
        commits (or not) all the same, as a cancelled `call` would."""
        loop = asyncio.get_running_loop()
        afuture: asyncio.Future[Result] = loop.create_future()
        self._enqueue(_Queued(write, loop=loop, afuture=afuture))
        return await afuture

    def _enqueue(self, queued: _Queued) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the attempt store is closed")
            self._queue.append(queued)
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Commit what is queued, then stop the writers (closing their connections)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ writer threads

    def _write_loop(self) -> None:
        with self._cond:
            self.wrappers.append(connections[DEFAULT_DB_ALIAS])
        try:
            while True:
                with self._cond:
                    while not (batch := self._take(spare=self._writing > 0)):
                        if self._closed and not self._queue:
                            return  # closed, and nothing left to write
                        self._cond.wait()
                    self._writing += 1
                try:
                    wanted = [q for q in batch if q.wanted()]
                    if wanted:
                        _deliver(self._write(wanted))
                finally:
                    with self._cond:
                        self._writing -= 1
                        self._busy.difference_update(q.write.ref.run_id for q in batch)
                        self._cond.notify_all()
        finally:
            connection.close()

    def _take(self, spare: bool = False) -> list[_Queued]:
        """The next batch, under the lock: queued writes in order, up to `max_batch`, but
        none of a run another writer is writing (nor any after one left behind), so one
        attempt's writes commit in the order they were submitted, and no two writers
        wait on each other's row locks.

        A `spare` writer (another one has a batch in hand) takes one only when a full batch
        waits: the writes queued meanwhile go together once the batch in flight commits
        (fewer, bigger transactions, and fewer threads wanting the GIL and the CPU), and
        a burst still gets every writer."""
        if spare and len(self._queue) < self._max_batch:
            return []
        taken: list[_Queued] = []
        rest: list[_Queued] = []
        held = set(self._busy)
        for queued in self._queue:
            run_id = queued.write.ref.run_id
            if run_id in held or len(taken) >= self._max_batch:
                held.add(run_id)
                rest.append(queued)
            else:
                taken.append(queued)
        if taken:
            self._queue = rest
            self._busy.update(q.write.ref.run_id for q in taken)
        return taken

    def _write(self, batch: list[_Queued]) -> list[Outcome]:
        try:
            results = self._commit([q.write for q in batch])
        except Exception as exc:
            if len(batch) == 1 or self._broken():
                return [(q, exc) for q in batch]
            logger.debug("a batch of %d writes failed (%s); writing each alone", len(batch), exc)
            with self._cond:
                self.alone += len(batch)
            return [outcome for q in batch for outcome in self._write([q])]
        return list(zip(batch, results, strict=True))

    def _commit(self, writes: list[Write]) -> list[Result]:
        """One transaction, retried whole on a lock conflict or a broken connection."""
        locks = reconnects = 0
        while True:
            opened = None
            try:
                connection.ensure_connection()
                opened = connection.connection
                plan_by_index()  # once per server connection
                if batched.stands_alone(writes):
                    results = self._apply(writes)  # a statement of its own (see apply_writes)
                else:
                    with transaction.atomic():
                        results = self._apply(writes)
            except DatabaseError as exc:
                if is_transient_lock_error(exc) and locks < self._lock_retries - 1:
                    locks += 1
                    time.sleep(min(0.5, 0.005 * 2**locks) * (0.5 + random.random()))
                    continue
                broken = self._broken(opened)
                if broken and reconnects < self._reconnects:
                    reconnects += 1
                    logger.warning("an attempt store writer lost its connection (%s); "
                                   "reconnecting (%d)", exc, reconnects)
                    connection.close()
                    time.sleep(0.05 * 2**reconnects)
                    continue
                if broken:
                    connection.close()  # the next batch opens a new one
                if broken or is_transient_lock_error(exc):
                    raise StoreUnreachable(str(exc)) from exc
                raise
            with self._cond:
                self.batches += 1
                self.writes += len(writes)
            return results

    @staticmethod
    def _broken(opened: object = None) -> bool:
        """Whether the connection a batch ran on is gone (asked after an error only):
        Django drops or replaces one whose rollback failed; one a server restart cut
        fails `SELECT 1`."""
        current = connection.connection
        return current is None or (opened is not None and current is not opened) or \
            not connection_answers()


def _apply_writes(writes: Sequence[Write]) -> list[Result]:
    """`batched.apply_writes`, looked up per batch (a test may wrap it to fail on cue)."""
    return batched.apply_writes(writes)


def _deliver(outcomes: list[Outcome]) -> None:
    """Answer a batch's callers: threads each, each event loop once for all its own."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}
    for queued, outcome in outcomes:
        if queued.future is not None:
            if isinstance(outcome, BaseException):
                queued.future.set_exception(outcome)
            else:
                queued.future.set_result(outcome)
        elif queued.loop is not None:
            by_loop.setdefault(queued.loop, []).append((queued, outcome))
    for loop, mine in by_loop.items():
        try:
            loop.call_soon_threadsafe(_answer, mine)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            logger.debug("%d writes committed for a closed event loop", len(mine))


def _answer(outcomes: list[Outcome]) -> None:
    """On the caller's loop: resolve the futures still awaited (not cancelled meanwhile)."""
    for queued, outcome in outcomes:
        afuture = queued.afuture
        if afuture is None or afuture.done():
            continue
        if isinstance(outcome, BaseException):
            afuture.set_exception(outcome)
        else:
            afuture.set_result(outcome)
