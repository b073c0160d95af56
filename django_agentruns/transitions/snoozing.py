"""A snoozed attempt: back to the queue after a delay, its requeue budget untouched; and
an attempt's recorded usage (tokens, cost), fenced like every attempt write."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import F, Field

from .. import signals
from ..conf import app_settings
from ..db import is_postgres, retry_on_lock
from ..models import AgentRun, Reason, RunUsage, Status
from ..outcomes import (
    AttemptRef,
    DecisionAction,
    ErrorInfo,
    Renewal,
    Settlement,
    UsageTotals,
)
from ..rules import policy
from ..signals import send_after_commit
from .attempts import _renew_locked
from .due import CLAIM_FIELDS
from .events import SNOOZED, USAGE, append_events, append_one, lifecycle, now
from .limited import close_key, failover_key
from .settling import _apply, _decide, settle_fenced
from .windows import add_usage


@retry_on_lock()
def snooze(
    ref: AttemptRef, failure: policy.Failure, error: ErrorInfo, at: datetime | None = None
) -> Settlement:
    """Requeue the run after `failure.delay` without spending its budget (`run.snoozed`);
    past MAX_SNOOZES, as an ordinary retry. A 429 also closes the run's limit key for every
    worker until then. A requested cancel wins."""
    at = at or now()
    delay = policy.bounded_delay(failure.delay) or 0.0
    with transaction.atomic():
        qs = AgentRun.objects.filter(ref.guard())
        if is_postgres():
            qs = qs.select_for_update()
        row: dict[str, Any] | None = qs.values(*CLAIM_FIELDS, "snooze_count", "limit_key",
                                               "limit_keys").first()
        if row is None:
            return Settlement.LOST
        moved: dict[str, Any] = {}
        if failure.closes_key and row["limit_key"]:
            close_key(row["limit_key"], at + timedelta(seconds=delay),
                      f"{failure.cause} on run {ref.run_id}", at)
            other = failover_key(row["limit_keys"], row["limit_key"], at)
            if other is not None:  # the retry takes the next open key, at once
                moved, delay = {"limit_key": other}, 0.0
        if row["cancel_requested_at"] is not None \
                or row["snooze_count"] >= int(app_settings.MAX_SNOOZES):
            return _apply(row, ref.guard(), _decide(row, failure), error, at, events=[])
        if not AgentRun.objects.filter(ref.guard()).update(
                status=Status.QUEUED, snooze_count=F("snooze_count") + 1,
                available_at=at + timedelta(seconds=delay), claimed_by="", lease_expires=None,
                **moved):
            return Settlement.LOST
        append_events([lifecycle(ref.run_id, SNOOZED, ref.attempt, delay=round(delay, 3),
                                 cause=failure.cause, snoozes=row["snooze_count"] + 1,
                                 error_type=error.type, message=error.message[:500])], at)
        send_after_commit(signals.run_requeued, run_id=ref.run_id, agent=row["agent"],
                          attempt=ref.attempt, delay=delay, error_type=error.type)
    return Settlement.REQUEUED


@retry_on_lock()
def record_usage(
    ref: AttemptRef, input_tokens: int, output_tokens: int, cost: float, model: str,
    at: datetime | None = None, *, max_events: int | None = None, seq: int | None = None,
) -> UsageTotals:
    """Add to the run's totals and append a `run.usage` event, renewing the lease (a step
    boundary), in a transaction of its own; see `record_usage_in`."""
    with transaction.atomic():
        return record_usage_in(ref, input_tokens, output_tokens, cost, model, at or now(),
                               max_events=max_events, seq=seq)


def record_usage_in(
    ref: AttemptRef, input_tokens: int, output_tokens: int, cost: float, model: str,
    at: datetime, *, max_events: int | None = None, seq: int | None = None,
) -> UsageTotals:
    """`record_usage` in the caller's transaction (the attempt store's batch): the renewal
    and the run's totals after it (tokens, cost).

    Each call is real spending, so a retry that repeats a step records it again. But the
    same write applied twice (`seq`, the call's number in its attempt: a write retried
    after its commit's acknowledgement was lost) adds nothing the second time: its key
    (run, attempt, seq) is taken. Past `max_events` the totals still grow; only the
    event is left out."""
    renewal = _renew_locked(ref, at)
    fresh = renewal is not Renewal.LOST and (
        seq is None or _take_key(ref, seq, input_tokens, output_tokens, cost, model, at))
    if fresh:  # spent is spent, even with a cancel requested
        AgentRun.objects.filter(ref.guard()).update(
            input_tokens=F("input_tokens") + input_tokens,
            output_tokens=F("output_tokens") + output_tokens, cost=F("cost") + cost)
        add_usage(ref.run_id, ref.attempt, input_tokens + output_tokens, cost)
        append_one(lifecycle(ref.run_id, USAGE, ref.attempt, input_tokens=input_tokens,
                             output_tokens=output_tokens, cost=cost, model=model), at,
                   below=max_events)
    totals = AgentRun.objects.filter(pk=ref.run_id).values_list(
        "input_tokens", "output_tokens", "cost").first()
    tokens, spent = (0, 0.0) if totals is None else (totals[0] + totals[1], totals[2])
    if fresh:
        send_after_commit(signals.usage_recorded, run_id=ref.run_id, agent=ref.agent,
                          attempt=ref.attempt, input_tokens=input_tokens,
                          output_tokens=output_tokens, cost=cost, model=model)
    return UsageTotals(renewal, tokens, spent)


def _take_key(ref: AttemptRef, seq: int, input_tokens: int, output_tokens: int, cost: float,
              model: str, at: datetime) -> bool:
    """Insert the call's usage record unless its key is taken; whether it was inserted."""
    table = connection.ops.quote_name(RunUsage._meta.db_table)
    created = RunUsage._meta.get_field("created_at")
    assert isinstance(created, Field)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (run_id, attempt, seq, input_tokens, output_tokens, cost, "
            f"model, created_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
            f"ON CONFLICT (run_id, attempt, seq) DO NOTHING",
            [ref.run_id, ref.attempt, seq, input_tokens, output_tokens, cost, model,
             created.get_db_prep_value(at, connection)])
        return bool(cursor.rowcount)


@retry_on_lock()
def exhaust_budget(ref: AttemptRef, why: str, at: datetime | None = None) -> Settlement:
    """The run's recorded usage passed its budget: dead-lettered `budget_exhausted`, which
    no retry of the same budget can fix (an operator retries it with a raised one). A
    requested cancel wins."""
    def settle(row: dict[str, Any], at: datetime) -> Settlement:
        decision = policy.Decision(DecisionAction.CANCEL) \
            if row["cancel_requested_at"] is not None \
            else policy.Decision(DecisionAction.DEAD_LETTER, reason=Reason.BUDGET_EXHAUSTED)
        error = ErrorInfo("BudgetExhausted", f"the run passed its budget: {why}", "")
        return _apply(row, ref.guard(), decision, error, at, events=[])

    return settle_fenced(ref, at, settle)
