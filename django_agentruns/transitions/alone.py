"""Writes that commit in one statement of their own (PostgreSQL): an attempt store's
commonest batches, emits, checkpoints and renewals of distinct runs, each fenced on its
own, with no BEGIN or COMMIT round trip around them (`batched.apply_writes` sends them
here when no transaction is open)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connection

from ..models import Status
from ..outcomes import Renewal
from . import rawrows, rawsql
from .attempts import checkpoints_kept
from .events import CHECKPOINT, lifecycle
from .plans import prepared_by_index
from .writes import CheckpointWrite, EmitWrite, RenewWrite, Result, Write

Fallback = Callable[[Sequence[Write], datetime], list[Result]]


def one_statement(writes: Sequence[Write]) -> bool:
    """Whether `writes` are PostgreSQL emits (none despite a cancel), checkpoints and
    renewals, one per run: what `write_alone` writes."""
    return bool(writes) and connection.vendor == "postgresql" \
        and all(isinstance(w, RenewWrite | CheckpointWrite)
                or (isinstance(w, EmitWrite) and not w.despite_cancel) for w in writes) \
        and len({w.ref.run_id for w in writes}) == len(writes)


def write_alone(writes: Sequence[Write], at: datetime, fallback: Fallback) -> list[Result]:
    """One statement renews every fence that holds, saves those runs' checkpoints and
    appends their events. A write it did not wholly make (a fence that failed, a cancel
    request, a replay, an event past its run's cap) goes to `fallback` (the writes applied
    in a transaction), which answers it exactly: rare, so the common batch is one round
    trip.

    The statement computes each seq from its own snapshot. An event another transaction
    appended while the statement waited on a run's row lock (a delivery, a cancel request)
    collides with that seq: nothing was written, and the whole batch goes to `fallback`,
    whose statements come after that event."""
    sql, params = rawsql.fenced_alone([_row(w, at) for w in writes], Status.RUNNING, at,
                                      checkpoints_kept())
    try:
        with rawrows.cursor(prepared=prepared_by_index()) as cursor:
            cursor.execute(sql, params)
            returned = cursor.fetchall()
    except IntegrityError:
        return fallback(writes, at)
    done = {row[0] for row in returned}
    added = {event_uuid(row[1]) for row in returned if row[1] is not None}
    unmade = [w for w in writes if w.ref.run_id not in done
              or (isinstance(w, EmitWrite) and w.event_id not in added)]
    again = dict(zip([w.ref.run_id for w in unmade], fallback(unmade, at), strict=True)) \
        if unmade else {}
    return [again.get(w.ref.run_id, Renewal.OK) for w in writes]


def _row(write: Write, at: datetime) -> tuple[Any, ...]:
    """`rawsql.fenced_alone`'s row for a write: a checkpoint's number, state and event
    (the one `batched` records for it), an emit's event, a renewal's lease alone."""
    ref = write.ref
    head = (ref.run_id, ref.attempt, ref.worker_id, ref.lease_until(at))
    if isinstance(write, CheckpointWrite):
        _, type_, payload, _, event_id = lifecycle(ref.run_id, CHECKPOINT, ref.attempt,
                                                   count=write.count)
        return (*head, write.count, write.state, event_id, type_, payload, write.max_events)
    if isinstance(write, EmitWrite):
        return (*head, None, None, write.event_id, write.type, write.payload,
                write.max_events)
    return (*head, None, None, None, None, None, None)


def event_uuid(value: Any) -> uuid.UUID:
    """An event id as RETURNING gives it: a UUID (PostgreSQL) or its hex (SQLite)."""
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
