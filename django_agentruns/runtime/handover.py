"""Successes handed from the attempts to the claim loop, which settles them with its next
claim in one statement (`transitions.settle_and_claim`).

An attempt whose agent returned has nothing left to write but its success, and the slot
it frees is what the claim loop fills next: on PostgreSQL the two go together, one round
trip per run where they were two. Every other write (and every success once the worker
stops serving, or on SQLite) goes to the attempt store as before. A worker's attempt
does not wait for its success (`hand_off`, `runtime.late`): whoever settles it ends the
attempt, which stays live (its lease renewed, its slot taken) until then; `call` / `acall`
wait, as for the store's commit. A hand-over whose statement failed is given to the
store, which retries and reconnects. An attempt's earlier writes have all committed by
then (each is waited for).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from ..outcomes import AttemptRef, Settlement
from ..transitions import Result, SucceedWrite, Write
from .attempt_store import AttemptStore

logger = logging.getLogger("django_agentruns.worker")


@dataclass
class Handed:
    """One success and who waits for it: a thread (`future`), a coroutine (`afuture`), or
    nobody: `then` is called with the result, on the thread that has it (`hand_off`)."""

    write: SucceedWrite
    future: Future[Result] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    afuture: asyncio.Future[Result] | None = None
    then: Callable[[Result | BaseException], None] | None = None

    def answer(self, result: Result | BaseException) -> None:
        if self.then is not None:
            try:
                self.then(result)
            except Exception:  # the others taken with it must be answered all the same
                logger.exception("run %s: the end of its attempt raised", self.write.ref.run_id)
        elif self.future is not None:
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)
        elif self.loop is not None and self.afuture is not None:
            # A closed loop: nobody waits any more.
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(_answer, self.afuture, result)


def _forward(handed: Handed, future: Future[Result]) -> None:
    error = future.exception()
    handed.answer(error if error is not None else future.result())


def _answer(afuture: asyncio.Future[Result], result: Result | BaseException) -> None:
    if afuture.done():
        return
    if isinstance(result, BaseException):
        afuture.set_exception(result)
    else:
        afuture.set_result(result)


class Handover:
    """`call` / `acall` as the store's, for an attempt's last write: a success waits here
    for the claim loop (`take`, then `settle`), the rest goes to `store`.

    `open`: whether successes are handed over at all (the worker's loop on PostgreSQL);
    `close()` ends it, giving any waiting to the store (the worker stops serving)."""

    def __init__(self, store: AttemptStore, wake: threading.Event, *, open: bool) -> None:
        self.store = store
        self._wake = wake
        self._lock = threading.Lock()
        self._waiting: list[Handed] = []
        self._open = open
        self._in_flight = False  # the claim loop's statement is running

    def call(self, write: Write) -> Result:
        if isinstance(write, SucceedWrite):
            future: Future[Result] = Future()
            if self._hand(Handed(write, future=future)):
                return future.result()
        return self.store.call(write)

    async def acall(self, write: Write) -> Result:
        if isinstance(write, SucceedWrite):
            loop = asyncio.get_running_loop()
            afuture: asyncio.Future[Result] = loop.create_future()
            if self._hand(Handed(write, loop=loop, afuture=afuture)):
                return await afuture
        return await self.store.acall(write)

    def hand_off(self, write: SucceedWrite,
                 then: Callable[[Result | BaseException], None]) -> None:
        """`write` settled with nobody waiting for it: by the claim loop's next statement,
        or (while that runs, or once closed) by the store; `then` gets the result or the
        error on the thread that settled it, and must not block. An attempt whose agent
        returned need not wait for its success (one thread wake-up less per run): it
        stays live, its lease renewed, until `then` ends it. RuntimeError: the store is
        closed, nothing was queued."""
        handed = Handed(write, then=then)
        if not self._hand(handed):
            self.store.submit(write).add_done_callback(functools.partial(_forward, handed))

    def _hand(self, handed: Handed) -> bool:
        with self._lock:
            if not self._open or self._in_flight:
                return False
            self._waiting.append(handed)
        self._wake.set()
        return True

    def take(self) -> list[Handed]:
        """The successes waiting, now the claim loop's to settle (then `settled` or
        `to_store`). Until then the ones that come go to the store: its writers settle
        them while the loop's statement runs, rather than wait for the next one."""
        with self._lock:
            taken, self._waiting = self._waiting, []
            self._in_flight = True
        return taken

    @staticmethod
    def settled(taken: list[Handed], results: dict[AttemptRef, Settlement]) -> None:
        for handed in taken:
            handed.answer(results[handed.write.ref])

    def release(self) -> None:
        """The claim loop's statement is over (whatever its end): hand-overs again."""
        with self._lock:
            self._in_flight = False

    def to_store(self, taken: list[Handed]) -> None:
        """Successes whose statement failed (or was never run): the store writes them."""
        self.release()
        for handed in taken:
            try:
                future = self.store.submit(handed.write)
            except RuntimeError as exc:  # the store is closed
                handed.answer(exc)
                continue
            future.add_done_callback(functools.partial(_forward, handed))

    def close(self) -> None:
        """No more hand-overs: waiting successes, and later ones, go to the store."""
        with self._lock:
            self._open = False
            taken, self._waiting = self._waiting, []
        self.to_store(taken)
