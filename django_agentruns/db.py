"""Small database helpers shared by the modules that talk SQL."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import random
import select
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar

from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    OperationalError,
    connection,
    connections,
)
from django.db.models import BigIntegerField, BooleanField, Expression, Func, Lookup

from .conf import app_settings

P = ParamSpec("P")
T = TypeVar("T")

logger = logging.getLogger("django_agentruns.db")

_TRANSIENT_MARKERS = ("database is locked", "database table is locked", "busy", "deadlock detected",
                      "could not serialize access")


def close_all_connections() -> None:
    """Close this thread's open connections, whatever state they are in (after an error
    they may be broken; a thread that ends must not leave one open)."""
    for conn in connections.all(initialized_only=True):
        with contextlib.suppress(Exception):
            conn.close()


def is_postgres() -> bool:
    return connection.vendor == "postgresql"


def is_transient_lock_error(exc: BaseException) -> bool:
    """SQLite's "database is locked" and PostgreSQL's deadlock or serialization failures."""
    if not isinstance(exc, DatabaseError):
        return False
    text = str(exc).lower()
    return isinstance(exc, OperationalError | DatabaseError) and any(
        marker in text for marker in _TRANSIENT_MARKERS
    )


# SQLSTATEs of a lost connection: class 08, and the server shutting down or starting up.
_LOST_CONNECTION_STATES = ("08", "57P01", "57P02", "57P03")


def storage_unreachable(exc: BaseException, raw_before: Any = None) -> bool:
    """Whether a database error is the database out of reach, not the statement's fault:
    lock contention, or a lost connection (a restart, a killed session, a refused connect).

    Errors on a working connection (bad data, a statement timeout) are not: retrying them
    would loop. `raw_before` is the DB-API connection the call began on: one Django has
    replaced since (it drops a connection whose rollback failed, and may reconnect at
    once) was lost.
    """
    if not isinstance(exc, DatabaseError):
        return False
    if is_transient_lock_error(exc):
        return True
    state = getattr(exc.__cause__, "sqlstate", None) or ""
    if state.startswith(_LOST_CONNECTION_STATES):
        return True
    raw = connection.connection
    if raw is None or (raw_before is not None and raw is not raw_before):
        return True
    return not connection_answers()


def connection_answers() -> bool:
    """Ping this thread's connection on its own DB-API handle (no Django wrapping)."""
    raw = connection.connection
    if raw is None:
        return False
    try:
        cursor = raw.cursor()
        try:
            cursor.execute("SELECT 1")
        finally:
            cursor.close()
    except Exception:
        return False
    return True


def retry_on_lock(attempts: int = 8) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Retry a whole transaction that met lock contention, with short jittered waits.

    Wrap the function that opens the transaction, never one called inside it: a
    transaction that failed on a lock is rolled back and must start over.
    """

    def wrap(func: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(func)
        def run(*args: P.args, **kwargs: P.kwargs) -> T:
            for tries in range(attempts):
                try:
                    return func(*args, **kwargs)
                except DatabaseError as exc:
                    if not is_transient_lock_error(exc) or tries == attempts - 1:
                        raise
                    if connection.in_atomic_block:
                        raise  # an outer transaction is broken now; only its owner can retry
                    wait = min(0.5, 0.005 * 2**tries) * (0.5 + random.random())
                    logger.debug("%s met lock contention (%s); retrying in %.3fs",
                                 func.__name__, exc, wait)
                    time.sleep(wait)
            raise AssertionError("unreachable")

        return run

    return wrap



class _Row(Func):
    """`(a, b)`, a row value. Only ever compared, so its output field is never read."""

    template = "(%(expressions)s)"
    output_field = BigIntegerField()


class RowBefore(Lookup):
    """`(a, b) < (c, d)`, a row-value comparison: "ahead in firing order" in one condition.

    Both engines answer it with one range seek on an index ending in (a, b), where the
    equivalent `a < c OR (a = c AND b < d)` costs PostgreSQL a filter over the scope's
    holders and SQLite two seeks (bench/due_query.py measures it). A Lookup, not a plain
    boolean expression, so that SQLite's WHERE gets it bare rather than as `... = true`.
    """

    lookup_name = "row_before"

    def __init__(self, a: Any, b: Any, c: Any, d: Any) -> None:
        super().__init__(_Row(a, b), _Row(c, d))

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[Any, ...]]:
        lhs, lhs_params = compiler.compile(self.lhs)
        rhs, rhs_params = compiler.compile(self.rhs)
        return f"{lhs} < {rhs}", (*lhs_params, *rhs_params)


class AmongUnindexed(Lookup):
    """`column IN (values)` that no index on the column can answer: a filter on the rows
    another index finds, in that index's order.

    For the claim's agent filter. The due index gives the claim order; an index that starts
    with `agent` (`agentruns_scope_head`) could answer a plain `agent IN (...)`, and where
    the planner's statistics predate the backlog (taken when the worker's agents had few
    runs, before a burst of enqueues) it takes that one and sorts the whole backlog on
    every claim (tests/test_unknown_agents.py shows it). PostgreSQL gets
    `array_position(%s::text[], column) IS NOT NULL`: one array parameter, no index can
    serve it, and it is estimated almost always true, as it is. SQLite gets
    `+column IN (...)`, its documented way to rule an index out.
    """

    lookup_name = "among_unindexed"
    prepare_rhs = False

    def __init__(self, column: Any, values: list[str]) -> None:
        super().__init__(column, list(values))

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[Any, ...]]:
        column, params = compiler.compile(self.lhs)
        if not self.rhs:
            return "1 = 0", ()
        if connection.vendor == "postgresql":
            return f"array_position(%s::text[], {column}) IS NOT NULL", (self.rhs, *params)
        marks = ", ".join(["%s"] * len(self.rhs))
        return f"+{column} IN ({marks})", (*params, *self.rhs)


class NotListedIn(Expression):
    """`column` is not a `name` of the small table `table` (the paused queues), estimated
    almost always true, as it is.

    For the claim: a plain `NOT EXISTS` or `NOT IN` there makes PostgreSQL's planner
    expect fewer due rows, and it then sorts the whole backlog rather than read the due
    index in order (tests/test_unknown_agents.py shows it). PostgreSQL gets
    `(ARRAY(SELECT name ...) @> ARRAY[column]) IS NOT TRUE`: the table read once per
    statement (an InitPlan), one array test per row, estimated at 0.995 like
    `AmongUnindexed`. SQLite gets `NOT EXISTS` against the table's primary key.
    """

    conditional = True
    output_field = BooleanField()

    def __init__(self, column: Any, table: str) -> None:
        super().__init__()
        self.column = column
        self.table = table

    def get_source_expressions(self) -> list[Any]:
        return [self.column]

    def set_source_expressions(self, exprs: Sequence[Any]) -> None:
        (self.column,) = exprs

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[Any, ...]]:
        column, params = compiler.compile(self.column)
        table, name = connection.ops.quote_name(self.table), connection.ops.quote_name("name")
        if connection.vendor == "postgresql":
            return (f"(ARRAY(SELECT {name}::text FROM {table}) @> ARRAY[{column}::text]) "
                    f"IS NOT TRUE"), tuple(params)
        return f"NOT EXISTS (SELECT 1 FROM {table} WHERE {name} = {column})", tuple(params)


# ------------------------------------------------- LISTEN/NOTIFY, shared by its users
# The worker's wake-ups, the live output transport, waits for runs and the pooling check
# all LISTEN on connections of their own.

CHANNEL = "agentruns"
"""The channel the triggers NOTIFY and workers LISTEN on; the payload is the queue's name."""

PROBE_TIMEOUT = 2.0
"""Seconds the self-check waits for its own notification: a direct connection gets it in
milliseconds; one behind a transaction pooler never does."""

PROBE_RETRY = 60.0
"""Seconds between self-checks while wake-ups are degraded (a fixed topology recovers)."""

DEGRADED_HINT = (
    "the LISTEN connection does not receive notifications: usually PgBouncer (or another "
    "pooler) in transaction or statement mode between this worker and PostgreSQL, which "
    "hands the LISTENing server connection to other clients. Fix: set "
    "AGENTRUNS['LISTEN_DATABASE'] to the alias of a DATABASES entry that connects directly "
    "to the server (claims and settles keep using the pooled one)")


def listen_alias() -> str:
    """The DATABASES alias the listener connects through (the worker's own by default)."""
    return str(app_settings.LISTEN_DATABASE or DEFAULT_DB_ALIAS)


def read_alias() -> str:
    """The DATABASES alias operators' reads go to (`READ_DATABASE`: a replica), so that a
    busy admin or a metrics scrape loads the replica, not the primary the workers write
    to. Never for a read that decides a write: those stay on the primary."""
    return str(app_settings.READ_DATABASE or DEFAULT_DB_ALIAS)


def probe_channel(worker_id: str) -> str:
    """A channel private to one worker, so no other worker's self-check answers it."""
    return f"agentruns_probe_{hashlib.sha256(worker_id.encode()).hexdigest()[:20]}"


def connect_params(alias: str) -> dict[str, Any]:
    """psycopg.connect() arguments of a DATABASES alias (its own connection, no pool)."""
    params = dict(connections[alias].get_connection_params())
    for key in ("cursor_factory", "context", "pool"):
        params.pop(key, None)
    return params


def self_check(listening: Any, channel: str, send_alias: str = DEFAULT_DB_ALIAS,
               timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether `listening` (a psycopg connection LISTENing on `channel`) receives a NOTIFY
    sent through `send_alias`, as an enqueue's is, within `timeout` seconds.

    Sent on a connection of its own: a session always hears its own NOTIFY, even behind
    a pooler, so sending it on the listening connection would prove nothing.
    """
    import psycopg

    nonce = uuid.uuid4().hex
    with psycopg.connect(**connect_params(send_alias), autocommit=True) as sender:
        sender.execute("SELECT pg_notify(%s, %s)", [channel, nonce])
    return any(note.channel == channel and note.payload == nonce
               for note in listening.notifies(timeout=timeout, stop_after=1))


def notifications(listening: Any, timeout: float) -> list[Any]:
    """The notifications `listening` (a psycopg connection that LISTENs) has, waiting up
    to `timeout` seconds for the first to arrive.

    psycopg's `notifies(timeout=...)` spins through its last millisecond (its poll rounds
    the time left down to 0 ms): some 0.6 ms of CPU a call, 1.4% of a core for a thread
    that listens in 50 ms slices. Here the socket is waited on once, then read without
    waiting."""
    notes = list(listening.notifies(timeout=0))  # what libpq holds already, first
    if notes:
        return notes
    if hasattr(select, "poll"):
        poll = select.poll()
        poll.register(listening.fileno(), select.POLLIN)
        poll.poll(max(1, round(timeout * 1000)))
    else:  # pragma: no cover - no poll() (Windows)
        select.select([listening.fileno()], [], [], timeout)
    return list(listening.notifies(timeout=0))


@contextlib.contextmanager
def listening(alias: str, *channels: str) -> Iterator[Any]:
    """A psycopg connection of its own to `alias` (no pool: a pooled one would be handed
    to others between statements), LISTENing on `channels`; closed on leaving."""
    import psycopg

    with psycopg.connect(**connect_params(alias), autocommit=True) as conn:
        for channel in channels:
            conn.execute(f"LISTEN {channel}")
        yield conn


class Reconnects:
    """The failures in a row of a LISTEN connection that its thread keeps reopening:
    each is logged (the first with its traceback) and waited out, doubling up to
    `longest` seconds, so a database that is away is not hammered; polling covers it."""

    def __init__(self, log: logging.Logger, what: str, first: float, longest: float) -> None:
        self.log, self.what, self.first, self.longest = log, what, first, longest
        self.failures = 0

    def connected(self) -> None:
        self.failures = 0

    def failed(self, then: str = "", *args: Any) -> float:
        """Log one more failure (`then`: what happens meanwhile); the seconds to wait."""
        self.failures += 1
        self.log.warning(f"%s failed (%s in a row){then}", self.what, self.failures, *args,
                         exc_info=self.failures == 1)
        return min(self.longest, self.first * 2.0 ** min(self.failures, 16))


def serve_on_demand(wanted: Callable[[], bool], changed: threading.Event,
                    serve: Callable[[], None], reconnects: Reconnects,
                    after: Callable[[], None]) -> None:
    """A listener thread's life, forever: asleep while nothing is `wanted()` (woken by
    `changed`), else `serve()` (which returns once nothing is), reopened after a failure
    when `reconnects` says; `after()` follows each serve, failed or not."""
    while True:
        if not wanted():
            changed.wait()
            changed.clear()
            continue
        try:
            serve()
            reconnects.connected()
        except Exception:  # the database is away: those waiting time out or poll meanwhile
            time.sleep(reconnects.failed())
        finally:
            after()


# ------------------------------------------------------ retrying an attempt's writes

FIRST_RETRY_WAIT = 0.05
LONGEST_RETRY_WAIT = 1.0
RetryHandler = Callable[[Exception, float, bool], None]
"""`on_error(exc, wait, spent)`: raises to give up, or returns to retry after `wait` s;
`spent` says half the lease is (or would be, after the wait) gone."""


def retry_for_half_lease(lease_ttl: float | None, write: Callable[[], T],
                         on_error: RetryHandler,
                         errors: tuple[type[Exception], ...] = (DatabaseError,)) -> T:
    """`write()`, retried after each of `errors` with backoff (0.05 s doubling to 1 s) while
    half the lease is left: past it the run lapses and another worker may reclaim it, so a
    write retried longer would race the new owner. `on_error` decides each time."""
    deadline = time.monotonic() + (lease_ttl or 0.0) / 2
    wait = FIRST_RETRY_WAIT
    while True:
        try:
            return write()
        except errors as exc:
            on_error(exc, wait, time.monotonic() + wait > deadline)
        time.sleep(wait)
        wait = min(LONGEST_RETRY_WAIT, wait * 2)


async def aretry_for_half_lease(lease_ttl: float | None, write: Callable[[], Awaitable[T]],
                                on_error: RetryHandler,
                                errors: tuple[type[Exception], ...] = (DatabaseError,)) -> T:
    """`retry_for_half_lease` on the event loop: the write awaited, the waits too."""
    deadline = time.monotonic() + (lease_ttl or 0.0) / 2
    wait = FIRST_RETRY_WAIT
    while True:
        try:
            return await write()
        except errors as exc:
            on_error(exc, wait, time.monotonic() + wait > deadline)
        await asyncio.sleep(wait)
        wait = min(LONGEST_RETRY_WAIT, wait * 2)
