"""What people do to runs: cancel, retry, and runs executed in the caller's process."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction

from .. import signals
from ..db import is_postgres, retry_on_lock
from ..exceptions import InvalidInputError
from ..models import AgentRun, Reason, RunWait, Status
from ..outcomes import CancelResult
from ..signals import send_after_commit
from . import children
from .events import CANCEL_REQUESTED, CANCELLED, RETRIED, STARTED, append_events, lifecycle, now
from .fair import join_groups, next_stamp


@retry_on_lock()
def cancel(run_id: int, reason: str = "", at: datetime | None = None) -> CancelResult | None:
    """Cancel a queued or waiting run now, or ask a running one to stop. None: no such run.

    Its unfinished descendants (`ctx.spawn`) are cancelled with it, in the same
    transaction, a level of the tree at a time (one read per level, no recursion: a tree
    of any depth is cancelled whole).
    """
    at = at or now()
    with transaction.atomic():
        result = _cancel_one(run_id, reason, at)
        level = [run_id] if result in _CASCADES else []
        while level:
            below = []
            for parent, child in children.unfinished_children_of(level):
                if _cancel_one(child, reason or f"parent run {parent} cancelled", at) \
                        in _CASCADES:
                    below.append(child)
            level = below
        return result


_CASCADES = (CancelResult.CANCELLED, CancelResult.REQUESTED)


def _cancel_one(run_id: int, reason: str, at: datetime) -> CancelResult | None:
    """Inside `cancel`'s transaction: this run alone."""
    qs = AgentRun.objects.filter(pk=run_id)
    if is_postgres():
        qs = qs.select_for_update()
    row = qs.values("status", "attempt", "cancel_requested_at", "agent").first()
    if row is None:
        return None
    if row["status"] in (Status.QUEUED, Status.WAITING):
        AgentRun.objects.filter(pk=run_id, status=row["status"]).update(
            status=Status.CANCELLED, reason=Reason.CANCELLED, finished_at=at,
            cancel_requested_at=at, cancel_reason=reason, wait_key="",
            wait_until=None)
        append_events([lifecycle(run_id, CANCELLED, row["attempt"], reason=reason)], at)
        children.children_settled([run_id], at)
        send_after_commit(signals.run_cancelled, run_id=run_id, agent=row["agent"],
                          attempt=row["attempt"], reason=reason)
        return CancelResult.CANCELLED
    if row["status"] == Status.RUNNING:
        if row["cancel_requested_at"] is not None:
            return CancelResult.ALREADY_REQUESTED
        AgentRun.objects.filter(pk=run_id, status=Status.RUNNING,
                                cancel_requested_at__isnull=True).update(
            cancel_requested_at=at, cancel_reason=reason)
        append_events([lifecycle(run_id, CANCEL_REQUESTED, row["attempt"],
                                   reason=reason)], at)
        return CancelResult.REQUESTED
    return CancelResult.NOT_CANCELLABLE


@retry_on_lock()
def operator_retry(
    run_id: int, by: str = "", at: datetime | None = None, *,
    budget: dict[str, Any] | None = None,
) -> bool | None:
    """Send a failed or cancelled run back to the queue with a fresh requeue budget (and
    snooze count); `budget` replaces the run's token/cost budget.

    None: no such run; False: it is not failed or cancelled (nothing written).
    `InvalidInputError`: its dedupe key is held by another unfinished run of its agent.
    """
    at = at or now()
    with transaction.atomic():
        row = AgentRun.objects.filter(pk=run_id).values(
            "status", "attempt", "reason", "agent", "dedupe_key", "queue", "fair_key",
            "priority").first()
        if row is None:
            return None
        # A fresh fair-share stamp: its old one may be far below (or, its queue's clock
        # gone while it was finished, far above) where the queue's claims are now.
        stamp = next_stamp(row["queue"], row["fair_key"], row["priority"])
        try:
            with transaction.atomic():  # a savepoint: the unique index may refuse the row
                updated = AgentRun.objects.filter(
                    pk=run_id, status__in=(Status.FAILED, Status.CANCELLED)).update(
                    status=Status.QUEUED, reason=Reason.NONE, requeue_count=0,
                    available_at=at, claimed_by="", lease_expires=None, finished_at=None,
                    cancel_requested_at=None, cancel_reason="", snooze_count=0,
                    fair_vstart=stamp, **({} if budget is None else {"budget": budget}))
        except IntegrityError:
            holder = AgentRun.objects.holding_key(row["agent"], row["dedupe_key"]) \
                .values_list("pk", flat=True).first()
            raise InvalidInputError(
                f"Run {run_id} cannot be retried: its dedupe key {row['dedupe_key']!r} is "
                f"held by unfinished run {holder}") from None
        if not updated:
            return False
        if row["fair_key"]:  # its group may have been dropped while it was finished
            join_groups([(row["queue"], row["fair_key"])])
        # A wait that timed out unanswered is opened afresh: the retried attempt, reaching
        # the same `receive`, waits again (with its timeout from now) instead of failing
        # with WaitTimedOut at once, as it would for ever.
        RunWait.objects.filter(run_id=run_id, timed_out_at__isnull=False,
                               delivered_at__isnull=True).update(timed_out_at=None)
        extra = {} if budget is None else {"budget": budget}
        append_events([lifecycle(run_id, RETRIED, row["attempt"], by=by,
                                   previous=row["reason"], **extra)], at)
    return True


# --------------------------------------------------------------------------- interactive


def start_interactive(run: AgentRun, worker_id: str, at: datetime | None = None) -> AgentRun:
    """Record a run executed in the caller's process: running at once, with no lease."""
    at = at or now()
    run.status = Status.RUNNING
    run.claimed_by = worker_id
    run.attempt = 1
    run.started_at = at
    run.lease_expires = None
    with transaction.atomic():
        run.save(force_insert=True)
        append_events([lifecycle(run.pk, STARTED, 1, worker=worker_id)], at)
    return run
