"""SQL text for the hot path (claim, settle, events), built once per shape and reused.

Compiling a queryset costs more Python than the statement costs the database (about 40%
of a worker's time went to the ORM's compiler). `transitions` runs what is built here,
through `rawrows.cursor()` (prepared on request) and `rawrows.runs_from()` (rows to
models); nothing here executes a statement or decides a status.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import Field, QuerySet
from django.utils import timezone

from ..models import AgentRun, RunCheckpoint, RunEvent, RunPayload
from .guards import still_sql

# Stands for "now" while a queryset is compiled; swapped for the real time per call.
SENTINEL_TIME = datetime(1999, 12, 31, 23, 59, 58, 424242, tzinfo=UTC)


def naive_times() -> bool:
    """SQLite with USE_TZ=False: Django stores naive local times, and refuses aware ones."""
    return not settings.USE_TZ and connection.vendor == "sqlite"


def sentinel_time(naive: bool) -> datetime:
    return SENTINEL_TIME.replace(tzinfo=None) if naive else SENTINEL_TIME


def qn(name: str) -> str:
    return connection.ops.quote_name(name)


def prep(model: type[AgentRun] | type[RunEvent] | type[RunPayload], name: str,
         value: Any) -> Any:
    """A value as the field would send it (JSON adapted, UUID and datetime for SQLite).
    PostgreSQL takes an aware datetime or a UUID as it is (the field would only check)."""
    if isinstance(value, datetime | uuid.UUID) and getattr(value, "tzinfo", True) is not None \
            and connection.vendor == "postgresql":
        return value
    return _field(model, name).get_db_prep_value(value, connection)


@functools.cache
def _field(model: type[AgentRun] | type[RunEvent] | type[RunPayload],
           name: str) -> Field[Any, Any]:
    field = model._meta.get_field(name)
    assert isinstance(field, Field)
    return field


class Compiled:
    """A queryset's SQL with the positions of its "now" parameter, to fill in per call."""

    def __init__(self, qs: QuerySet[Any], *, naive: bool = False) -> None:
        self.sql, params = qs.query.get_compiler(connection=connection).as_sql()
        sentinel = prep(AgentRun, "available_at", sentinel_time(naive))
        self.params = list(params)
        self.now_at = [i for i, p in enumerate(self.params) if p == sentinel]

    def bind(self, at: datetime) -> list[Any]:
        params = list(self.params)
        value = prep(AgentRun, "available_at", at)
        for i in self.now_at:
            params[i] = value
        return params


def _casts(*types: str) -> list[str]:
    """Placeholders for a VALUES row: typed on PostgreSQL, which cannot infer them."""
    if connection.vendor == "postgresql":
        return [f"%s::{t}" for t in types]
    return ["%s"] * len(types)


def values_rows(count: int, *types: str) -> str:
    row = "(" + ", ".join(_casts(*types)) + ")"
    return ", ".join([row] * count)


@functools.cache
def _insert_events_head(vendor: str) -> str:
    table = qn(RunEvent._meta.db_table)
    return (f"INSERT INTO {table} (run_id, seq, event_id, type, payload, attempt, created_at) "
            f"SELECT v.run_id, COALESCE((SELECT MAX(e.seq) FROM {table} e "
            f"WHERE e.run_id = v.run_id), 0) + v.k, v.event_id, v.type, v.payload, v.attempt, %s "
            f"FROM v")


def insert_events(
    events: Sequence[tuple[int, str, dict[str, Any], int, Any]], at: datetime
) -> tuple[str, list[Any]]:
    """One INSERT for all `events`, each seq one past its run's highest (k-th of a run: +k).

    The caller holds the runs' rows, so no other writer appends to them meanwhile.
    """
    seen: dict[int, int] = {}
    params: list[Any] = []
    for run_id, type_, payload, attempt, event_id in events:
        k = seen[run_id] = seen.get(run_id, 0) + 1
        params += [run_id, k, prep(RunEvent, "event_id", event_id), type_,
                   prep(RunEvent, "payload", payload), attempt]
    params.append(prep(RunEvent, "created_at", at))
    rows = values_rows(len(events), "bigint", "integer", "uuid", "varchar", "jsonb", "integer")
    sql = (f"WITH v (run_id, k, event_id, type, payload, attempt) AS (VALUES {rows}) "
           + _insert_events_head(connection.vendor))
    return sql, params


def _column(name: str) -> str:
    field = AgentRun._meta.get_field(name)
    assert isinstance(field, Field)
    return str(field.column)


def json_rows(columns: Sequence[tuple[str, str]]) -> str:
    """`(SELECT ... )` of the rows sent as one JSON array parameter (see `json_values`),
    with these (name, PostgreSQL type) columns.

    One parameter, however many rows: the statement's text stays short and the same, where
    a VALUES list of thousands of placeholders costs psycopg more to parse than the
    database to run, and SQLite has a limit on them."""
    if connection.vendor == "postgresql":
        picks = ", ".join(f"(r->>{i})::{t} AS {n}" for i, (n, t) in enumerate(columns))
        return f"(SELECT {picks} FROM jsonb_array_elements(%s::jsonb) AS rows(r))"
    picks = ", ".join(f"json_extract(value, '$[{i}]') AS {n}" for i, (n, _) in enumerate(columns))
    return f"(SELECT {picks} FROM json_each(%s))"


def db_time(value: datetime) -> str:
    """A datetime as text the database reads as that instant, as Django stores it there:
    in UTC, except on SQLite with USE_TZ=False, where Django stores naive local times (and
    refuses an aware one)."""
    if naive_times():
        if timezone.is_aware(value):
            value = timezone.make_naive(value)
        return str(connection.ops.adapt_datetimefield_value(value))
    return str(connection.ops.adapt_datetimefield_value(value.astimezone(UTC)))


def json_value(value: Any, type_: str) -> Any:
    """A value as `json_rows` reads it back: times and JSON documents as their text, UUIDs
    as the column stores them (hex on SQLite)."""
    if value is None:
        return None
    if type_ == "timestamptz":
        return db_time(value)
    if type_ == "jsonb":
        return json.dumps(value)
    if type_ == "uuid":
        return str(prep(RunEvent, "event_id", value))
    return value


def json_values(rows: Sequence[Sequence[Any]], types: Sequence[str]) -> str:
    return json.dumps([[json_value(v, t) for v, t in zip(row, types, strict=True)]
                       for row in rows])


_FENCE = (("run_id", "bigint"), ("run_attempt", "integer"), ("run_worker", "varchar"))


def _fence(table: str) -> str:
    """The rows of `v` (`_FENCE` columns first) whose attempt still holds its run; the
    running status is the statement's first parameter, in a guard no status index
    matches (`guards.still_sql`): the runs are found by id, whatever the statistics say."""
    return (f"WHERE {table}.id = v.run_id AND {table}.attempt = v.run_attempt "
            f"AND {still_sql(table)} AND {table}.claimed_by = v.run_worker ")


def _last_seq(events: str) -> str:
    """The highest seq stored for `v`'s run (0 for none)."""
    return f"COALESCE((SELECT MAX(e.seq) FROM {events} e WHERE e.run_id = v.run_id), 0)"


def _not_stored(events: str) -> str:
    """`v`'s event id is not stored for its run. A scalar subquery, not `NOT EXISTS`:
    PostgreSQL turns the latter into an anti-join, and while the events table is young (or
    its statistics stale) it picks a hash anti-join that reads the whole table for every
    batch. A scalar subquery stays one index probe per event, whatever the statistics say."""
    return (f"(SELECT 1 FROM {events} x WHERE x.run_id = v.run_id "
            f"AND x.event_id = v.event_id LIMIT 1) IS NULL")


def fenced_update(
    items: Sequence[tuple[Any, ...]], running: str, fields: Sequence[tuple[str, str]],
    *, below: str | None = None, despite_cancel: bool = False,
) -> tuple[str, list[Any]]:
    """Set `fields` ((name, PostgreSQL type) of AgentRun) from (run_id, attempt, worker,
    *values) rows whose fence holds and whose run has no cancel request; returns the ids
    it updated (a renewal: `lease_expires` alone; a checkpoint: its state too). With
    `below` (one of `fields`), only rows whose stored value is less than the new one.
    With `despite_cancel`, rows with a cancel request too, each id returned with whether
    its run has one (its value: SQLite answers `IS NOT NULL` there wrongly)."""
    table = qn(AgentRun._meta.db_table)
    columns = [*_FENCE, *((f"f{i}", t) for i, (_, t) in enumerate(fields))]
    sets = ", ".join(f"{qn(_column(name))} = v.f{i}" for i, (name, _) in enumerate(fields))
    guard = ""
    if below is not None:
        at = [name for name, _ in fields].index(below)
        guard = f"AND {table}.{qn(_column(below))} < v.f{at} "
    if despite_cancel:
        returning = f"{table}.id, {table}.{qn(_column('cancel_requested_at'))}"
    else:
        guard = f"AND {table}.cancel_requested_at IS NULL {guard}"
        returning = f"{table}.id"
    sql = (f"WITH v AS {json_rows(columns)} UPDATE {table} SET {sets} FROM v "
           f"{_fence(table)}{guard}RETURNING {returning}")
    return sql, [json_values(items, [t for _, t in columns]), running]


_NEW_EVENT = (("run_id", "bigint"), ("event_id", "uuid"), ("type", "varchar"),
              ("payload", "jsonb"), ("attempt", "integer"), ("cap", "integer"), ("k", "integer"))


def insert_new_events(
    events: Sequence[tuple[int, str, dict[str, Any], int, Any]], at: datetime,
    caps: Sequence[int | None] | None = None,
) -> tuple[str, list[Any]]:
    """One INSERT for the events, each past its run's highest seq (a run's several in
    their order: its `k`-th gets seq + k), leaving out any whose id is stored already (a
    retry re-emitting) and any that would take its run's stream past its cap (`caps`, one
    per event; None: no cap). Of a run's several, only the last may be a retry's (the
    others are new: lifecycle ids), so no seq is skipped. Returns the (run id, event id)
    of each one it added (the stored-id check: `_not_stored`)."""
    table = qn(RunEvent._meta.db_table)
    caps = caps or [None] * len(events)
    counts: dict[int, int] = {}
    rows = []
    for (run_id, type_, payload, attempt, event_id), cap in zip(events, caps, strict=True):
        k = counts[run_id] = counts.get(run_id, 0) + 1
        rows.append((run_id, event_id, type_, payload, attempt, cap, k))
    last = _last_seq(table)
    sql = (f"WITH v AS {json_rows(_NEW_EVENT)} "
           f"INSERT INTO {table} (run_id, seq, event_id, type, payload, attempt, created_at) "
           f"SELECT v.run_id, {last} + v.k, v.event_id, v.type, v.payload, v.attempt, %s "
           f"FROM v WHERE {_not_stored(table)} "
           f"AND (v.cap IS NULL OR {last} + v.k <= v.cap) RETURNING run_id, event_id")
    return sql, [json_values(rows, [t for _, t in _NEW_EVENT]),
                 prep(RunEvent, "created_at", at)]


_ALONE = (*_FENCE, ("lease", "timestamptz"), ("number", "integer"), ("state", "jsonb"),
          ("event_id", "uuid"), ("type", "varchar"), ("payload", "jsonb"), ("cap", "integer"))


def fenced_alone(
    items: Sequence[tuple[Any, ...]], running: str, at: datetime, keep: int | None,
) -> tuple[str, list[Any]]:
    """PostgreSQL, one statement (no transaction around it), one row a run: (run_id,
    attempt, worker, lease, number, state, event_id, type, payload, cap). Renew each
    row's lease where its fence holds and its run has no cancel request; a checkpoint's
    (`number` set) only where the run's count is below its number, and then its state is
    saved, the states past the latest `keep` trimmed (None: all kept), as `fenced_update`,
    `insert_checkpoints` and `trim_history` do; an event (`type` set) is appended to the
    runs renewed, as `insert_new_events` does. Returns (run id, NULL) for each run renewed
    and (run id, event id) for each event added."""
    table, events = qn(AgentRun._meta.db_table), qn(RunEvent._meta.db_table)
    states = qn(RunCheckpoint._meta.db_table)
    count = qn(_column("checkpoint_count"))
    last = _last_seq(events)
    # Each renewed checkpoint's own old states, found by index from it (a LATERAL that
    # OFFSET 0 keeps from being flattened into a join), never by a scan of every run's
    # states that a plan expecting one renewed run, or made while they were few, prefers.
    trim = (f"trimmed AS (DELETE FROM {states} WHERE id = ANY(ARRAY(SELECT old.id FROM "
            f"fenced v CROSS JOIN LATERAL (SELECT s.id FROM {states} s WHERE s.run_id = "
            f"v.run_id AND s.number <= v.number - %s OFFSET 0) old WHERE v.number > %s))), "
            if keep is not None else "")
    # Prepared, it soon runs on PostgreSQL's generic plan, which knows neither how many rows
    # `v` holds nor the status sought: the runs are found by id (`= ANY`), and the status
    # guard is written so that no status index matches it (`guards.still_sql`), lest
    # statistics that count no running run send the plan through every running run. Such
    # statistics also make the plan expect one run renewed: the renewed rows carry their
    # writes on (RETURNING), so that no later part joins them to anything, where a nested
    # loop over that one expected row would compare every pair of a batch of hundreds.
    sql = (f"WITH v AS {json_rows(_ALONE)}, "
           f"fenced AS (UPDATE {table} SET {qn(_column('lease_expires'))} = v.lease, "
           f"{count} = COALESCE(v.number, {table}.{count}) FROM v "
           f"WHERE {table}.id = ANY(%s::bigint[]) AND {table}.id = v.run_id "
           f"AND {table}.attempt = v.run_attempt AND {still_sql(table)} "
           f"AND {table}.claimed_by = v.run_worker AND {table}.cancel_requested_at IS NULL "
           f"AND (v.number IS NULL OR {table}.{count} < v.number) RETURNING v.run_id, "
           f"v.run_attempt, v.number, v.state, v.event_id, v.type, v.payload, v.cap), "
           f"saved AS (INSERT INTO {states} (run_id, number, state, created_at) "
           f"SELECT v.run_id, v.number, v.state, %s FROM fenced v WHERE v.number IS NOT NULL), "
           f"{trim}"
           f"added AS (INSERT INTO {events} (run_id, seq, event_id, type, payload, attempt, "
           f"created_at) SELECT v.run_id, {last} + 1, v.event_id, v.type, v.payload, "
           f"v.run_attempt, %s FROM fenced v WHERE v.type IS NOT NULL AND {_not_stored(events)} "
           f"AND (v.cap IS NULL OR {last} + 1 <= v.cap) RETURNING run_id, event_id) "
           f"SELECT run_id, NULL::uuid FROM fenced UNION ALL SELECT run_id, event_id FROM added")
    created = prep(RunEvent, "created_at", at)
    return sql, [json_values(items, [t for _, t in _ALONE]), [item[0] for item in items],
                 running, created, *([keep, keep] if keep is not None else []), created]


_CHECKPOINT = (("run_id", "bigint"), ("number", "integer"), ("state", "jsonb"))


def insert_checkpoints(
    rows: Sequence[tuple[int, Any, int]], at: datetime,
) -> tuple[str, list[Any]]:
    """One INSERT of (run_id, state, number) rows into the checkpoint history, for
    checkpoints whose fenced UPDATE just held (so each number is new for its run)."""
    table = qn(RunCheckpoint._meta.db_table)
    values = [(run_id, number, state) for run_id, state, number in rows]
    sql = (f"WITH v AS {json_rows(_CHECKPOINT)} "
           f"INSERT INTO {table} (run_id, number, state, created_at) "
           f"SELECT v.run_id, v.number, v.state, %s FROM v")
    return sql, [json_values(values, [t for _, t in _CHECKPOINT]),
                 prep(RunEvent, "created_at", at)]
