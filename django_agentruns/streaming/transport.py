"""How live chunks travel from a worker to the web processes, on each engine.

Worker side: one `Sender` thread per process takes the chunks its attempts stream and,
every BATCH_INTERVAL, sends what came in, merged per run and channel. On PostgreSQL it
NOTIFYs `agentruns_run_<id>` on a connection of its own (opened at the first chunk,
closed after IDLE_CLOSE s without any), each payload under PAYLOAD_BYTES; on SQLite it
writes rows of `StreamChunk`, which the web poller reads and the coalescing prunes. Both
are fenced like every attempt write: a run no longer held by that attempt gets nothing.

Web side: `Listener` is the one LISTEN connection of a web process; it LISTENs on the
channel of each run the hub watches (UNLISTEN when the last stream of it leaves) and hands
what it hears to the hub. On SQLite `read_chunks` is the poller's third statement.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, close_old_connections, connection, connections
from django.db.models import Q

from ..db import Reconnects, notifications, read_alias, retry_on_lock, serve_on_demand
from ..models import AgentRun, StreamChunk
from ..outcomes import AttemptRef
from ..queries import reading

logger = logging.getLogger("django_agentruns.stream")

BATCH_INTERVAL = 0.02
"""Seconds the sender gathers chunks before sending them: one NOTIFY (or INSERT) carries
every chunk of a run that came in meanwhile."""
PAYLOAD_BYTES = 7000
"""Largest NOTIFY payload the sender builds (PostgreSQL refuses 8000 bytes or more)."""
IDLE_CLOSE = 5.0
"""Seconds without chunks after which the sender closes its connection."""
PRUNE_DELAY = 2.0
"""SQLite: seconds coalesced chunk rows are kept, so the web poller (every 0.2 s) still
reads the last ones of a run before they go."""
CHANNEL_PREFIX = "agentruns_run_"

Chunk = dict[str, Any]
"""One message: `channel`, `text`, `attempt`, and `first`/`end`, the indexes (per attempt
and channel) of the chunks it holds; the coalesced `stream` event's `end` covers them."""


def run_channel(run_id: int) -> str:
    """The NOTIFY channel of one run (ids are integers: a safe identifier)."""
    return f"{CHANNEL_PREFIX}{int(run_id)}"


@dataclass
class _Item:
    ref: AttemptRef
    channel: str
    first: int
    end: int
    text: str
    lost: Callable[[], bool]  # the attempt lost its lease: drop it unsent


def merge(items: Iterable[_Item]) -> dict[AttemptRef, list[Chunk]]:
    """Consecutive chunks of one attempt and channel as one message, in order."""
    out: dict[AttemptRef, list[Chunk]] = {}
    for item in items:
        chunks = out.setdefault(item.ref, [])
        last = chunks[-1] if chunks else None
        if last is not None and last["channel"] == item.channel and last["end"] == item.first:
            last["text"] += item.text
            last["end"] = item.end
        else:
            chunks.append({"channel": item.channel, "text": item.text,
                           "attempt": item.ref.attempt, "first": item.first, "end": item.end})
    return out


def payloads(chunks: list[Chunk], limit: int = PAYLOAD_BYTES) -> list[str]:
    """The chunks as JSON arrays of at most `limit` UTF-8 bytes each. A chunk too long for
    one is cut into pieces that keep its `first`/`end` (the coalesced event covers them
    all the same)."""
    out: list[str] = []
    batch: list[str] = []
    size = 2
    for chunk in chunks:
        for piece in _pieces(chunk, limit - 2):
            length = len(piece.encode())
            if batch and size + length + 1 > limit:
                out.append("[" + ",".join(batch) + "]")
                batch, size = [], 2
            batch.append(piece)
            size += length + 1
    if batch:
        out.append("[" + ",".join(batch) + "]")
    return out


def _pieces(chunk: Chunk, limit: int) -> list[str]:
    text = json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
    if len(text.encode()) <= limit:
        return [text]
    half = len(chunk["text"]) // 2
    return [*_pieces({**chunk, "text": chunk["text"][:half]}, limit),
            *_pieces({**chunk, "text": chunk["text"][half:]}, limit)]


class Sender:
    """The worker's chunk sender: one thread, one connection (PostgreSQL) while in use."""

    def __init__(self, alias: str = DEFAULT_DB_ALIAS) -> None:
        self.alias = alias
        self._items: list[_Item] = []
        self._prunes: list[tuple[float, tuple[int, int, str, int]]] = []  # (due, prune)
        self._queued = 0  # chunks queued so far
        self._delivered = 0  # of them, those sent (or dropped)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._conn: Any = None  # PostgreSQL: the psycopg connection NOTIFY goes through
        self.sent = 0  # messages sent, for tests and the bench

    def send(self, ref: AttemptRef, channel: str, first: int, text: str,
             lost: Callable[[], bool]) -> None:
        with self._cond:
            self._items.append(_Item(ref, channel, first, first + 1, text, lost))
            self._queued += 1
            self._start()
            self._cond.notify()

    def prune(self, run_id: int, attempt: int, channel: str, end: int) -> None:
        """SQLite: delete the rows coalesced into a stored event (after the rows queued
        before it are written, as this queue is in order)."""
        if connections[self.alias].vendor != "sqlite":
            return
        with self._cond:
            self._prunes.append((time.monotonic() + PRUNE_DELAY, (run_id, attempt, channel, end)))
            self._start()
            self._cond.notify()

    def flush(self, timeout: float = 1.0) -> None:
        """Wait until the chunks queued so far are sent: the end of an attempt sends its
        last ones before the run ends, so open streams get them live."""
        deadline = time.monotonic() + timeout
        with self._cond:
            ticket = self._queued
            while self._delivered < ticket and time.monotonic() < deadline:
                self._cond.wait(0.01)

    def drain(self, timeout: float = 1.0) -> None:
        """At the worker's stop: send what is queued, then write every pending prune now,
        delay or not; a worker that exits (a burst worker when nothing is due) leaves no
        chunk rows of its runs behind. Never raises: the rows are ephemeral."""
        self.flush(timeout)
        with self._cond:
            prunes = [prune for _, prune in self._prunes]
            self._prunes = []
        if prunes:
            try:
                _write_rows({}, prunes)
            except Exception:
                logger.warning("pruning %s live chunk ranges at the stop failed; the reaper "
                               "prunes them", len(prunes), exc_info=True)

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="agentruns-chunks",
                                            daemon=True)
            self._thread.start()

    def _due_prunes(self) -> list[tuple[int, int, str, int]]:
        """Under the lock: the prunes whose delay is over, taken off the list."""
        now = time.monotonic()
        due = [prune for at, prune in self._prunes if at <= now]
        self._prunes = [(at, prune) for at, prune in self._prunes if at > now]
        return due

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._items:
                    wait = min([IDLE_CLOSE, *(at - time.monotonic() for at, _ in self._prunes)])
                    self._cond.wait(max(0.0, wait))
                    if not self._items and not self._prunes:
                        self._close()
                        continue
            if self._items:
                time.sleep(BATCH_INTERVAL)  # gather: one message for what comes meanwhile
            with self._cond:
                items, self._items = self._items, []
                prunes = self._due_prunes()
                taken = self._queued
            try:
                self._deliver([it for it in items if not it.lost()], prunes)
            except Exception:  # chunks are ephemeral: the coalesced event still stores them
                logger.warning("sending %s live chunks failed; they are dropped", len(items),
                               exc_info=True)
                self._close()
            finally:
                with self._cond:
                    self._delivered = max(self._delivered, taken)
                    self._cond.notify_all()

    def _deliver(self, items: list[_Item], prunes: list[tuple[int, int, str, int]]) -> None:
        merged = merge(items)
        if connections[self.alias].vendor == "postgresql":
            if merged:
                self._notify(merged)
            return
        if merged or prunes:
            _write_rows(merged, prunes)

    def _notify(self, merged: dict[AttemptRef, list[Chunk]]) -> None:
        import psycopg

        from ..db import connect_params

        values, params = [], []
        for ref, chunks in merged.items():
            for payload in payloads(chunks):
                values.append("(%s, %s, %s, %s, %s, %s)")
                params += [len(values), ref.run_id, ref.attempt, ref.worker_id,
                           run_channel(ref.run_id), payload]
        table = AgentRun._meta.db_table
        # Fenced: only runs this attempt still holds are told. Sorted before pg_notify is
        # called, so a run's messages go out in the order they were streamed.
        sql = (f"SELECT count(pg_notify(v.ch, v.p)) FROM (SELECT v.ord, v.ch, v.p FROM "
               f"(VALUES {', '.join(values)}) v(ord, id, attempt, worker, ch, p) "
               f'JOIN "{table}" r ON r.id = v.id::bigint AND r.attempt = v.attempt::integer '
               f"AND r.claimed_by = v.worker::text AND r.status = 'running' "
               f"ORDER BY v.ord OFFSET 0) v")
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(**connect_params(self.alias), autocommit=True)
        self._conn.execute(sql, params)
        self.sent += len(values)

    def _close(self) -> None:
        """Give back this thread's connections while no chunk comes (never raises)."""
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
        with contextlib.suppress(Exception):
            close_old_connections()
            connection.close()


@retry_on_lock()
def _write_rows(merged: dict[AttemptRef, list[Chunk]],
                prunes: list[tuple[int, int, str, int]]) -> None:
    """SQLite: the chunks of runs their attempt still holds, then the prunes, in one
    transaction."""
    from django.db import transaction

    with transaction.atomic():
        if merged:
            held = Q()
            for ref in merged:
                held |= ref.guard()
            live = set(AgentRun.objects.filter(held).values_list("id", "attempt"))
            StreamChunk.objects.bulk_create([
                StreamChunk(run_id=ref.run_id, attempt=ref.attempt, channel=c["channel"],
                            first=c["first"], end=c["end"], text=c["text"])
                for ref, chunks in merged.items() if (ref.run_id, ref.attempt) in live
                for c in chunks])
        for run_id, attempt, channel, end in prunes:
            StreamChunk.objects.filter(Q(attempt__lt=attempt) | Q(channel=channel,
                                                                  end__lte=end),
                                       run_id=run_id, attempt__lte=attempt).delete()


def read_chunks(positions: Mapping[int, int]) -> dict[int, tuple[int, list[Chunk]]]:
    """SQLite (the web poller): each run's chunks past its position, with the new
    position; nothing (and no statement) on PostgreSQL, where the listener brings them."""
    if connections[read_alias()].vendor != "sqlite" or not positions:
        return {}
    wanted = Q()
    for run_id, after in positions.items():
        wanted |= Q(run_id=run_id, id__gt=after)
    found: dict[int, tuple[int, list[Chunk]]] = {}
    for pk, run_id, attempt, channel, first, end, text in reading(StreamChunk.objects.filter(
            wanted)).order_by("id").values_list("id", "run_id", "attempt", "channel",
                                               "first", "end", "text")[:5000]:
        _, chunks = found.setdefault(run_id, (0, []))
        chunks.append({"channel": channel, "text": text, "attempt": attempt,
                       "first": first, "end": end})
        found[run_id] = (pk, chunks)
    return found


Deliver = Callable[[int, list[Chunk]], None]


class Listener:
    """A web process's one LISTEN connection for live chunks (PostgreSQL)."""

    def __init__(self, watched: Callable[[], set[int]], deliver: Deliver,
                 alias: str | None = None) -> None:
        self._watched = watched
        self._deliver = deliver
        self.alias = alias  # None: LISTEN_DATABASE (direct, past a pooler) or `default`
        self.changed = threading.Event()
        self.connected = False
        self._thread: threading.Thread | None = None
        self._pid = 0

    def ensure_running(self) -> None:
        import os

        if self._thread is not None and self._thread.is_alive() and self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="agentruns-chunk-listen",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # While the database is away, chunks wait for the coalesced event.
        serve_on_demand(lambda: bool(self._watched()), self.changed, self._serve,
                        Reconnects(logger, "live-chunk LISTEN connection", 0.1, 5.0),
                        after=self._disconnected)

    def _disconnected(self) -> None:
        self.connected = False

    def _serve(self) -> None:
        """LISTEN to what is watched, until nothing is."""
        from ..db import listen_alias, listening

        subscribed: set[int] = set()
        with listening(self.alias or listen_alias()) as conn:
            self.connected = True
            try:
                while True:
                    wanted = self._watched()
                    self.changed.clear()
                    for run_id in wanted - subscribed:
                        conn.execute(f"LISTEN {run_channel(run_id)}")
                    for run_id in subscribed - wanted:
                        conn.execute(f"UNLISTEN {run_channel(run_id)}")
                    subscribed = set(wanted)
                    if not subscribed:
                        return
                    for note in notifications(conn, 0.05):
                        self._hear(note.channel, note.payload)
                        if self.changed.is_set():
                            break
            finally:
                self.connected = False

    def _hear(self, channel: str, payload: str) -> None:
        if not channel.startswith(CHANNEL_PREFIX):
            return
        try:
            run_id = int(channel[len(CHANNEL_PREFIX):])
            chunks = json.loads(payload)
        except ValueError:
            logger.warning("ignored a malformed live-chunk notification on %s", channel)
            return
        self._deliver(run_id, chunks)


_sender: Sender | None = None
_sender_lock = threading.Lock()


def drain_sender() -> None:
    """`Sender.drain` of this process's sender, if it has one (no thread started)."""
    with _sender_lock:
        found = _sender
    if found is not None:
        found.drain()


def sender() -> Sender:
    """This process's sender, made at its first chunk."""
    global _sender
    with _sender_lock:
        if _sender is None:
            _sender = Sender()
        return _sender
