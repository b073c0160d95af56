"""A run's events, live: server-sent events, fanned out to every stream by one poller.

`GET <prefix>runs/<id>/events/` answers `text/event-stream`. It sends every event of the
run after the client's position, then each new one as it is appended, then an `end`
event once the run is terminal, and closes. In between, live chunks the agent streams
(`ctx.stream`) arrive as `event: chunk` messages (`channel`, `text`, `attempt`, `first`,
`end`), with no `id`; the stored `stream` event that later coalesces them covers the
chunks whose `end` is at most its own, so a client drops those if it still holds them.
Each event's SSE `id` is its `seq`, so a browser that reconnects (its EventSource does so
by itself) sends `Last-Event-ID` and resumes where it was; `?after=<seq>` sets the first
position. Who may watch: streaming/access.py (`view_agentrun`, an object permission,
`STREAM_ACCESS`, or a signed link from `stream_url`).

A stream first catches up on its own (the request's connection, a batch at a time), then
gives that connection back and waits on the process's `hub` (django_agentruns.fanout):
one thread polls every `POLL_INTERVAL` s for all open streams in one read, so a web
process holds one connection for its streams however many are open. It works the same on
SQLite and PostgreSQL and under any server; under ASGI the catch-up reads run through
`sync_to_async`, and waiting is an asyncio event.

Under WSGI an open stream still holds a server thread, so streams are capped per user and
per process (`STREAMS_PER_USER`, `STREAMS_PER_PROCESS`); past a cap the answer is 429 with
`Retry-After`. A response lasts at most `MAX_LIFE`, then ends without `end` and the
browser reconnects and resumes. A comment every `HEARTBEAT` s of silence keeps idle
proxies from cutting it, and is how a WSGI server learns that a client left (a write
fails): the stream then unsubscribes and gives its slot back. A client too slow to read
what the hub hands it gets `event: resync` (`{"after": seq}`), then the stored events
again from its position: the process never buffers without bound for it (fanout).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import operator
import threading
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Generator, Hashable, Iterator, Mapping
from functools import reduce
from typing import Any

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection
from django.db.models import F, Q, Window
from django.db.models.functions import RowNumber
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.http import require_GET

from ..conf import app_settings
from ..models import AgentRun, RunEvent
from ..queries import reading
from ..states import TERMINAL
from . import access
from .hub import Found, Hub, Row
from .transport import read_chunks

POLL_INTERVAL = 0.2
"""Seconds between two reads of the hub while nothing new was found."""
HEARTBEAT = 1.0
"""Seconds of silence after which a comment line is sent. Short: under WSGI a failed write
is the only sign that a client left, so a closed stream is let go within two of these."""
MAX_LIFE = 600.0
"""Seconds one response streams at most; the browser then reconnects with Last-Event-ID."""
BATCH = 200
"""Most events one read sends per run; a longer backlog is read again at once."""
RETRY_MS = 1000
"""The reconnection delay the browser is told to use."""
RETRY_AFTER = 10
"""Seconds a client refused for too many open streams is told to wait (`Retry-After`)."""

MORE, WAIT, DONE = "more", "wait", "done"


def read_runs(positions: Mapping[int, int]) -> dict[int, Found]:
    """The runs' status, then their events past each position (at most BATCH a run):
    two statements for any number of runs."""
    # Status first, then events: the transaction that makes a run terminal appends its
    # last event too, so once the status reads terminal every event is visible.
    attempts: dict[int, int] = {}
    runs: dict[int, Row] = {}
    for pk, status, reason, attempt in AgentRun.objects.for_reading().filter(
            pk__in=list(positions)).values_list("id", "status", "reason", "attempt"):
        runs[pk], attempts[pk] = {"status": status, "reason": reason}, attempt
    wanted = reduce(operator.or_, (Q(run_id=run_id, seq__gt=after)
                                   for run_id, after in positions.items()))
    events = reading(RunEvent.objects.filter(wanted))
    if len(positions) > 1:  # a batch per run: one long backlog cannot starve the others
        events = events.annotate(rank=Window(RowNumber(), partition_by=F("run_id"),
                                             order_by=F("seq").asc())).filter(rank__lte=BATCH)
    rows = events.order_by("run_id", "seq").values_list(
        "run_id", "seq", "type", "payload", "attempt", "created_at")
    found = {run_id: Found(runs.get(run_id), attempt=attempts.get(run_id))
             for run_id in positions}
    for run_id, seq, kind, payload, attempt, at in \
            rows if len(positions) > 1 else rows[:BATCH]:
        found[run_id].rows.append({"seq": seq, "type": kind, "payload": payload,
                                   "attempt": attempt, "created_at": at})
    for each in found.values():
        each.full = len(each.rows) >= BATCH
        each.finished = each.run is None or each.run["status"] in TERMINAL
    return found


hub = Hub(read_runs, POLL_INTERVAL, read_chunks=read_chunks, listen=True)
"""This process's poller: every waiting stream is a subscription of it."""


class Caps:
    """This process's open streams, per user and in all, within STREAMS_PER_USER and
    STREAMS_PER_PROCESS. The view takes a slot; the response gives it back when it closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: Counter[Hashable] = Counter()

    @property
    def open(self) -> int:
        return sum(self._users.values())

    def of(self, user: Hashable) -> int:
        return self._users[user]

    def take(self, user: Hashable) -> Callable[[], None] | str:
        """A slot's release function (idempotent), or why there is none."""
        with self._lock:
            if self._users[user] >= app_settings.STREAMS_PER_USER:
                return f"this user has {self._users[user]} event streams open " \
                       f"(STREAMS_PER_USER)"
            if self.open >= app_settings.STREAMS_PER_PROCESS:
                return f"this server process has {self.open} event streams open " \
                       f"(STREAMS_PER_PROCESS)"
            self._users[user] += 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if not released.is_set():
                    released.set()
                    self._users[user] -= 1
                    if not self._users[user]:
                        del self._users[user]
        return release


caps = Caps()


class EventStream:
    """The messages of one response, iterable in sync (WSGI) or async (ASGI) code."""

    def __init__(self, run_id: int, after: int = 0, *,
                 clock: Callable[[], float] = time.monotonic, fanout: Hub | None = None) -> None:
        self.run_id = run_id
        self.after = after
        self._clock = clock
        self._hub = fanout if fanout is not None else hub  # an empty Hub is falsy (len 0)
        self._started = clock()
        self._last_sent: float | None = None

    def poll(self) -> tuple[str, str]:
        """One read in this thread: the text to send (may be empty) and whether there is
        more, or to wait, or the stream is done."""
        return self.compose(read_runs({self.run_id: self.after})[self.run_id])

    def compose(self, found: Found | None) -> tuple[str, str]:
        """The text and state for what a read found (None: nothing new since the last)."""
        now = self._clock()
        chunks = []
        if self._last_sent is None:
            chunks.append(f"retry: {RETRY_MS}\n\n")
        if found and found.resync:
            # This client fell behind and the hub dropped what it held: the stored events
            # follow again from its position; live chunks in between are lost.
            chunks.append(f"event: resync\ndata: {json.dumps({'after': self.after})}\n\n")
        for row in found.rows if found else ():
            chunks.append(_message(row))
            self.after = row["seq"]
        for chunk in found.chunks if found else ():
            chunks.append(f"event: chunk\ndata: {json.dumps(chunk, separators=(',', ':'))}\n\n")
        state = WAIT
        if found and found.full:
            state = MORE
        elif found and found.finished:
            end = {"status": None, "reason": None} if found.run is None else found.run
            chunks.append(f"event: end\ndata: {json.dumps(end)}\n\n")
            state = DONE
        elif now - self._started >= MAX_LIFE:
            state = DONE  # no `end`: the client reconnects and resumes from Last-Event-ID
        elif not chunks and self._last_sent is not None and \
                now - self._last_sent >= HEARTBEAT:
            chunks.append(": keep-alive\n\n")
        if chunks:
            self._last_sent = now
        return "".join(chunks), state

    def _until_due(self) -> float:
        """Seconds until a heartbeat or the end of the stream's life is due."""
        last = self._started if self._last_sent is None else self._last_sent
        due = min(last + HEARTBEAT, self._started + MAX_LIFE)
        return max(0.0, due - self._clock())

    def __iter__(self) -> Generator[str]:
        sub = None
        try:
            while True:
                text, state = self.poll()
                if text:
                    yield text
                if state == DONE:
                    return
                if state == WAIT:
                    break
            _release_connection()
            ready = threading.Event()
            sub = self._hub.subscribe(self.run_id, self.after, ready.set)
            while True:
                ready.wait(self._until_due())
                ready.clear()  # before take(): a wake-up after it is not lost
                text, state = self.compose(sub.take())
                if text:
                    yield text  # a client that left makes this raise, or close us
                if state == DONE:
                    return
        finally:  # the end, a closed response (GeneratorExit) or a failed write
            if sub is not None:
                self._hub.unsubscribe(sub)

    async def __aiter__(self) -> AsyncIterator[str]:
        sub = None
        try:
            poll = sync_to_async(self.poll)
            while True:
                text, state = await poll()
                if text:
                    yield text
                if state == DONE:
                    return
                if state == WAIT:
                    break
            await sync_to_async(_release_connection)()
            loop = asyncio.get_running_loop()
            ready = asyncio.Event()

            def wake() -> None:  # called from the poller's thread
                loop.call_soon_threadsafe(ready.set)

            sub = self._hub.subscribe(self.run_id, self.after, wake)
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ready.wait(), self._until_due())
                ready.clear()
                text, state = self.compose(sub.take())
                if text:
                    yield text
                if state == DONE:
                    return
        finally:  # also when the server cancels us because the client left
            if sub is not None:
                self._hub.unsubscribe(sub)


class _Body:
    """A response's content that gives its slot back when the response is closed, whether
    or not it was ever read (the server closes every response)."""

    def __init__(self, stream: EventStream, release: Callable[[], None]) -> None:
        self._stream = stream
        self._release = release
        self._iterator: Generator[str] | None = None

    def close(self) -> None:
        if self._iterator is not None:
            self._iterator.close()
        self._release()


class _SyncBody(_Body):
    def __iter__(self) -> Iterator[str]:
        self._iterator = self._stream.__iter__()
        return self._iterator


class _AsyncBody(_Body):
    """No `__iter__`: Django then streams it as async. The server cancels it when the
    client leaves; `close()` gives the slot back."""

    def __aiter__(self) -> AsyncIterator[str]:
        return self._stream.__aiter__()


def _release_connection() -> None:
    """Give back this thread's connection before waiting, as nothing reads on it until the
    response ends (a pool takes it back). Inside a transaction (a test's) it stays."""
    if not connection.in_atomic_block:
        connection.close()


def _message(row: Row) -> str:
    data = json.dumps({"seq": row["seq"], "type": row["type"], "payload": row["payload"],
                       "attempt": row["attempt"], "at": row["created_at"]},
                      cls=DjangoJSONEncoder, separators=(",", ":"))
    # json.dumps escapes newlines inside strings, so the data is one line, as SSE needs.
    return f"id: {row['seq']}\ndata: {data}\n\n"


def _position(request: HttpRequest) -> int | None:
    """Where the client is: Last-Event-ID (a reconnect) wins over ?after=; None if bad."""
    raw = request.headers.get("Last-Event-ID") or request.GET.get("after") or "0"
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


@require_GET
def run_events(request: HttpRequest, run_id: int) -> HttpResponseBase:
    """The run's event stream (see the module docstring)."""
    refused = access.refusal(request, run_id)  # 403 alike for a missing run
    if refused is not None:
        return refused
    after = _position(request)
    if after is None:
        return HttpResponse("Last-Event-ID and ?after= must be a sequence number >= 0.\n",
                            status=400, content_type="text/plain")
    # Anonymous holders of signed links are counted per run, not as one user.
    user = request.user.pk if request.user.pk is not None else ("run", run_id)
    release = caps.take(user)
    if isinstance(release, str):
        refused = HttpResponse(f"Too many event streams: {release}. Close one, or retry "
                               f"after {RETRY_AFTER} s.\n", status=429,
                               content_type="text/plain")
        refused["Retry-After"] = str(RETRY_AFTER)
        return refused
    stream = EventStream(run_id, after)
    # A sync iterator under ASGI would be read to its end before anything is sent.
    body: Any = _AsyncBody(stream, release) if isinstance(request, ASGIRequest) \
        else _SyncBody(stream, release)
    # Servers close every response; one dropped unclosed (a test, a broken middleware)
    # gives its slot back when collected, rather than never.
    weakref.finalize(body, release)
    response = StreamingHttpResponse(body, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    return response
