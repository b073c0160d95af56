"""The writes of a durable step (`ctx.step`): its start and its end, each fenced.

A step's start renews the lease and answers whether the step is done already (then its
stored result is the answer, and the step is not executed); its end stores the result
(or the error) with the usage recorded inside it and one `run.step` event. Both are
fenced like an emit: a worker that lost the run records nothing, so a step it finished
after losing the lease is executed again by the run's new owner, never half-recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction

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
    """`StepStartWrite` in the caller's transaction."""
    ref = write.ref
    renewal = _renew_locked(ref, at)
    if renewal is not Renewal.OK:
        return StepStart(renewal)
    occurrence = write.occurrence
    if occurrence is None:
        occurrence = 1 + (RunStep.objects.filter(
            run_id=ref.run_id, name=write.name, checkpoint__lt=write.checkpoint).count()
            if write.checkpoint else 0)
    mine = RunStep.objects.filter(run_id=ref.run_id, name=write.name, occurrence=occurrence)
    row = mine.values("status", "result", "replayed_from").first()
    if row is not None and row["status"] == DONE:
        return StepStart(Renewal.OK, occurrence, done=True, result=row["result"],
                         replayed=row["replayed_from"] is not None)
    if row is not None:  # started or failed before: executed again, same key
        mine.update(status=STARTED, attempt=ref.attempt, started_at=at, finished_at=None,
                    error="")
        return StepStart(Renewal.OK, occurrence)
    if RunStep.objects.filter(run_id=ref.run_id).count() >= write.max_steps:
        raise LimitExceeded(f"run {ref.run_id} holds {write.max_steps} steps, the most "
                            f"{SETTING_NAME}['MAX_STEPS_PER_RUN'] allows; the step "
                            f"{write.name!r} was not started")
    RunStep.objects.create(run_id=ref.run_id, name=write.name, occurrence=occurrence,
                           status=STARTED, attempt=ref.attempt, checkpoint=write.checkpoint,
                           started_at=at)
    return StepStart(Renewal.OK, occurrence)


def end_step_in(write: StepEndWrite, at: datetime) -> Renewal:
    """`StepEndWrite` in the caller's transaction: nothing if the lease is lost. A cancel
    request does not keep a finished step from being recorded (it is not executed again
    by a retry the operator may make)."""
    ref = write.ref
    renewal = _renew_locked(ref, at)
    if renewal is Renewal.LOST:
        return renewal
    updated = RunStep.objects.filter(
        run_id=ref.run_id, name=write.name, occurrence=write.occurrence, status=STARTED,
        attempt=ref.attempt,
    ).update(status=DONE if write.done else FAILED, result=write.result if write.done else None,
             error=write.error, finished_at=at, input_tokens=write.input_tokens,
             output_tokens=write.output_tokens, cost=write.cost)
    if updated:
        payload: dict[str, Any] = {"name": write.name, "occurrence": write.occurrence,
                                   "status": str(DONE if write.done else FAILED),
                                   "duration_ms": write.duration_ms}
        if write.error:
            payload["error"] = write.error[:500]
        if write.input_tokens or write.output_tokens or write.cost:
            payload.update(tokens=write.input_tokens + write.output_tokens, cost=write.cost)
        # Past MAX_EVENTS_PER_RUN the marker is left out: the step's record is what counts.
        append_one(lifecycle(ref.run_id, STEP, ref.attempt, **payload), at,
                   below=write.max_events)
    return renewal


@retry_on_lock()
def start_step(write: StepStartWrite, at: datetime | None = None) -> StepStart:
    with transaction.atomic():
        return start_step_in(write, at or now())


@retry_on_lock()
def end_step(write: StepEndWrite, at: datetime | None = None) -> Renewal:
    with transaction.atomic():
        return end_step_in(write, at or now())
