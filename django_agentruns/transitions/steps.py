"""The writes of a durable step (`ctx.step`): its start and its end, each fenced.

A step's start renews the lease and answers whether the step is done already (then its
stored result is the answer, and the step is not executed); its end stores the result
(or the error) with the usage recorded inside it and one `run.step` event. Both are
fenced like an emit: a worker that lost the run records nothing, so a step it finished
after losing the lease is executed again by the run's new owner, never half-recorded.
"""

from __future__ import annotations

import functools
import operator
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Count, Q

from ..conf import SETTING_NAME
from ..db import retry_on_lock
from ..exceptions import LimitExceeded
from ..models import RunStep
from ..outcomes import AttemptRef, Renewal, StepStart
from .attempts import _renew_locked
from .events import append_one, lifecycle, now

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


def start_step_in(write: StepStartWrite, at: datetime) -> StepStart:
    """`StepStartWrite` alone, in the caller's transaction."""
    renewal = _renew_locked(write.ref, at)
    if renewal is not Renewal.OK:
        return StepStart(renewal)
    return open_steps([write], at)[0]


def open_steps(writes: Sequence[StepStartWrite], at: datetime) -> list[StepStart]:
    """The starts of steps whose fence held (renewed already), of distinct runs, in the
    caller's transaction: a few statements for all of them, however many. A step done
    already answers its result; one started or failed before is opened again (same key);
    a new one is inserted, unless its run holds `max_steps` already (`LimitExceeded`)."""
    keys = [(w.ref.run_id, w.name, _occurrence(w)) for w in writes]
    found = {(r["run_id"], r["name"], r["occurrence"]): r for r in RunStep.objects.filter(
        functools.reduce(operator.or_, [Q(run_id=run, name=name, occurrence=n)
                                        for run, name, n in keys])).values(
        "run_id", "name", "occurrence", "status", "result", "replayed_from")}
    new = [(w, key) for w, key in zip(writes, keys, strict=True) if key not in found]
    if new:
        held = dict(RunStep.objects.filter(run_id__in=[w.ref.run_id for w, _ in new])
                    .order_by().values_list("run_id").annotate(n=Count("id")))
        for w, _ in new:
            if held.get(w.ref.run_id, 0) >= w.max_steps:
                raise LimitExceeded(f"run {w.ref.run_id} holds {w.max_steps} steps, the most "
                                    f"{SETTING_NAME}['MAX_STEPS_PER_RUN'] allows; the step "
                                    f"{w.name!r} was not started")
        RunStep.objects.bulk_create([
            RunStep(run_id=run, name=name, occurrence=n, status=STARTED, attempt=w.ref.attempt,
                    checkpoint=w.checkpoint, started_at=at) for w, (run, name, n) in new])
    answers = []
    for w, key in zip(writes, keys, strict=True):
        row = found.get(key)
        if row is not None and row["status"] == DONE:
            answers.append(StepStart(Renewal.OK, key[2], done=True, result=row["result"],
                                     replayed=row["replayed_from"] is not None))
            continue
        if row is not None:  # started or failed before: executed again, same key
            RunStep.objects.filter(run_id=key[0], name=key[1], occurrence=key[2]).update(
                status=STARTED, attempt=w.ref.attempt, started_at=at, finished_at=None,
                error="")
        answers.append(StepStart(Renewal.OK, key[2]))
    return answers


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
    event = close_step(write, at)
    if event is not None:
        # Past MAX_EVENTS_PER_RUN the marker is left out: the step's record is what counts.
        append_one(event, at, below=write.max_events)
    return renewal


def close_step(write: StepEndWrite, at: datetime) -> Event | None:
    """Store a step's end whose fence held; its `run.step` event to append, if recorded."""
    ref = write.ref
    updated = RunStep.objects.filter(
        run_id=ref.run_id, name=write.name, occurrence=write.occurrence, status=STARTED,
        attempt=ref.attempt,
    ).update(status=DONE if write.done else FAILED, result=write.result if write.done else None,
             error=write.error, finished_at=at, input_tokens=write.input_tokens,
             output_tokens=write.output_tokens, cost=write.cost)
    if not updated:
        return None
    payload: dict[str, Any] = {"name": write.name, "occurrence": write.occurrence,
                               "status": str(DONE if write.done else FAILED),
                               "duration_ms": write.duration_ms}
    if write.error:
        payload["error"] = write.error[:500]
    if write.input_tokens or write.output_tokens or write.cost:
        payload.update(tokens=write.input_tokens + write.output_tokens, cost=write.cost)
    return lifecycle(ref.run_id, STEP, ref.attempt, **payload)


@retry_on_lock()
def start_step(write: StepStartWrite, at: datetime | None = None) -> StepStart:
    with transaction.atomic():
        return start_step_in(write, at or now())


@retry_on_lock()
def end_step(write: StepEndWrite, at: datetime | None = None) -> Renewal:
    with transaction.atomic():
        return end_step_in(write, at or now())
