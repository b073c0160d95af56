"""Running the hot path's SQL (`rawsql`): a cursor that prepares its statements, and
returned rows turned into models as the ORM would, without its per-row Python."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init
from django.db.models.sql import Query

from ..models import AgentRun


def cursor(*, prepared: bool) -> Any:
    """Django's cursor; or, on PostgreSQL with `prepared`, one that has the server plan
    each statement once per connection (psycopg's prepared statements), keeping Django's
    error wrapping and execute wrappers.

    The preparing cursor is kept per connection (this thread's) and reused: a new one per
    statement built its adapters and loaders again (about 20 us a statement); leaving
    `with` does not close it."""
    # The connection itself, not the `connection` proxy: each attribute read through
    # that looks the thread's connection up again (some 15 a statement).
    db = connections[DEFAULT_DB_ALIAS]
    if not prepared or db.vendor != "postgresql":
        return db.cursor()
    db.ensure_connection()
    raw = db.connection
    kept = getattr(_kept, "cursor", None)
    if kept is None or kept.connection is not raw or kept.closed:
        if raw.prepare_threshold is None:
            # Django turns psycopg's preparing off (None); explicit prepare=True needs it
            # on. A threshold never reached keeps every other statement unprepared.
            raw.prepare_threshold = 2**31 - 1
        kept = _kept.cursor = _preparing_cursor_class()(raw)
    return (_KeptDebugWrapper if db.queries_logged else _KeptWrapper)(kept, db)


_kept = threading.local()  # Django's connections are per thread, so is the kept cursor


class _KeptWrapper(CursorWrapper):
    """Django's wrapper around a kept cursor: `with` leaves it open for the next use."""

    def __exit__(self, *exc: object) -> None:
        return None


class _KeptDebugWrapper(CursorDebugWrapper):
    def __exit__(self, *exc: object) -> None:
        return None


@functools.cache
def _preparing_cursor_class() -> type:
    from django.db.backends.postgresql.base import ServerBindingCursor  # psycopg 3 only

    class PreparingCursor(ServerBindingCursor):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            return super().execute(query, params, prepare=True)  # type: ignore[misc]

    return PreparingCursor


def column_names(cursor: Any, sql: str | None = None) -> tuple[str, ...]:
    """The names of a result's columns, kept per statement text `sql` (`description`
    builds an object per column, some 40 per claimed row, run after run)."""
    columns = _COLUMNS.get(sql) if sql is not None else None
    if columns is None:
        columns = tuple(c.name for c in cursor.description)
        if sql is not None and len(_COLUMNS) < 256:
            _COLUMNS[sql] = columns
    return columns


_COLUMNS: dict[str, tuple[str, ...]] = {}


def runs_from(cursor: Any, rows: list[Any] | None = None,
              sql: str | None = None) -> list[AgentRun]:
    """Model instances from the rows of a statement that returned whole AgentRun rows
    (`rows`: those fetched already; `sql`: its text, to keep its columns' names by),
    converted as the ORM would (JSON decoded); any extra column becomes an attribute. A
    row whose id is NULL (an outer join's) is no run."""
    columns = column_names(cursor, sql)
    names, kept, extra, converters = _row_shape(columns)
    at_id = columns.index("id")
    alias = connection.alias
    # As `from_db` would build them, without Model.__init__'s setattr per field and its
    # two signals (some 15 us a run): when every field is there and nobody listens.
    direct = len(names) == len(AgentRun._meta.concrete_fields) and not (
        pre_init.has_listeners(AgentRun) or post_init.has_listeners(AgentRun))
    runs = []
    for row in cursor.fetchall() if rows is None else rows:
        if row[at_id] is None:
            continue
        values = list(row)
        for pos, (funcs, expression) in converters:
            for func in funcs:
                values[pos] = func(values[pos], expression, connection)
        if direct:
            run = AgentRun.__new__(AgentRun)
            run.__dict__.update(zip(names, [values[i] for i in kept], strict=True))
            run._state = state = ModelState()
            state.adding, state.db = False, alias
        else:
            run = AgentRun.from_db(alias, names, [values[i] for i in kept])
        for i in extra:
            setattr(run, columns[i], values[i])
        runs.append(run)
    return runs


def run_maker(alias: str, names: list[str]) -> Callable[[dict[str, Any]], AgentRun]:
    """A function building a run as `AgentRun.from_db(alias, names, ...)` would from a dict
    of every field's value (by attname): without Model.__init__'s setattr per field when
    nobody listens to its signals (asked once per call, not per run)."""
    if pre_init.has_listeners(AgentRun) or post_init.has_listeners(AgentRun):
        return lambda values: AgentRun.from_db(alias, names, [values[n] for n in names])

    def make(values: dict[str, Any]) -> AgentRun:
        run = AgentRun.__new__(AgentRun)
        run.__dict__.update({n: values[n] for n in names})
        run._state = state = ModelState()
        state.adding, state.db = False, alias
        return run

    return make


@functools.lru_cache(maxsize=8)
def _row_shape(columns: tuple[str, ...]) -> tuple[
        list[str], list[int], list[int], list[tuple[int, tuple[list[Any], Any]]]]:
    """For rows of these columns: the model's attnames, which positions are fields, which
    are extra, and the ORM's converters by position (found once, not per claim)."""
    by_column = {f.column: f for f in AgentRun._meta.concrete_fields}
    fields = [by_column.get(c) for c in columns]
    compiler = connection.ops.compiler("SQLCompiler")(Query(AgentRun), connection,
                                                      connection.alias)
    converters = compiler.get_converters(
        [f.get_col(AgentRun._meta.db_table) if f else None for f in fields])  # type: ignore[misc]
    # In the model's field order, which `from_db` expects: a table's columns come in the
    # order migrations added them, which need not be the model's.
    position = {f.column: i for i, f in enumerate(fields) if f is not None}
    kept = [position[f.column] for f in AgentRun._meta.concrete_fields if f.column in position]
    return ([str(fields[i].attname) for i in kept],  # type: ignore[union-attr]
            kept,
            [i for i, f in enumerate(fields) if f is None],
            sorted(converters.items()))
