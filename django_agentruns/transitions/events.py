"""The story's vocabulary (event types), its clock, and the one way events are appended.

Every transition appends its events in the transaction of its guarded UPDATE, which holds
the runs' rows: no other writer appends to them meanwhile, so max(seq) + 1 is free.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import connection
from django.db.models import Field
from django.utils import timezone

from ..models import RunEvent
from . import rawsql

EVENT_NAMESPACE = uuid.UUID("6f1b7a52-3d0c-4f0e-9a55-0a6e2b8c1d17")

STARTED = "run.started"
SUCCEEDED = "run.succeeded"
RETRYING = "run.retrying"
DEAD_LETTERED = "run.dead_lettered"
CANCELLED = "run.cancelled"
CANCEL_REQUESTED = "run.cancel_requested"
ABANDONED = "run.abandoned"
RETRIED = "run.retried"
CHECKPOINT = "run.checkpoint"
INTERRUPTED = "run.interrupted"
FORKED = "run.forked"
SNOOZED = "run.snoozed"
USAGE = "run.usage"
MIGRATED = "run.migrated"


def now() -> datetime:
    return timezone.now()


# --------------------------------------------------------------------------- events


def lifecycle_event_id() -> uuid.UUID:
    """Lifecycle events are written with their guarded transition, so never twice."""
    return uuid.uuid4()


def emitted_event_id(run_id: int, checkpoints: int, position: int) -> uuid.UUID:
    """Deterministic: a retry resuming from the same checkpoint derives the same ids."""
    return uuid.uuid5(EVENT_NAMESPACE, f"{run_id}:{checkpoints}:{position}")


def append_events(
    events: Sequence[tuple[int, str, dict[str, Any], int, uuid.UUID]], at: datetime
) -> None:
    """Append (run_id, type, payload, attempt, event_id) rows with the next per-run seq.

    One statement for any number of events. Callers hold the runs' rows (guarded UPDATE
    in the same transaction), so no other writer appends to these runs meanwhile and
    max(seq) + 1 is free.
    """
    if not events:
        return
    sql, params = rawsql.insert_events(events, at)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def append_one(
    event: tuple[int, str, dict[str, Any], int, uuid.UUID], at: datetime, *,
    unless_exists: bool = False, below: int | None = None,
) -> bool:
    """Append one event in one statement, its seq computed in the INSERT itself.

    With `unless_exists`, an event whose id is already stored (a retry re-emitting) adds
    nothing; with `below`, neither does one that would take the run's stream past `below`
    events (seqs run 1, 2, ... with no gap, so the highest is the count). Returns whether
    a row was added.
    """
    run_id, type_, payload, attempt, event_id = event
    table = connection.ops.quote_name(RunEvent._meta.db_table)
    sql = (f"INSERT INTO {table} (run_id, seq, event_id, type, payload, attempt, created_at) "
           f"SELECT %s, last.seq + 1, %s, %s, %s, %s, %s FROM (SELECT COALESCE(MAX(seq), 0) "
           f"AS seq FROM {table} WHERE run_id = %s) last")
    params = [run_id, _prep("event_id", event_id), type_, _prep("payload", payload),
              attempt, _prep("created_at", at), run_id]
    where = []
    if below is not None:
        where.append("last.seq < %s")
        params.append(below)
    if unless_exists:
        # By run too: with partitioned history the key is (run_id, event_id), and the
        # run id confines the look-up to one partition.
        where.append(f"NOT EXISTS (SELECT 1 FROM {table} WHERE run_id = %s AND event_id = %s)")
        params += [run_id, params[1]]
    if where:
        sql += " WHERE " + " AND ".join(where)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return bool(cursor.rowcount)


def event_exists(run_id: int, event_id: uuid.UUID) -> bool:
    return RunEvent.objects.filter(run_id=run_id, event_id=event_id).exists()


def _prep(name: str, value: Any) -> Any:
    field = RunEvent._meta.get_field(name)
    assert isinstance(field, Field)
    return field.get_db_prep_value(value, connection)


def lifecycle(run_id: int, type_: str, attempt: int, **payload: Any) -> tuple[
        int, str, dict[str, Any], int, uuid.UUID]:
    return (run_id, type_, payload, attempt, lifecycle_event_id())
