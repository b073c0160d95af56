"""Successful outcomes of one worker's attempts, written together when they finish together.

Group commit, as databases do it for their log: one writer thread takes every success
waiting and writes them in one transaction, while the next ones queue. No timer: a lone
success is written at once; a burst of them costs one transaction. And one connection:
attempts that never touch the database themselves need none of their own, so a worker at
`--concurrency 200` does not hold 200 connections to settle its runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import connection

from .outcomes import AttemptRef, Settlement

WriteMany = Callable[[Sequence[tuple[AttemptRef, Any]]], dict[AttemptRef, Settlement]]


@dataclass
class _Waiter:
    ref: AttemptRef
    output: Any
    done: threading.Event = field(default_factory=threading.Event)
    result: Settlement | None = None
    error: BaseException | None = None


class GroupCommit:
    def __init__(self, write_many: WriteMany, max_batch: int = 256,
                 on_error: Callable[[], None] | None = None) -> None:
        """`on_error` runs in the writer thread after a failed write (e.g. to drop its
        connection, which may be broken)."""
        self._write_many = write_many
        self._max_batch = max_batch
        self._on_error = on_error
        self._cond = threading.Condition()
        self._queue: list[_Waiter] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self.batches = 0  # transactions written, for tests and the benchmark
        self.settled = 0

    @property
    def waiting(self) -> int:
        """Successes queued behind the write in flight."""
        with self._cond:
            return len(self._queue)

    def settle(self, ref: AttemptRef, output: Any) -> Settlement:
        """Record `ref` succeeded with `output`; returns once it is committed (or lost).

        A batch that fails is written again one success at a time, so a database error
        reaches only the attempts whose own write fails; each of those retries on its own
        (the writes are fenced, so a retry never writes twice).
        """
        me = _Waiter(ref, output)
        with self._cond:
            if self._closed:
                raise RuntimeError("the worker's group commit is closed")
            self._queue.append(me)
            if self._thread is None:
                self._thread = threading.Thread(target=self._write_loop,
                                                name="agentruns-settle", daemon=True)
                self._thread.start()
            self._cond.notify()
        me.done.wait()
        if me.error is not None:
            raise me.error
        assert me.result is not None
        return me.result

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop the writer thread (and its connection)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _write_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closed:
                        self._cond.wait()
                    if not self._queue:
                        return  # closed, and nothing left to write
                    batch = self._queue[:self._max_batch]
                    del self._queue[:self._max_batch]
                self._write(batch)
        finally:
            connection.close()

    def _write(self, batch: list[_Waiter]) -> None:
        try:
            self._write_batch(batch)
        except BaseException as exc:
            if self._on_error is not None:
                self._on_error()
            if len(batch) == 1:
                batch[0].error = exc
            else:
                # One member's write (a value the database refuses) must not take the
                # others down with it: each is written again on its own, and only a
                # write that fails alone reports its error. Fenced, so none is written twice.
                for w in batch:
                    self._write_alone(w)
        finally:
            for w in batch:
                w.done.set()

    def _write_batch(self, batch: list[_Waiter]) -> None:
        results = self._write_many([(w.ref, w.output) for w in batch])
        self.batches += 1
        self.settled += len(batch)
        for w in batch:
            w.result = results[w.ref]

    def _write_alone(self, w: _Waiter) -> None:
        try:
            self._write_batch([w])
        except BaseException as exc:
            w.error = exc
            if self._on_error is not None:
                self._on_error()
