"""One poller per process for every open event stream: subscribe, get woken, unsubscribe.

Each open stream used to poll the database on its own connection, so N streams held N
connections for minutes. Now a stream registers a `Subscription` (its run and position)
with the process's `Hub`; one background thread reads, every interval, the new events of
all watched runs in one read (`read` below: two statements whatever the number of
streams) on the one connection it holds while any stream is open, and hands each
subscription the rows past its own position. A stream waits on its subscription, holding
no connection; closing it unsubscribes at once.

Live chunks (`ctx.stream`) reach the same subscriptions: on PostgreSQL from the process's
one LISTEN connection (chunk_transport.Listener, LISTENing on the channel of each watched
run only), on SQLite from a third statement of the poller's read. A chunk of an attempt
older than the run's current one (a fenced, stale worker's) is dropped here.

A subscription that is not taken from (a slow client: its socket is full, its thread
blocked in a write) holds at most PENDING_ITEMS rows and chunks and PENDING_CHARS
characters of chunk text. Past that it is parked: what it held is dropped, the hub hands
it nothing more, and its next `take` says `resync`; from there it is served the stored
events again from the last one it took (live chunks meanwhile are lost; the stored
`stream` events hold their text). So a web process's memory does not grow with a client
that does not read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import connection

from .transport import Listener

logger = logging.getLogger("django_agentruns.stream")

PENDING_ITEMS = 1000
"""Most rows and chunks a subscription holds untaken before it is parked for a resync."""
PENDING_CHARS = 1_000_000
"""Most characters of chunk text a subscription holds untaken before it is parked."""

Row = dict[str, Any]
"""One event as the stream sends it: `seq`, `type`, `payload`, `attempt`, `created_at`."""


@dataclass
class Found:
    """What one read found for one run past a position."""

    run: Row | None
    """The run's `status` and `reason`; None if it no longer exists."""
    rows: list[Row] = field(default_factory=list)
    """Its events past the position, in order, at most one batch."""
    full: bool = False
    """The batch was full: there may be more, read again at once."""
    finished: bool = False
    """The run is terminal (or gone): once `rows` are sent, nothing more will come."""
    chunks: list[Row] = field(default_factory=list)
    """Live chunks that came in, in order (`channel`, `text`, `attempt`, `first`, `end`)."""
    attempt: int | None = None
    """The run's current attempt, as read."""
    resync: bool = False
    """The subscription fell too far behind and what it held was dropped: the rows that
    follow start again after the last one taken; live chunks in between are lost."""


Read = Callable[[Mapping[int, int]], dict[int, Found]]
"""`{run_id: after}` -> `{run_id: Found}`: one read for many runs (status first, then events)."""
ReadChunks = Callable[[Mapping[int, int]], dict[int, tuple[int, list[Row]]]]
"""`{run_id: after}` -> `{run_id: (new position, chunks)}`: stored live chunks (SQLite)."""


class Subscription:
    """One stream's place in the hub. The hub appends to it; the stream takes from it."""

    def __init__(self, run_id: int, after: int, wake: Callable[[], None]) -> None:
        self.run_id = run_id
        self.after = after  # the hub's position for it: the last seq handed over
        self._taken = after  # the last seq the stream took
        self._wake = wake
        self._pending: Found | None = None
        self._chars = 0  # characters of chunk text pending
        self.parked = False
        """Fell behind past the bound: the hub hands it nothing until it takes again."""

    def take(self) -> Found | None:
        """What the hub found since the last take (rows merged), or None if nothing; after
        a park, a `resync` Found (and the rows come again from the last one taken)."""
        with _lock:
            if self.parked:
                self.parked = False
                return Found(None, resync=True)
            found, self._pending, self._chars = self._pending, None, 0
            if found is not None and found.rows:
                self._taken = found.rows[-1]["seq"]
        return found

    def _offer(self, found: Found) -> None:
        """Under the hub's lock: merge with what the stream has not taken yet."""
        if self._pending is None:
            self._pending = Found(found.run, list(found.rows), found.full, found.finished,
                                  list(found.chunks))
        else:
            self._pending.rows.extend(found.rows)
            self._pending.chunks.extend(found.chunks)
            self._pending.run, self._pending.full = found.run, found.full
            self._pending.finished = found.finished
        self._bound(found.chunks)

    def _offer_chunks(self, chunks: list[Row]) -> None:
        """Under the hub's lock: chunks alone, leaving what a read found as it is."""
        if self._pending is None:
            self._pending = Found(None, chunks=list(chunks))
        else:
            self._pending.chunks.extend(chunks)
        self._bound(chunks)

    def _bound(self, chunks: list[Row]) -> None:
        """Under the hub's lock: park the subscription once it holds too much."""
        self._chars += sum(len(c.get("text", "")) for c in chunks)
        pending = self._pending
        if pending is None or (len(pending.rows) + len(pending.chunks) <= PENDING_ITEMS
                               and self._chars <= PENDING_CHARS):
            return
        logger.warning("an event stream of run %s fell behind (%s rows and chunks "
                       "untaken); it resyncs from the stored events", self.run_id,
                       len(pending.rows) + len(pending.chunks))
        self._pending, self._chars, self.parked = None, 0, True
        self.after = self._taken


# One lock for the registry and every subscription's pending rows: both are touched a
# few times per poll interval, never while the database is read.
_lock = threading.Lock()


class Hub:
    """The registry of subscriptions and the thread that polls for them."""

    def __init__(self, read: Read, interval: float, *, name: str = "agentruns-streams",
                 background: bool = True, read_chunks: ReadChunks | None = None,
                 listen: bool = False) -> None:
        self._read = read
        self._read_chunks = read_chunks
        self._chunk_positions: dict[int, int] = {}  # SQLite: last chunk row read, per run
        self.listener: Listener | None = Listener(self.watched, self.deliver_chunks) \
            if listen else None
        self.interval = interval
        self._background = background  # False: no thread, the caller calls poll_once()
        self._name = name
        self._subs: dict[int, list[Subscription]] = {}
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.connected = False
        """Whether the poller holds its database connection (only while streams are open)."""

    def __len__(self) -> int:
        with _lock:
            return sum(len(subs) for subs in self._subs.values())

    def subscribe(self, run_id: int, after: int, wake: Callable[[], None]) -> Subscription:
        """Watch `run_id` past `after`; `wake()` is called (from the poller) when the
        subscription has something to take."""
        sub = Subscription(run_id, after, wake)
        with _lock:
            self._subs.setdefault(run_id, []).append(sub)
            self._ensure_thread()
        self._wakeup.set()  # a new stream is served now, not an interval later
        if self.listener is not None:
            self.listener.changed.set()
        return sub

    def watched(self) -> set[int]:
        """The runs some subscription watches (the listener LISTENs to these)."""
        with _lock:
            return set(self._subs)

    def deliver_chunks(self, run_id: int, chunks: list[Row]) -> None:
        """Hand live chunks to every subscription of the run. An earlier attempt's are
        handed on too: the sender fenced each on the attempt holding the run when it was
        sent (a stale worker's never went out), and one sent just before a wait or a retry
        may arrive after the next attempt started."""
        wakes = []
        with _lock:
            for sub in self._subs.get(run_id, ()) if chunks else ():
                if sub.parked:
                    continue
                sub._offer_chunks(chunks)
                wakes.append(sub._wake)
        _wake_all(wakes)

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop watching; idempotent. The last one out lets the poller drop its connection."""
        with _lock:
            self._remove(sub)
            empty = not self._subs
        if empty:
            self._wakeup.set()
        if self.listener is not None:
            self.listener.changed.set()

    def _remove(self, sub: Subscription) -> None:
        """Under the lock."""
        subs = self._subs.get(sub.run_id, [])
        if sub in subs:
            subs.remove(sub)
            if not subs:
                del self._subs[sub.run_id]
                self._chunk_positions.pop(sub.run_id, None)

    def poll_once(self) -> bool:
        """One read for every watched run, handed out; True if a batch was full (read
        again at once). Runs in the poller thread, or in a test's."""
        with _lock:
            # Only subscriptions at or past the position read get this read's rows; one
            # that joined behind it (a resume from earlier) is served by the next read.
            # A parked subscription is left out until it takes again.
            positions = {run_id: min(s.after for s in subs if not s.parked)
                         for run_id, subs in self._subs.items()
                         if any(not s.parked for s in subs)}
        if not positions:
            return False
        found = self._read(positions)
        chunks = self._chunks_past(positions)
        wakes = []
        with _lock:
            for run_id, after in positions.items():
                run_found = found.get(run_id) or Found(None, finished=True)
                live = chunks.get(run_id, [])
                for sub in list(self._subs.get(run_id, ())):
                    if sub.parked:
                        continue
                    eligible = sub.after >= after  # one behind is served by the next read
                    rows = [row for row in run_found.rows if row["seq"] > sub.after] \
                        if eligible else []
                    done = eligible and run_found.finished and not run_found.full
                    if not rows and not done and not live:
                        continue
                    if rows:
                        sub.after = rows[-1]["seq"]
                    if eligible:
                        sub._offer(Found(run_found.run, rows, run_found.full, done, live))
                    else:
                        sub._offer_chunks(live)
                    if done:  # nothing more will come: it leaves the registry now
                        self._remove(sub)
                    wakes.append(sub._wake)
        _wake_all(wakes)
        return any(f.full for f in found.values())

    def _chunks_past(self, positions: Mapping[int, int]) -> dict[int, list[Row]]:
        """Read the stored chunks past each run's position (SQLite), in the order they were
        written; an earlier attempt's too (fenced when written, like `deliver_chunks`')."""
        with _lock:
            chunk_positions = {run_id: self._chunk_positions.get(run_id, 0)
                               for run_id in positions}
        if self._read_chunks is None:
            return {}
        out = {}
        read = self._read_chunks(chunk_positions)
        with _lock:
            for run_id, (position, rows) in read.items():
                if run_id in self._subs:
                    self._chunk_positions[run_id] = position
                out[run_id] = list(rows)
        return out

    def _ensure_thread(self) -> None:
        """Under the lock: start the poller on first use (and again in a forked child,
        which inherits the object but not the thread)."""
        if self.listener is not None and self._background and \
                connection.vendor == "postgresql":
            self.listener.ensure_running()
        if not self._background or (self._thread is not None and self._thread.is_alive()
                                     and self._pid == os.getpid()):
            return
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while True:
            with _lock:
                idle = not self._subs
            if idle:
                self._disconnect()
                self._wakeup.wait()  # no stream open: no connection, no reads
                self._wakeup.clear()
                continue
            self._wakeup.clear()
            self.connected = True  # from before the read, which may connect
            try:
                more = self.poll_once()
                failures = 0
            except Exception:  # the database is away: streams keep their heartbeats
                failures += 1
                logger.warning("event stream poll failed (%s in a row)", failures,
                               exc_info=failures == 1)
                self._disconnect()
                more = False
            if not more:
                self._wakeup.wait(self.interval * min(2 ** failures, 50))

    def _disconnect(self) -> None:
        """Close this thread's connection (a pool takes it back)."""
        try:
            connection.close()
        except Exception:  # already broken: nothing left to give back
            logger.debug("closing the stream poller's connection failed", exc_info=True)
        self.connected = False


def _wake_all(wakes: list[Callable[[], None]]) -> None:
    for wake in wakes:
        # RuntimeError: an async stream's event loop is gone; it unsubscribes itself.
        with contextlib.suppress(RuntimeError):
            wake()
