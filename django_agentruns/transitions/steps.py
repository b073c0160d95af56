"""The writes of a durable step (`ctx.step`): its start and its end, each fenced.

A step's start renews the lease and answers whether the step is done already (then its
stored result is the answer, and the step is not executed); its end stores the result
(or the error) with the usage recorded inside it and one `run.step` event. Both are
fenced like an emit: a worker that lost the run records nothing, so a step it finished
after losing the lease is executed again by the run's new owner, never half-recorded. An
end whose start was never written (a fresh run's step, `runtime.steps`) inserts the
record whole.
"""

from __future__ import annotations

import functools
import json
import operator
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction
from django.db.models import Q

from ..conf import SETTING_NAME
from ..db import retry_on_lock
from ..exceptions import LimitExceeded
from ..models import RunEvent, RunStep
from ..outcomes import AttemptRef, Renewal, StepStart
from . import rawsql
from .attempts import _renew_locked
from .events import append_one, lifecycle, now

if TYPE_CHECKING:
    from .batched import Write

STEP = "run.step"
"""The timeline event of a finished step (done or failed)."""

DONE, FAILED, STARTED = RunStep.State.DONE, RunStep.State.FAILED, RunStep.State.STARTED
Event = tuple[int, str, dict[str, Any], int, uuid.UUID]


@dataclass(frozen=True)
class StepStartWrite:
    """A step about to execute: renew, then find its record or open one.

    `occurrence` None: the first call of `name` in this attempt, whose number is counted
    here (1 + the run's steps of that name started before checkpoint `checkpoint`, which
    an attempt resuming from that checkpoint does not call again)."""

    ref: AttemptRef
    name: str
    occurrence: int | None
    checkpoint: int
    max_steps: int


@dataclass(frozen=True)
class StepEndWrite:
    """A step's execution ended: its result (`done`) or its error, and its usage."""

    ref: AttemptRef
    name: str
    occurrence: int
    done: bool
    result: Any = None
    error: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0
    duration_ms: int = 0
    max_events: int | None = None
    checkpoint: int = 0
    started_at: datetime | None = None
    """For a step whose start was never written (see `close_steps`): its record's
    checkpoint count and start time."""
    result_json: str | None = None
    """`result` as JSON text, encoded already (`runtime.steps`): stored as it is, so an
    end written after the step returned stores what it returned, whatever the agent did
    to that value since."""


@dataclass(frozen=True)
class CarriedEnd:
    """A fresh run's step end held by its attempt (`runtime.steps`) and carried by the
    attempt's next write `then`: one queued write for both, applied in that order (the
    end's `run.step` event before `then`'s), each fenced as it would be alone."""

    end: StepEndWrite
    then: Write

    @property
    def ref(self) -> AttemptRef:
        return self.then.ref


def unpacked(writes: Sequence[Write]) -> tuple[list[Write], set[int], list[int]]:
    """`writes` with each `CarriedEnd` as its end, then its write; the positions of the
    carried ends; and the position of the write whose result answers each of `writes`."""
    flat: list[Write] = []
    carried: set[int] = set()
    answers: list[int] = []
    for write in writes:
        if isinstance(write, CarriedEnd):
            carried.add(len(flat))
            flat.append(write.end)
            write = write.then
        answers.append(len(flat))
        flat.append(write)
    return flat, carried, answers


def start_step_in(write: StepStartWrite, at: datetime) -> StepStart:
    """`StepStartWrite` alone, in the caller's transaction."""
    renewal = _renew_locked(write.ref, at)
    if renewal is not Renewal.OK:
        return StepStart(renewal)
    return open_steps([write], at)[0]


def open_steps(writes: Sequence[StepStartWrite], at: datetime) -> list[StepStart]:
    """The starts of steps whose fence held (renewed already), of distinct runs, in the
    caller's transaction. One INSERT opens every new step (the common case: nothing
    else is asked); for a step it could not insert, its record says whether it is done
    already (its result is the answer), started or failed before (opened again, same
    key), or missing: its run holds `max_steps` already (`LimitExceeded`)."""
    keys = [(w.ref.run_id, w.name, _occurrence(w)) for w in writes]
    sql, params = _insert_steps([(run, name, n, w.ref.attempt, w.checkpoint, w.max_steps)
                                 for w, (run, name, n) in zip(writes, keys, strict=True)], at)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        opened = {row[0] for row in cursor.fetchall()}
    rest = [(w, key) for w, key in zip(writes, keys, strict=True) if key[0] not in opened]
    found = {(r["run_id"], r["name"], r["occurrence"]): r for r in RunStep.objects.filter(
        functools.reduce(operator.or_, [Q(run_id=run, name=name, occurrence=n)
                                        for _, (run, name, n) in rest])).values(
        "run_id", "name", "occurrence", "status", "result", "replayed_from")} if rest else {}
    answers = {}
    for w, key in rest:
        row = found.get(key)
        if row is None:
            raise LimitExceeded(f"run {w.ref.run_id} holds {w.max_steps} steps, the most "
                                f"{SETTING_NAME}['MAX_STEPS_PER_RUN'] allows; the step "
                                f"{w.name!r} was not started")
        if row["status"] == DONE:
            answers[key] = StepStart(Renewal.OK, key[2], done=True, result=row["result"],
                                     replayed=row["replayed_from"] is not None)
            continue
        # Started or failed before: executed again, with the same key.
        RunStep.objects.filter(run_id=key[0], name=key[1], occurrence=key[2]).update(
            status=STARTED, attempt=w.ref.attempt, started_at=at, finished_at=None, error="")
    return [answers.get(key) or StepStart(Renewal.OK, key[2]) for key in keys]


_STEP_START = (("run_id", "bigint"), ("name", "varchar"), ("occurrence", "integer"),
               ("attempt", "integer"), ("checkpoint", "integer"), ("cap", "integer"))
_STEP_END = (("run_id", "bigint"), ("name", "varchar"), ("occurrence", "integer"),
             ("attempt", "integer"), ("status", "varchar"), ("result", "text"),
             ("error", "text"), ("input_tokens", "bigint"), ("output_tokens", "bigint"),
             ("cost", "double precision"), ("checkpoint", "integer"),
             ("started_at", "timestamptz"))
_ENDED = ("status", "result", "error", "input_tokens", "output_tokens", "cost", "finished_at")


def _insert_steps(rows: Sequence[tuple[Any, ...]], at: datetime) -> tuple[str, list[Any]]:
    """New steps' records, each only while its run holds fewer than its cap and none of
    that name and occurrence exists; returns the run ids of those inserted."""
    table = rawsql.qn(RunStep._meta.db_table)
    held = f"(SELECT COUNT(*) FROM {table} h WHERE h.run_id = v.run_id)"
    sql = (f"WITH v AS {rawsql.json_rows(_STEP_START)} INSERT INTO {table} (run_id, name, "
           f"occurrence, status, error, attempt, checkpoint, started_at, input_tokens, "
           f"output_tokens, cost) SELECT v.run_id, v.name, v.occurrence, %s, '', v.attempt, "
           f"v.checkpoint, %s, 0, 0, 0 FROM v WHERE {held} < v.cap "
           f"ON CONFLICT DO NOTHING RETURNING run_id")
    return sql, [rawsql.json_values(rows, [t for _, t in _STEP_START]), str(STARTED),
                 rawsql.prep(RunEvent, "created_at", at)]


def close_steps(writes: Sequence[StepEndWrite], at: datetime) -> list[Event]:
    """Store the ends of steps whose fence held, of distinct runs, in one statement; the
    `run.step` events of those recorded.

    An end updates its step's record where this attempt opened it (status started), or,
    for a step whose start was never written (`runtime.steps`: a fresh run's step that
    ended before its start was flushed), inserts it whole: one row for the step's start
    and end. A record of another attempt, or one already ended, is left as it is, and
    that end is not recorded (no event)."""
    table = rawsql.qn(RunStep._meta.db_table)
    rows = [(w.ref.run_id, w.name, w.occurrence, w.ref.attempt, str(DONE if w.done else FAILED),
             _result_text(w), w.error, w.input_tokens, w.output_tokens, w.cost,
             w.checkpoint, w.started_at or at)
            for w in writes]
    as_json = "::jsonb" if connection.vendor == "postgresql" else ""
    sets = ", ".join(f"{c} = excluded.{c}" for c in _ENDED)
    sql = (f"WITH v AS {rawsql.json_rows(_STEP_END)} INSERT INTO {table} (run_id, name, "
           f"occurrence, attempt, checkpoint, started_at, {', '.join(_ENDED)}) "
           f"SELECT v.run_id, v.name, v.occurrence, v.attempt, v.checkpoint, v.started_at, "
           f"v.status, v.result{as_json}, v.error, v.input_tokens, v.output_tokens, v.cost, %s "
           f"FROM v WHERE true ON CONFLICT (run_id, name, occurrence) DO UPDATE SET {sets} "
           f"WHERE {table}.attempt = excluded.attempt AND {table}.status = %s "
           f"RETURNING run_id")
    with connection.cursor() as cursor:
        cursor.execute(sql, [rawsql.json_values(rows, [t for _, t in _STEP_END]),
                             rawsql.prep(RunEvent, "created_at", at), str(STARTED)])
        closed = {row[0] for row in cursor.fetchall()}
    return [_event(w) for w in writes if w.ref.run_id in closed]


def _result_text(write: StepEndWrite) -> str | None:
    """The result to store, as JSON text (SQL NULL for none, or for JSON null, as the
    JSON column stores None)."""
    if not write.done:
        return None
    text = json.dumps(write.result) if write.result_json is None else write.result_json
    return None if text == "null" else text


def _occurrence(write: StepStartWrite) -> int:
    """The write's occurrence; for the first call of its name in an attempt resumed from a
    checkpoint, 1 + the run's steps of that name started before it (rare: one COUNT)."""
    if write.occurrence is not None:
        return write.occurrence
    if not write.checkpoint:
        return 1
    return 1 + RunStep.objects.filter(run_id=write.ref.run_id, name=write.name,
                                      checkpoint__lt=write.checkpoint).count()


def end_step_in(write: StepEndWrite, at: datetime) -> Renewal:
    """`StepEndWrite` alone, in the caller's transaction: nothing if the lease is lost. A
    cancel request does not keep a finished step from being recorded (it is not executed
    again by a retry the operator may make)."""
    renewal = _renew_locked(write.ref, at)
    if renewal is Renewal.LOST:
        return renewal
    for event in close_steps([write], at):
        # Past MAX_EVENTS_PER_RUN the marker is left out: the step's record is what counts.
        append_one(event, at, below=write.max_events)
    return renewal


def _event(write: StepEndWrite) -> Event:
    payload: dict[str, Any] = {"name": write.name, "occurrence": write.occurrence,
                               "status": str(DONE if write.done else FAILED),
                               "duration_ms": write.duration_ms}
    if write.error:
        payload["error"] = write.error[:500]
    if write.input_tokens or write.output_tokens or write.cost:
        payload.update(tokens=write.input_tokens + write.output_tokens, cost=write.cost)
    return lifecycle(write.ref.run_id, STEP, write.ref.attempt, **payload)


@retry_on_lock()
def start_step(write: StepStartWrite, at: datetime | None = None) -> StepStart:
    with transaction.atomic():
        return start_step_in(write, at or now())


@retry_on_lock()
def end_step(write: StepEndWrite, at: datetime | None = None) -> Renewal:
    with transaction.atomic():
        return end_step_in(write, at or now())
