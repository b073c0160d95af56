"""Successful outcomes of one worker's attempts, written together when they finish together.

Group commit, as databases do it for their log: the attempt thread that finds no write in
flight writes at once (alone, no wait); threads that finish while it writes queue up,
and the first of them then writes them all in one transaction. No timer and no thread of
its own: a lone success costs what it did before, a burst of them one transaction.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .outcomes import AttemptRef, Settlement

WriteMany = Callable[[Sequence[tuple[AttemptRef, Any]]], dict[AttemptRef, Settlement]]


@dataclass
class _Waiter:
    ref: AttemptRef
    output: Any
    wake: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # this thread writes the next batch
    finished: bool = False
    result: Settlement | None = None
    error: BaseException | None = None


class GroupCommit:
    def __init__(self, write_many: WriteMany, max_batch: int = 256) -> None:
        self._write_many = write_many
        self._max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[_Waiter] = []
        self._writing = False
        self.batches = 0  # transactions written, for tests and the benchmark
        self.settled = 0

    @property
    def waiting(self) -> int:
        """Successes queued behind the write in flight."""
        with self._lock:
            return len(self._queue)

    def settle(self, ref: AttemptRef, output: Any) -> Settlement:
        """Record `ref` succeeded with `output`; returns once it is committed (or lost).

        A database error reaches every attempt of the failed batch, each of which retries
        on its own (the writes are fenced, so a retry never writes twice).
        """
        me = _Waiter(ref, output)
        with self._lock:
            self._queue.append(me)
            if not self._writing:
                self._writing = me.lead = True
        while True:
            if me.lead:
                me.lead = False
                self._write_batch()
            if me.finished:
                break
            me.wake.wait()
            me.wake.clear()  # the flags are read after clearing, so no wake-up is lost
        if me.error is not None:
            raise me.error
        assert me.result is not None
        return me.result

    def _write_batch(self) -> None:
        with self._lock:
            batch, self._queue = self._queue[:self._max_batch], self._queue[self._max_batch:]
        try:
            results = self._write_many([(w.ref, w.output) for w in batch])
        except BaseException as exc:
            for w in batch:
                w.error = exc
        else:
            self.batches += 1
            self.settled += len(batch)
            for w in batch:
                w.result = results[w.ref]
        finally:
            for w in batch:
                w.finished = True
            with self._lock:
                # Hand the lead to the first waiter, so the next batch is written by a
                # thread whose own outcome is in it; or stand down when none waits.
                if self._queue:
                    self._queue[0].lead = True
                    self._queue[0].wake.set()
                else:
                    self._writing = False
            for w in batch:
                w.wake.set()
