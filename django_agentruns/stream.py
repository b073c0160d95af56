"""A run's events, live: server-sent events polled from the database.

`GET <prefix>runs/<id>/events/` answers `text/event-stream`. It sends every event of the
run after the client's position, then each new one as it is appended, then an `end`
event once the run is terminal, and closes. Each event's SSE `id` is its `seq`, so a
browser that reconnects (its EventSource does so by itself) sends `Last-Event-ID` and
resumes where it was; `?after=<seq>` sets the first position. Needs `view_agentrun`.

It polls (every `POLL_INTERVAL` s: two indexed reads) rather than listening, so it works
the same on SQLite and PostgreSQL and under any server. Each open stream holds a server
thread (WSGI) and a database connection while it lasts, so its life is bounded by
`MAX_LIFE`; then it ends without `end`, and the browser reconnects and resumes. Comments
(`HEARTBEAT`) keep idle proxies from cutting it. Under ASGI the same polls run through
`sync_to_async`, so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

from asgiref.sync import sync_to_async
from django.core.exceptions import PermissionDenied
from django.core.handlers.asgi import ASGIRequest
from django.core.serializers.json import DjangoJSONEncoder
from django.http import Http404, HttpRequest, HttpResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.http import require_GET

from .models import AgentRun, RunEvent
from .states import TERMINAL

POLL_INTERVAL = 0.2
"""Seconds between two reads of the run while nothing new was found."""
HEARTBEAT = 15.0
"""Seconds of silence after which a comment line is sent."""
MAX_LIFE = 600.0
"""Seconds one response streams at most; the browser then reconnects with Last-Event-ID."""
BATCH = 200
"""Most events one read sends; a longer backlog is read again at once, not after a poll."""
RETRY_MS = 1000
"""The reconnection delay the browser is told to use."""

VIEW_PERMISSION = "django_agentruns.view_agentrun"

MORE, WAIT, DONE = "more", "wait", "done"


class EventStream:
    """The polling loop of one response, iterable in sync (WSGI) or async (ASGI) code."""

    def __init__(
        self, run_id: int, after: int = 0, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.run_id = run_id
        self.after = after
        self._clock = clock
        self._started = clock()
        self._last_sent: float | None = None

    def poll(self) -> tuple[str, str]:
        """One read: the text to send (may be empty) and whether there is more, or to wait,
        or the stream is done."""
        now = self._clock()
        chunks = []
        if self._last_sent is None:
            chunks.append(f"retry: {RETRY_MS}\n\n")
        # Status first, then events: the transaction that makes a run terminal appends its
        # last event too, so once the status reads terminal every event is visible.
        run = AgentRun.objects.filter(pk=self.run_id).values("status", "reason").first()
        rows = list(RunEvent.objects.filter(run_id=self.run_id, seq__gt=self.after)
                    .order_by("seq").values("seq", "type", "payload", "attempt",
                                            "created_at")[:BATCH])
        for row in rows:
            chunks.append(_message(row))
            self.after = row["seq"]
        state = WAIT
        if len(rows) == BATCH:
            state = MORE
        elif run is None or run["status"] in TERMINAL:
            end = {"status": None, "reason": None} if run is None else run
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

    def __iter__(self) -> Iterator[str]:
        while True:
            text, state = self.poll()
            if text:
                yield text
            if state == DONE:
                return
            if state == WAIT:
                time.sleep(POLL_INTERVAL)

    async def __aiter__(self) -> AsyncIterator[str]:
        poll = sync_to_async(self.poll)
        while True:
            text, state = await poll()
            if text:
                yield text
            if state == DONE:
                return
            if state == WAIT:
                await asyncio.sleep(POLL_INTERVAL)


def _message(row: Mapping[str, Any]) -> str:
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
    if not request.user.has_perm(VIEW_PERMISSION):
        raise PermissionDenied
    after = _position(request)
    if after is None:
        return HttpResponse("Last-Event-ID and ?after= must be a sequence number >= 0.\n",
                            status=400, content_type="text/plain")
    if not AgentRun.objects.filter(pk=run_id).exists():
        raise Http404(f"No run with id {run_id}")
    stream = EventStream(run_id, after)
    # A sync iterator under ASGI would be read to its end before anything is sent.
    content = stream.__aiter__() if isinstance(request, ASGIRequest) else iter(stream)
    response = StreamingHttpResponse(content, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    return response
