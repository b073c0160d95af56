"""An attempt's writes as values, applied many at a time inside the caller's transaction.

The worker's attempt store (`django_agentruns.store`) commits the writes of many attempts
together. Here they are applied without a savepoint each (nested `atomic()` blocks would
cost a SAVEPOINT and a RELEASE round trip per write) and by kind, not one by one: every
renewal and emit of a batch share one fenced UPDATE, every checkpoint one, every success
one more, and all their events one INSERT. Each write keeps its own fence: one whose
attempt lost the run comes back `Renewal.LOST` / `Settlement.LOST`, never an exception,
and the rest go on.
"""

from __future__ import annotations

import functools
import operator
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection

from ..models import AgentRun, Reason, Status
from ..outcomes import AttemptRef, Renewal, Settlement
from . import rawsql
from .events import CHECKPOINT, SUCCEEDED, lifecycle, lifecycle_event_id, now
from .settling import _announce_succeeded
from .waiting import children_settled


@dataclass(frozen=True)
class RenewWrite:
    """A heartbeat: extend the lease; `Renewal` says whether the attempt may go on."""

    ref: AttemptRef


@dataclass(frozen=True)
class EmitWrite:
    """Renew, then append one event unless its id is stored already (as `emit`)."""

    ref: AttemptRef
    event_id: uuid.UUID
    type: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class CheckpointWrite:
    """Save resume state as checkpoint number `count`, renewing the lease (as `checkpoint`)."""

    ref: AttemptRef
    state: Any
    count: int


@dataclass(frozen=True)
class SucceedWrite:
    """The attempt's success with its output (as `settle_succeeded`)."""

    ref: AttemptRef
    output: Any


Write = RenewWrite | EmitWrite | CheckpointWrite | SucceedWrite
Result = Renewal | Settlement
Event = tuple[int, str, dict[str, Any], int, uuid.UUID]


def apply_writes(writes: Sequence[Write], at: datetime | None = None) -> list[Result]:
    """Apply `writes` in the current transaction; one result per write, in order.

    Must run inside `transaction.atomic()` (the caller commits them together). The effect
    is that of applying them one after another: writes to distinct runs are applied
    together, and a second write to a run starts a new round after the first.
    """
    if not connection.in_atomic_block:
        raise RuntimeError("apply_writes runs inside the caller's transaction")
    at = at or now()
    results: list[Result | None] = [None] * len(writes)
    round_: list[int] = []
    runs: set[int] = set()
    for i, write in enumerate(writes):
        if write.ref.run_id in runs:
            _apply_round(writes, round_, results, at)
            round_, runs = [], set()
        round_.append(i)
        runs.add(write.ref.run_id)
    _apply_round(writes, round_, results, at)
    done = [r for r in results if r is not None]
    assert len(done) == len(writes), "every write has its result"
    return done


def _apply_round(writes: Sequence[Write], positions: list[int],
                 results: list[Result | None], at: datetime) -> None:
    """Writes to distinct runs: no order among them matters."""
    if not positions:
        return
    events: list[Event] = []
    renewing = [i for i in positions if isinstance(writes[i], RenewWrite | EmitWrite)]
    for i in _fenced(writes, renewing, results, [(LEASE, TIMESTAMP)],
                     lambda w: (w.ref.lease_until(at),)):
        write = writes[i]
        if isinstance(write, EmitWrite):
            events.append((write.ref.run_id, write.type, write.payload, write.ref.attempt,
                           write.event_id))
    pointing = [i for i in positions if isinstance(writes[i], CheckpointWrite)]
    saved = _fenced(writes, pointing, results, CHECKPOINT_FIELDS,
                    lambda w: (w.ref.lease_until(at), *_state(w)))
    for i in saved:
        ref, count = writes[i].ref, _state(writes[i])[1]
        events.append(lifecycle(ref.run_id, CHECKPOINT, ref.attempt, count=count))
    if saved:
        # Every checkpoint's state is kept (`fork` starts from one), in this transaction.
        sql, params = rawsql.insert_checkpoints(
            [(writes[i].ref.run_id, *_state(writes[i])) for i in saved], at)
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
    succeeding = [i for i in positions if isinstance(writes[i], SucceedWrite)]
    ended = _succeed(writes, succeeding, results, at)
    if events or ended:
        sql, params = rawsql.insert_new_events(events + ended, at)
        with connection.cursor() as cursor:
            cursor.execute(sql, params)


def _state(write: Write) -> tuple[Any, int]:
    assert isinstance(write, CheckpointWrite)
    return write.state, write.count


LEASE, TIMESTAMP = "lease_expires", "timestamptz"
CHECKPOINT_FIELDS = [(LEASE, TIMESTAMP), ("checkpoint_state", "jsonb"),
                     ("checkpoint_count", "integer")]


def _fenced(writes: Sequence[Write], positions: list[int], results: list[Result | None],
            fields: list[tuple[str, str]], values: Callable[[Write], tuple[Any, ...]],
            ) -> list[int]:
    """One fenced UPDATE for the writes at `positions`, setting `fields` to `values(write)`;
    records each one's Renewal and returns the positions whose fence held."""
    if not positions:
        return []
    refs = {i: writes[i].ref for i in positions}
    sql, params = rawsql.fenced_update(
        [(r.run_id, r.attempt, r.worker_id, *values(writes[i])) for i, r in refs.items()],
        Status.RUNNING, fields)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        done = {row[0] for row in cursor.fetchall()}
    missed = [r for r in refs.values() if r.run_id not in done]
    # Rare: a cancel request (the fence holds) or a lost lease (it does not).
    fenced = set(AgentRun.objects.filter(
        functools.reduce(operator.or_, [r.guard() for r in missed])).values_list(
            "pk", flat=True)) if missed else set()
    for i, ref in refs.items():
        results[i] = Renewal.OK if ref.run_id in done else \
            Renewal.CANCEL_REQUESTED if ref.run_id in fenced else Renewal.LOST
    return [i for i in positions if refs[i].run_id in done]


def _succeed(writes: Sequence[Write], positions: list[int], results: list[Result | None],
             at: datetime) -> list[Event]:
    """One fenced UPDATE per worker for the successes (settle_succeeded_many's two-statement
    form: its one-statement form may collide on a seq, which would abort the whole batch);
    returns their end events, for the round's INSERT."""
    by_worker: dict[str, list[int]] = {}
    for i in positions:
        by_worker.setdefault(writes[i].ref.worker_id, []).append(i)
    ended: list[Event] = []
    for worker_id, group in by_worker.items():
        items = [(w.ref, w.output) for w in (writes[i] for i in group)
                 if isinstance(w, SucceedWrite)]
        rows = [(ref.run_id, ref.attempt, output, lifecycle_event_id()) for ref, output in items]
        sql, params = rawsql.settle_succeeded(rows, worker_id, Status.RUNNING, Status.SUCCEEDED,
                                              Reason.COMPLETED, SUCCEEDED, at,
                                              with_events=False)
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            done = {row[0] for row in cursor.fetchall()}
        ended += [(run_id, SUCCEEDED, {}, attempt, event_id)
                  for run_id, attempt, _, event_id in rows if run_id in done]
        children_settled(done, at)
        _announce_succeeded(items, done)
        for i, (ref, _) in zip(group, items, strict=True):
            results[i] = Settlement.SUCCEEDED if ref.run_id in done else Settlement.LOST
    return ended
