"""How an attempt ends: succeeded, requeued, dead-lettered, cancelled, or abandoned (also
by the reaper, for a lease that lapsed)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models import F, Q

from .. import signals
from ..conf import app_settings
from ..db import is_postgres, retry_on_lock
from ..models import AgentRun, Reason, RunEvent, RunPayload, Status
from ..outcomes import AttemptRef, DecisionAction, ErrorInfo, Settlement
from ..rules import policy
from ..signals import send_after_commit
from . import children, hot_sql, rawrows, rawsql
from .due import CLAIM_FIELDS, lapsed
from .events import (
    ABANDONED,
    CANCELLED,
    DEAD_LETTERED,
    INTERRUPTED,
    RETRYING,
    SUCCEEDED,
    append_events,
    lifecycle,
    lifecycle_event_id,
    now,
)


def settle_succeeded(ref: AttemptRef, output: Any, at: datetime | None = None) -> Settlement:
    return settle_succeeded_many(ref.worker_id, [(ref, output)], at)[ref]


@retry_on_lock()
def settle_succeeded_many(
    worker_id: str, items: Sequence[tuple[AttemptRef, Any]], at: datetime | None = None
) -> dict[AttemptRef, Settlement]:
    """Record successful attempts of one worker, any count: one statement on PostgreSQL
    (outside a caller's transaction), else one transaction of two.

    Each run is fenced on its own (status, worker, attempt), so one lost lease in a batch
    costs only that run its write.
    """
    at = at or now()
    if not items:
        return {}
    if len({ref.run_id for ref, _ in items}) != len(items) or \
            any(ref.worker_id != worker_id for ref, _ in items):
        raise ValueError("a batch settles distinct runs of one worker")
    rows = [(ref.run_id, ref.attempt, output, lifecycle_event_id()) for ref, output in items]
    settled: dict[int, int | None] | None = None
    if is_postgres() and not connection.in_atomic_block:
        # One statement, committed on its own: the UPDATE and the end events together.
        settled = _succeed_in_one_statement(worker_id, rows, at)
    if settled is None:
        sql, params = hot_sql.settle_succeeded(rows, worker_id, Status.RUNNING, Status.SUCCEEDED,
                                              Reason.COMPLETED, SUCCEEDED, at,
                                              with_events=False)
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                settled = dict(cursor.fetchall())
                outputs = insert_outputs(rows, settled, at)
                if outputs is not None:
                    cursor.execute(*outputs)
            append_events([(run_id, SUCCEEDED, {}, attempt, event_id)
                            for run_id, attempt, _, event_id in rows if run_id in settled], at)
            children.parents_settled(settled.values(), at)
            _announce_succeeded(items, set(settled))
    else:
        # Committed already: parents waiting on these runs are resumed just after (and by
        # the reaper, should this worker die in between).
        children.resume_parents(settled.values(), at)
        _announce_succeeded(items, set(settled))
    done = set(settled)
    return {ref: Settlement.SUCCEEDED if ref.run_id in done else Settlement.LOST
            for ref, _ in items}


def _succeed_in_one_statement(
    worker_id: str, rows: list[tuple[int, int, Any, uuid.UUID]], at: datetime
) -> dict[int, int | None] | None:
    """None when an event of these runs was appended after the statement's snapshot (an
    operator's cancel request, racing): its seq collided, nothing was written, and the
    caller writes in two statements instead, the second seeing that event."""
    sql, params = hot_sql.settle_succeeded(rows, worker_id, Status.RUNNING, Status.SUCCEEDED,
                                          Reason.COMPLETED, SUCCEEDED, at, with_events=True)
    try:
        with rawrows.cursor(prepared=bool(app_settings.PREPARED_STATEMENTS)) as cursor:
            cursor.execute(sql, params)
            return dict(cursor.fetchall())  # id: parent_id
    except IntegrityError:
        return None


def insert_outputs(rows: Sequence[tuple[int, int, Any, Any]], settled: Any,
                   at: datetime) -> tuple[str, list[Any]] | None:
    """The output payload rows of the settled runs among `settle_succeeded`'s rows, for
    its form without events (SQLite, a caller's transaction); None: no output to store."""
    kept = [(run_id, output) for run_id, _, output, _ in rows
            if output is not None and run_id in settled]
    if not kept:
        return None
    table = rawsql.qn(RunPayload._meta.db_table)
    sql = (f"WITH v AS {rawsql.json_rows((('run_id', 'bigint'), ('value', 'jsonb')))} "
           f"INSERT INTO {table} (run_id, kind, value, created_at) "
           f"SELECT v.run_id, %s, v.value, %s FROM v")
    return sql, [rawsql.json_values(kept, ("bigint", "jsonb")), RunPayload.OUTPUT,
                 rawsql.prep(RunEvent, "created_at", at)]


def _announce_succeeded(items: Sequence[tuple[AttemptRef, Any]], done: set[int]) -> None:
    for ref, _ in items:
        if ref.run_id in done:
            send_after_commit(signals.run_succeeded, run_id=ref.run_id, agent=ref.agent,
                              attempt=ref.attempt)


@retry_on_lock()
def settle_failed(
    ref: AttemptRef, failure: policy.Failure, error: ErrorInfo,
    at: datetime | None = None, *, interactive: bool = False,
) -> Settlement:
    """A failed attempt: retried with backoff, dead-lettered, or cancelled if one was asked."""
    def settle(row: dict[str, Any], at: datetime) -> Settlement:
        if interactive:
            decision = policy.Decision(DecisionAction.DEAD_LETTER, reason=Reason.ERROR)
        else:
            decision = _decide(row, failure)
        return _apply(row, ref.guard(), decision, error, at, events=[])

    return settle_fenced(ref, at, settle)


@retry_on_lock()
def settle_cancelled(ref: AttemptRef, at: datetime | None = None) -> Settlement:
    """The attempt stopped because a cancel was requested."""
    return settle_fenced(ref, at, lambda row, at: _apply(
        row, ref.guard(), policy.Decision(DecisionAction.CANCEL), None, at, events=[]))


@retry_on_lock()
def abandon(ref: AttemptRef, why: str, at: datetime | None = None) -> Settlement:
    """The worker gave up its own attempt (graceful stop): a failed attempt, as if it died."""
    return settle_fenced(ref, at, lambda row, at: _settlement(
        abandon_locked(row, ref.guard(), at, why=why, apply_backoff=True)))


# Interruptions a run gets free; past them one counts as an abandoned attempt, so a run
# whose writes break the connection every time cannot loop forever (guarantee 4).
FREE_INTERRUPTIONS = 10


@retry_on_lock()
def interrupt(ref: AttemptRef, why: str, at: datetime | None = None) -> Settlement:
    """The engine, not the agent, failed (its database stayed out of reach): requeue the
    run at once without spending its budget. A requested cancel still wins."""
    def settle(row: dict[str, Any], at: datetime) -> Settlement:
        if row["cancel_requested_at"] is not None:
            return _apply(row, ref.guard(), policy.Decision(DecisionAction.CANCEL), None, at,
                          events=[])
        if RunEvent.objects.filter(run_id=ref.run_id, type=INTERRUPTED).count() \
                >= FREE_INTERRUPTIONS:
            decision = abandon_locked(row, ref.guard(), at, why=why, apply_backoff=True)
            return _settlement(decision)
        if not AgentRun.objects.filter(ref.guard()).update(
                status=Status.QUEUED, available_at=at, claimed_by="", lease_expires=None):
            return Settlement.LOST
        append_events([lifecycle(ref.run_id, INTERRUPTED, ref.attempt, why=why,
                                 worker=ref.worker_id)], at)
        send_after_commit(signals.run_requeued, run_id=ref.run_id, agent=row["agent"],
                          attempt=ref.attempt, delay=0.0, error_type="")
        return Settlement.REQUEUED

    return settle_fenced(ref, at, settle)


def settle_fenced(ref: AttemptRef, at: datetime | None,
                  settle: Callable[[dict[str, Any], datetime], Settlement]) -> Settlement:
    """The opening every settle of an attempt shares: one transaction, the run's row
    locked while this attempt still holds it, then `settle(row, at)`; LOST, with nothing
    written, when the fence matches nothing (the lease lapsed, another attempt took it)."""
    at = at or now()
    with transaction.atomic():
        row = locked_row(ref.guard())
        if row is None:
            return Settlement.LOST
        return settle(row, at)


def locked_row(guard: Q) -> dict[str, Any] | None:
    qs = AgentRun.objects.filter(guard)
    if is_postgres():
        qs = qs.select_for_update()
    row: dict[str, Any] | None = qs.values(*CLAIM_FIELDS).first()
    return row


def _decide(row: dict[str, Any], failure: policy.Failure) -> policy.Decision:
    return policy.decide(
        failure,
        requeue_count=row["requeue_count"],
        max_requeues=row["max_requeues"],
        cancel_requested=row["cancel_requested_at"] is not None,
        backoff_delay=lambda n: policy.backoff(
            n, base=float(app_settings.BACKOFF_BASE), cap=float(app_settings.BACKOFF_CAP),
            jitter=float(app_settings.BACKOFF_JITTER)),
    )


def abandon_locked(
    row: dict[str, Any], guard: Q, at: datetime, *, why: str, apply_backoff: bool
) -> policy.Decision | None:
    """Record a lost attempt as a failed one, then requeue, dead-letter or cancel it.

    `guard` is re-checked inside the UPDATE (the reaper's staleness check), so a
    heartbeat or settle that landed since the row was read wins, and this does nothing.
    """
    decision = _decide(row, policy.Failure(retryable=True))
    if decision.action is DecisionAction.RETRY and not apply_backoff:
        decision = policy.Decision(DecisionAction.RETRY, delay=0.0)
    error = ErrorInfo("AbandonedAttempt", f"the attempt was abandoned: {why}", "")
    events = [lifecycle(row["id"], ABANDONED, row["attempt"], why=why,
                         worker=row["claimed_by"])]
    result = _apply(row, Q(pk=row["id"], status=Status.RUNNING, attempt=row["attempt"]) & guard,
                    decision, error, at, events=events)
    return None if result is Settlement.LOST else decision


def keep_traceback(run_id: int, traceback: str, at: datetime) -> None:
    """The error's traceback as the run's latest traceback payload, in the transaction that
    records the error (the run row keeps only type and message). An error without one (an
    abandoned attempt) clears an earlier one, as the column it replaces did; a run that
    never had one is left without a row."""
    if traceback or RunPayload.objects.filter(run_id=run_id, kind=RunPayload.TRACEBACK).exists():
        RunPayload.objects.create(run_id=run_id, kind=RunPayload.TRACEBACK, value=traceback,
                                  created_at=at)


def _apply(
    row: dict[str, Any], guard: Q, decision: policy.Decision, error: ErrorInfo | None,
    at: datetime, *, events: list[tuple[int, str, dict[str, Any], int, uuid.UUID]],
) -> Settlement:
    run_id, attempt = row["id"], row["attempt"]
    errors = {} if error is None else {
        "error_type": error.type[:255], "error_message": error.message}
    described = {} if error is None else {"error_type": error.type,
                                            "message": error.message[:2000]}
    if decision.action is DecisionAction.RETRY:
        fields: dict[str, Any] = {
            "status": Status.QUEUED, "requeue_count": F("requeue_count") + 1,
            "available_at": at + timedelta(seconds=decision.delay),
            "claimed_by": "", "lease_expires": None, **errors}
        events.append(lifecycle(run_id, RETRYING, attempt, delay=round(decision.delay, 3),
                                 requeue=row["requeue_count"] + 1, **described))
        settlement = Settlement.REQUEUED
    elif decision.action is DecisionAction.CANCEL:
        fields = {"status": Status.CANCELLED, "reason": Reason.CANCELLED, "finished_at": at,
                  "lease_expires": None, **errors}
        events.append(lifecycle(run_id, CANCELLED, attempt, reason=row["cancel_reason"]))
        settlement = Settlement.CANCELLED
    else:
        fields = {"status": Status.FAILED, "reason": decision.reason, "finished_at": at,
                  "lease_expires": None, **errors}
        events.append(lifecycle(run_id, DEAD_LETTERED, attempt, reason=decision.reason,
                                 **described))
        settlement = Settlement.DEAD_LETTERED
    if not AgentRun.objects.filter(guard).update(**fields):
        return Settlement.LOST
    if error is not None:
        keep_traceback(run_id, error.traceback, at)
    append_events(events, at)
    if settlement is not Settlement.REQUEUED:
        children.children_settled([run_id], at)
    announce = {"run_id": run_id, "agent": row["agent"], "attempt": attempt}
    error_type = error.type if error else ""
    if settlement is Settlement.REQUEUED:
        send_after_commit(signals.run_requeued, **announce, delay=decision.delay,
                          error_type=error_type)
    elif settlement is Settlement.CANCELLED:
        send_after_commit(signals.run_cancelled, **announce, reason=row["cancel_reason"])
    else:
        send_after_commit(signals.run_dead_lettered, **announce, reason=decision.reason,
                          error_type=error_type)
    return settlement


def _settlement(decision: policy.Decision | None) -> Settlement:
    if decision is None:
        return Settlement.LOST
    return _SETTLEMENTS[decision.action]


_SETTLEMENTS = {DecisionAction.RETRY: Settlement.REQUEUED,
                DecisionAction.CANCEL: Settlement.CANCELLED,
                DecisionAction.DEAD_LETTER: Settlement.DEAD_LETTERED}


# --------------------------------------------------------------------------- reaper


def find_stale(at: datetime, limit: int, run_ids: list[int] | None = None) -> list[dict[str, Any]]:
    """Running runs whose lease lapsed (interactive runs hold none and never appear); of
    `run_ids` only, if given (an operator's "reap now")."""
    stale = lapsed(None, at)
    if run_ids is not None:
        stale = stale.filter(pk__in=run_ids)
    return list(stale.order_by("lease_expires").values(*CLAIM_FIELDS)[:limit])


@retry_on_lock()
def reap_one(row: dict[str, Any], at: datetime) -> Settlement:
    """Reclaim one stale run, re-checking inside the UPDATE that it is still stale."""
    with transaction.atomic():
        stale = Q(lease_expires__lt=at, claimed_by=row["claimed_by"])
        fresh = locked_row(Q(pk=row["id"], status=Status.RUNNING, attempt=row["attempt"]) & stale)
        if fresh is None:
            return Settlement.LOST
        decision = abandon_locked(fresh, stale, at, why="lease lapsed", apply_backoff=True)
        settlement = _settlement(decision)
        if settlement is not Settlement.LOST:
            send_after_commit(signals.run_reaped, run_id=row["id"], agent=row["agent"],
                              attempt=row["attempt"], outcome=settlement.value)
    return settlement
