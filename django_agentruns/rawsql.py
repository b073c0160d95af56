"""SQL text for the hot path (claim, settle, events), built once per shape and reused.

Compiling a queryset costs more Python than the statement costs the database (about 40%
of a worker's time went to the ORM's compiler). `transitions` runs what is built here;
nothing here executes a statement or decides a status.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from django.db import connection
from django.db.models import Field, QuerySet

from .models import AgentRun, RunEvent

# Stands for "now" while a queryset is compiled; swapped for the real time per call.
SENTINEL_TIME = datetime(1999, 12, 31, 23, 59, 58, 424242, tzinfo=UTC)


def qn(name: str) -> str:
    return connection.ops.quote_name(name)


def prep(model: type[AgentRun] | type[RunEvent], name: str, value: Any) -> Any:
    """A value as the field would send it (JSON adapted, UUID and datetime for SQLite)."""
    field = model._meta.get_field(name)
    assert isinstance(field, Field)
    return field.get_db_prep_value(value, connection)


class Compiled:
    """A queryset's SQL with the positions of its "now" parameter, to fill in per call."""

    def __init__(self, qs: QuerySet[Any]) -> None:
        self.sql, params = qs.query.get_compiler(connection=connection).as_sql()
        sentinel = prep(AgentRun, "available_at", SENTINEL_TIME)
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


def settle_succeeded(
    items: Sequence[tuple[int, int, Any, Any]], worker_id: str, running: str, succeeded: str,
    completed: str, event_type: str, at: datetime, *, with_events: bool,
) -> tuple[str, list[Any]]:
    """Mark (run_id, attempt, output, event_id) rows succeeded where the fence holds.

    Returns the ids it updated: the rest lost their lease meanwhile. `with_events`
    (PostgreSQL) appends their end events in the same statement.
    """
    table = qn(AgentRun._meta.db_table)
    params: list[Any] = []
    for run_id, attempt, output, event_id in items:
        params += [run_id, attempt, prep(AgentRun, "output", output),
                   prep(RunEvent, "event_id", event_id)]
    rows = values_rows(len(items), "bigint", "integer", "jsonb", "uuid")
    params += [succeeded, completed, prep(AgentRun, "finished_at", at), running, worker_id]
    update = (f"UPDATE {table} SET status = %s, reason = %s, output = v.run_output, "
              f"finished_at = %s, lease_expires = NULL FROM v "
              f"WHERE {table}.id = v.run_id AND {table}.attempt = v.run_attempt "
              f"AND {table}.status = %s AND {table}.claimed_by = %s ")
    head = f"WITH v (run_id, run_attempt, run_output, run_event) AS (VALUES {rows}) "
    if not with_events:
        return f"{head}{update}RETURNING {table}.id", params
    params += [event_type, prep(RunEvent, "payload", {}), prep(RunEvent, "created_at", at)]
    return (f"{head}, done AS ({update}RETURNING {table}.id, {table}.attempt), "
            f"ended AS ({_events_from('done', 'done_v.run_event', 'done_v')}) "
            f"SELECT id FROM done"), params


def _events_from(rows: str, event_id: str, join: str = "") -> str:
    """INSERT one event per row of CTE `rows` (id, attempt): type, payload, time as %s."""
    events = qn(RunEvent._meta.db_table)
    source = f"{rows} JOIN v {join} ON {join}.run_id = {rows}.id" if join else rows
    return (f"INSERT INTO {events} (run_id, seq, event_id, type, payload, attempt, created_at) "
            f"SELECT {rows}.id, COALESCE((SELECT MAX(e.seq) FROM {events} e "
            f"WHERE e.run_id = {rows}.id), 0) + 1, {event_id}, %s, %s::jsonb, {rows}.attempt, "
            f"%s FROM {source}")


def claim_returning(
    due: Compiled, at: datetime, worker_id: str, running: str, queued: str,
    lease_ttls: dict[str, datetime], default_lease: datetime, started: str,
) -> tuple[str, list[Any]]:
    """PostgreSQL: lock the due rows (SKIP LOCKED), start them and append their start
    events, all in one statement."""
    table = qn(AgentRun._meta.db_table)
    params = due.bind(at)
    lease = "%s"
    lease_params: list[Any] = []
    if lease_ttls:
        whens = " ".join(["WHEN %s THEN %s"] * len(lease_ttls))
        lease = f"CASE {table}.agent {whens} ELSE %s END"
        for agent, until in lease_ttls.items():
            lease_params += [agent, until]
    lease_params.append(default_lease)
    params += [running, worker_id, *lease_params, at, queued,
               started, prep(RunEvent, "payload", {"worker": worker_id}), at]
    sql = (f"WITH picked AS ({due.sql}), "
           f"claimed AS (UPDATE {table} SET status = %s, claimed_by = %s, "
           f"attempt = {table}.attempt + 1, lease_expires = {lease}, started_at = %s "
           f"FROM picked WHERE {table}.id = picked.id AND {table}.status = %s "
           f"RETURNING {table}.*, picked.started_at AS previous_started_at), "
           f"started AS ({_events_from('claimed', 'gen_random_uuid()')}) "
           f"SELECT * FROM claimed")
    return sql, params
