"""Small database helpers shared by the modules that talk SQL."""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

from django.db import DatabaseError, OperationalError, connection, connections
from django.db.models import BigIntegerField, BooleanField, Expression, Func, Lookup

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
