"""`wait_for_run` / `await_run`: callers blocked until a run finishes, sharing one listener.

Each caller used to open a LISTEN connection of its own on top of its thread's connection
(15 callers: 31 connections), and `await_run` blocked a thread of the loop's default
executor for the whole wait. Now, on PostgreSQL, every waiter of a process registers with
the process's `FinishedListener`: one thread, one LISTEN connection on the channel the
finish trigger (migration 0004) NOTIFYs, plus one connection of that thread's own to read
the runs it hears of (both closed while nobody waits). It reads the run once the waiter
registers (after LISTEN: a finish in between is seen either way), again when a NOTIFY
names it, and every LISTEN_RECHECK s in case a notification was lost, and hands the
finished run to the waiter: a thread's `threading.Event`, a coroutine's future. A waiter
holds no connection and no thread while it waits.

Waiters are capped per process (`WAITERS_PER_PROCESS`): past it the call raises
`TooManyWaitersError`, naming the setting. SQLite has no NOTIFY: each caller polls with
backoff (an async caller sleeps on the loop between looks, never holding a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.db import connection

from ..conf import SETTING_NAME, app_settings
from ..db import Reconnects, is_postgres, notifications, serve_on_demand
from ..exceptions import InvalidInputError, RunNotFoundError, TooManyWaitersError
from ..models import TERMINAL, AgentRun
from ..payloads import load_values

logger = logging.getLogger("django_agentruns.waiters")

FINISHED_CHANNEL = "agentruns_finished"
"""PostgreSQL channel a trigger (migration 0004) NOTIFYs with the id of a run that finished."""
WATCH_TABLE = "agentruns_finish_watch"
"""The runs some process waits for (migration 0011): the finish trigger NOTIFYs only for
these, since every NOTIFY costs each LISTENing session of the database (every worker) a
transaction. A row per (run, listener), deleted once answered or when nobody waits."""
STALE_WATCH = "1 day"
"""Rows of a listener that died are deleted by the next one to start, after this long."""

POLL_START, POLL_MAX = 0.02, 0.5
"""SQLite: the first and the longest pause between two looks at the run."""
LISTEN_RECHECK = 5.0
"""Seconds the listener trusts its LISTEN before it reads every awaited run again."""
SLICE = 0.05
"""Seconds the listener waits for notifications before it looks for new waiters."""

Answer = Callable[[AgentRun | BaseException], None]


class _Slots:
    """This process's waiters, within WAITERS_PER_PROCESS (both engines)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.taken = 0

    def take(self) -> None:
        with self._lock:
            cap = int(app_settings.WAITERS_PER_PROCESS)
            if self.taken >= cap:
                raise TooManyWaitersError(
                    f"this process has {self.taken} callers waiting in wait_for_run / "
                    f"await_run, the most {SETTING_NAME}['WAITERS_PER_PROCESS'] ({cap}) "
                    f"allows; wait for fewer runs at once, or raise the setting")
            self.taken += 1

    def give_back(self) -> None:
        with self._lock:
            self.taken -= 1


slots = _Slots()


class FinishedListener:
    """The one LISTEN connection (and thread) of a process's waiters (PostgreSQL)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[int, list[Answer]] = {}
        self._fresh: set[int] = set()  # runs registered since the last read
        self._changed = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.connected = False

    def __len__(self) -> int:
        with self._lock:
            return sum(len(answers) for answers in self._waiters.values())

    def add(self, run_id: int, answer: Answer) -> None:
        """`answer(run)` once the run is finished (or `answer(error)`), from the thread."""
        with self._lock:
            self._waiters.setdefault(run_id, []).append(answer)
            self._fresh.add(run_id)
            if self._thread is None or not self._thread.is_alive() \
                    or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="agentruns-waiters")
                self._thread.start()
        self._changed.set()

    def discard(self, run_id: int, answer: Answer) -> None:
        """A waiter that gave up (timed out, cancelled); idempotent."""
        with self._lock:
            answers = self._waiters.get(run_id, [])
            if answer in answers:
                answers.remove(answer)
                if not answers:
                    del self._waiters[run_id]
        self._changed.set()

    def _run(self) -> None:
        # While the database is away, waiters keep waiting, or time out.
        serve_on_demand(self._wanted, self._changed, self._serve,
                        Reconnects(logger, "the waiters' LISTEN connection", 0.1, 5.0),
                        after=self._disconnected)

    def _wanted(self) -> bool:
        with self._lock:
            return bool(self._waiters)

    def _disconnected(self) -> None:
        self.connected = False
        connection.close()

    def _serve(self) -> None:
        """LISTEN, then read the awaited runs as they register or are heard of, until
        nobody waits."""
        from ..db import listen_alias, listening

        watcher = uuid.uuid4().hex
        with listening(listen_alias(), FINISHED_CHANNEL) as conn:
            conn.execute(f"DELETE FROM {WATCH_TABLE} WHERE created_at < now() - interval "
                         f"'{STALE_WATCH}'")
            self.connected = True
            with self._lock:
                self._fresh = set(self._waiters)  # all are read after LISTEN
            heard: set[int] = set()
            recheck_at = time.monotonic() + LISTEN_RECHECK
            try:
                while True:
                    self._changed.clear()
                    with self._lock:
                        if not self._waiters:
                            return
                        fresh, self._fresh = self._fresh, set()
                        due = fresh | (heard & set(self._waiters))
                        if time.monotonic() >= recheck_at:
                            due = set(self._waiters)
                            recheck_at = time.monotonic() + LISTEN_RECHECK
                    if fresh:  # watched before they are read: a finish after is heard
                        conn.execute(f"INSERT INTO {WATCH_TABLE} (run_id, watcher) SELECT "
                                     "unnest(%s::bigint[]), %s ON CONFLICT DO NOTHING",
                                     [sorted(fresh), watcher])
                    answered = self._answer(due) if due else []
                    if answered:
                        conn.execute(f"DELETE FROM {WATCH_TABLE} WHERE watcher = %s AND "
                                     "run_id = ANY(%s::bigint[])", [watcher, answered])
                    heard = set()
                    for note in notifications(conn, SLICE):
                        if note.payload.isdigit():
                            heard.add(int(note.payload))
                        if self._changed.is_set():
                            break
            finally:
                if not conn.closed:
                    with contextlib.suppress(Exception):
                        conn.execute(f"DELETE FROM {WATCH_TABLE} WHERE watcher = %s",
                                     [watcher])

    def _answer(self, run_ids: set[int]) -> list[int]:
        """One read for these runs: answer the waiters of those finished or gone (their
        ids are returned)."""
        found = {run.pk: run for run in AgentRun.objects.filter(pk__in=run_ids)}
        load_values(found.values())  # a waiter may be a coroutine: it reads nothing more
        with self._lock:
            answered = [(run_id, self._waiters.pop(run_id)) for run_id in run_ids
                        if run_id in self._waiters and (run_id not in found
                                                        or found[run_id].status in TERMINAL)]
        for run_id, answers in answered:
            run = found.get(run_id)
            for answer in answers:
                answer(copy.copy(run) if run is not None else
                       RunNotFoundError(f"No run with id {run_id!r}"))
        return [run_id for run_id, _ in answered]


listener = FinishedListener()
"""This process's listener: every PostgreSQL waiter is an entry of it."""


def wait_for_run(run_id: int, *, timeout: float | None = None) -> AgentRun:
    """Block until the run is finished and return it; `TimeoutError` past `timeout` seconds.

    PostgreSQL: the process's one listener answers as the run finishes, through
    `LISTEN_DATABASE` when set; elsewhere, polling with backoff. Past WAITERS_PER_PROCESS
    callers at once: `TooManyWaitersError`."""
    rid, deadline = _checked(run_id, timeout)
    slots.take()
    try:
        if not is_postgres():
            _poll_until_finished(rid, deadline)
            return finished_run(rid)
        done = threading.Event()
        result: list[AgentRun | BaseException] = []

        def answer(outcome: AgentRun | BaseException) -> None:
            result.append(outcome)
            done.set()

        listener.add(rid, answer)
        try:
            if not done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return _last_look(rid)
        finally:
            listener.discard(rid, answer)
        return _outcome(result[0])
    finally:
        slots.give_back()


async def await_run(run_id: int, *, timeout: float | None = None) -> AgentRun:
    """`wait_for_run` for async callers: the wait is a future on the loop, no thread."""
    rid, deadline = _checked(run_id, timeout)
    slots.take()
    try:
        if not is_postgres():
            return await _apoll_until_finished(rid, deadline)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[AgentRun | BaseException] = loop.create_future()

        def settle(outcome: AgentRun | BaseException) -> None:
            if not future.done():
                future.set_result(outcome)

        def answer(outcome: AgentRun | BaseException) -> None:  # the listener's thread
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(settle, outcome)

        listener.add(rid, answer)
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return _outcome(await asyncio.wait_for(future, left))
        except TimeoutError:
            return await sync_to_async(_last_look, thread_sensitive=False)(rid)
        finally:
            listener.discard(rid, answer)
    finally:
        slots.give_back()


def _last_look(rid: int) -> AgentRun:
    """At the deadline, one read on the caller's connection (the listener may not have
    read the run yet: `timeout=0` on a finished run returns it); then `TimeoutError`."""
    try:
        if _finished(rid):
            return finished_run(rid)
    finally:
        if not connection.in_atomic_block:
            connection.close()  # a waiting thread holds no connection
    raise TimeoutError("the run did not finish in time")


def _outcome(outcome: AgentRun | BaseException) -> AgentRun:
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def _checked(run_id: Any, timeout: Any) -> tuple[int, float | None]:
    from ..api import run_id_of

    rid = run_id_of(run_id)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or not timeout >= 0 or not math.isfinite(timeout)):
        raise InvalidInputError(f"timeout must be finite seconds >= 0 or None, "
                                f"not {timeout!r}")
    return rid, None if timeout is None else time.monotonic() + float(timeout)


def _finished(rid: int) -> bool:
    status = AgentRun.objects.filter(pk=rid).values_list("status", flat=True).first()
    if status is None:
        raise RunNotFoundError(f"No run with id {rid!r}")
    return status in TERMINAL


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the run did not finish in time")
    return left


def _poll_until_finished(rid: int, deadline: float | None) -> None:
    wait = POLL_START
    while not _finished(rid):
        left = _left(deadline)
        time.sleep(wait if left is None else min(wait, left))
        wait = min(POLL_MAX, wait * 2)


async def _apoll_until_finished(rid: int, deadline: float | None) -> AgentRun:
    """SQLite, async: each look runs in a thread for a moment; the pauses are on the loop."""
    look = sync_to_async(_finished, thread_sensitive=False)
    wait = POLL_START
    while not await look(rid):
        left = _left(deadline)
        await asyncio.sleep(wait if left is None else min(wait, left))
        wait = min(POLL_MAX, wait * 2)
    return await sync_to_async(finished_run, thread_sensitive=False)(rid)


def finished_run(rid: int) -> AgentRun:
    """The run with its input and output read (its caller may be a coroutine)."""
    run = AgentRun.objects.get(pk=rid)
    load_values([run])
    return run
