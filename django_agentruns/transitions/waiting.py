"""Every status write of a waiting run: the wait, deliveries, resumes, timeouts (child runs
and the parents they resume: `transitions.children`).

The race that matters is a delivery against the wait it answers. Both lock the run's row
first (SELECT ... FOR UPDATE on PostgreSQL; SQLite's IMMEDIATE transactions serialise every
writer), and each reads the other's trace after it: the wait looks for a stored payload,
the delivery for a recorded wait. Whichever commits second sees the first, so a payload is
never left unread by a run that waits for it. A child that finishes locks its parent the
same way before counting its siblings, so the last of them to finish resumes it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import transaction

from .. import signals
from ..db import is_postgres, retry_on_lock
from ..exceptions import LimitExceeded
from ..models import TERMINAL, AgentRun, RunWait, Status
from ..outcomes import (
    RESERVED_PREFIX,
    AttemptRef,
    DeliverResult,
    RunResult,
    Waited,
    WaitState,
)
from ..payloads import outputs_of
from .events import append_events, append_one, lifecycle, now

WAITING = "run.waiting"
DELIVERED = "run.delivered"
RESUMED = "run.resumed"
WAIT_TIMED_OUT = "run.wait_timed_out"
SPAWNED = "run.spawned"

RUNS_PREFIX = f"{RESERVED_PREFIX}runs:"


def runs_key(ids: Iterable[int]) -> str:
    """The key of a wait for these child runs: the same for the same set, in any order."""
    text = ",".join(str(i) for i in sorted(set(ids)))
    return RUNS_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:24]


def _locked(*guard: Any, **filters: Any) -> dict[str, Any] | None:
    """The run's row, locked against other writers until the transaction ends."""
    qs = AgentRun.objects.filter(*guard, **filters)
    if is_postgres():
        qs = qs.select_for_update(of=("self",))
    row = qs.values("id", "agent", "status", "attempt", "wait_key", "cancel_requested_at",
                    "fair_key").first()
    return None if row is None else dict(row)


def _renew(ref: AttemptRef, at: datetime) -> None:
    AgentRun.objects.filter(ref.guard()).update(lease_expires=ref.lease_until(at))


def _resume(run_id: int, attempt: int, at: datetime, **why: Any) -> bool:
    """waiting -> queued, due now. The requeue budget is left alone: waiting is no failure."""
    if not AgentRun.objects.filter(pk=run_id, status=Status.WAITING).update(
            status=Status.QUEUED, available_at=at, wait_key="", wait_until=None):
        return False
    append_events([lifecycle(run_id, RESUMED, attempt, **why)], at)
    return True


# --------------------------------------------------------------------------- the wait


@retry_on_lock()
def wait_for(
    ref: AttemptRef, key: str, *, kind: str, prompt: Any = None,
    deadline: datetime | None = None, children: list[int] | None = None,
    at: datetime | None = None,
) -> Waited:
    """The attempt's fenced wait for `key` (or for `children` to finish), in one transaction.

    What is already there is returned without waiting (the lease renewed); otherwise the
    run becomes `waiting` and its lease is released. An interactive run (no lease) never
    waits: WOULD_WAIT, nothing written.
    """
    at = at or now()
    with transaction.atomic():
        row = _locked(ref.guard())
        if row is None:
            return Waited(WaitState.LOST)
        if row["cancel_requested_at"] is not None:
            return Waited(WaitState.CANCEL_REQUESTED)
        wait = RunWait.objects.filter(run_id=ref.run_id, key=key).first()
        if children is not None:
            results = _children(ref.run_id, children)
            if all(r.status in TERMINAL for r in results.values()):
                _renew(ref, at)
                return Waited(WaitState.READY, runs=results)
        elif wait is not None and wait.delivered_at is not None:
            _renew(ref, at)
            return Waited(WaitState.READY, payload=wait.payload, by=wait.delivered_by)
        if wait is not None and wait.timed_out_at is not None:
            _renew(ref, at)
            return Waited(WaitState.TIMED_OUT)
        if ref.lease_ttl is None:
            return Waited(WaitState.WOULD_WAIT)
        fields = {"kind": kind, "prompt": prompt, "deadline": deadline, "waited_at": at}
        if wait is None:
            RunWait.objects.create(run_id=ref.run_id, key=key, **fields)
        else:
            RunWait.objects.filter(pk=wait.pk).update(**fields)
        AgentRun.objects.filter(ref.guard()).update(
            status=Status.WAITING, claimed_by="", lease_expires=None, wait_key=key,
            wait_until=deadline)
        story: dict[str, Any] = {"key": key, "kind": kind}
        if deadline is not None:
            story["deadline"] = deadline.isoformat()
        if children is not None:
            story["runs"] = sorted(set(children))
        append_events([lifecycle(ref.run_id, WAITING, ref.attempt, **story)], at)
        signals.send_waiting_after_commit(run_id=ref.run_id, agent=row["agent"],
                                          attempt=ref.attempt, kind=kind, key=key,
                                          prompt=prompt)
    return Waited(WaitState.WAITING)


def _children(parent_id: int, ids: list[int]) -> dict[int, RunResult]:
    from ..exceptions import InvalidInputError

    rows = {r["id"]: r for r in AgentRun.objects.filter(pk__in=ids, parent_id=parent_id)
            .values("id", "status", "reason", "error_type", "error_message")}
    outputs = outputs_of([pk for pk, r in rows.items() if r["status"] == Status.SUCCEEDED])
    strangers = sorted(set(ids) - set(rows))
    if strangers:
        raise InvalidInputError(f"wait_for_runs takes child runs of run {parent_id} "
                                f"(ctx.spawn); not its children: {strangers[:10]}")
    return {pk: RunResult(
        status=r["status"], reason=r["reason"],
        output=outputs.get(pk),
        error={"type": r["error_type"], "message": r["error_message"]}
        if r["status"] == Status.FAILED else None) for pk, r in rows.items()}


# --------------------------------------------------------------------------- deliveries


@retry_on_lock()
def deliver(run_id: int, key: str, payload: Any, by: str,
            at: datetime | None = None, *, answers_approval: bool = False,
            max_unread: int | None = None, max_events: int | None = None) -> DeliverResult:
    """Store the payload for `key` and, if the run waits for it, queue it again.

    A key the run has not waited for is stored for its later `receive`, up to
    `max_unread` of them (then `LimitExceeded`); their events count against `max_events`.

    In the caller's transaction when there is one (like `enqueue`): roll back and the
    delivery never happened. An answer to an approval (`answers_approval`) needs the run
    to have asked for it: an approval answers a proposal, so it is never stored early.
    """
    at = at or now()
    with transaction.atomic():
        row = _locked(pk=run_id)
        if row is None:
            return DeliverResult.NOT_FOUND
        wait = RunWait.objects.filter(run_id=run_id, key=key).values(
            "pk", "delivered_at", "kind", "waited_at").first()
        if answers_approval and (wait is None or wait["kind"] != RunWait.Kind.APPROVAL
                                 or wait["waited_at"] is None):
            raise _not_asked(run_id, key, row)
        if wait is not None and wait["delivered_at"] is not None:
            return DeliverResult.ALREADY_DELIVERED
        if row["status"] in TERMINAL:
            return DeliverResult.FINISHED
        given = {"payload": payload, "delivered_at": at, "delivered_by": by}
        answers = row["status"] == Status.WAITING and row["wait_key"] == key
        if wait is None:
            _check_unread(run_id, max_unread)
            RunWait.objects.create(run_id=run_id, key=key, **given)
        else:
            RunWait.objects.filter(pk=wait["pk"]).update(**given)
        delivered = lifecycle(run_id, DELIVERED, row["attempt"], key=key, by=by)
        if answers:
            append_events([delivered], at)
            _resume(run_id, row["attempt"], at, key=key, by=by)
            return DeliverResult.DELIVERED
        # Stored for later: its event counts against the run's events cap, as an emit does.
        append_one(delivered, at, below=max_events)
    return DeliverResult.STORED


def _check_unread(run_id: int, most: int | None) -> None:
    """Refuse a payload for a key the run has not waited for once it holds `most` of them
    (setting MAX_DELIVERIES_PER_RUN): each is a row, and nobody may have to read them."""
    if most is None:
        return
    unread = RunWait.objects.filter(run_id=run_id, waited_at__isnull=True,
                                    delivered_at__isnull=False).count()
    if unread >= most:
        raise LimitExceeded(f"run {run_id} already holds {unread} deliveries for keys it has "
                            f"not waited for: MAX_DELIVERIES_PER_RUN is {most}")


def _not_asked(run_id: int, key: str, row: dict[str, Any]) -> Exception:
    """The error for an answer to an approval the run never asked for, naming those it
    did ask for (a typo is then plain to see)."""
    from ..exceptions import InvalidInputError

    asked = list(RunWait.objects.filter(
        run_id=run_id, kind=RunWait.Kind.APPROVAL, waited_at__isnull=False,
        delivered_at__isnull=True).order_by("id").values_list("key", flat=True)[:10])
    if asked:
        waits = "it waits for approval of " + ", ".join(repr(k) for k in asked)
    elif row["status"] == Status.WAITING and not row["wait_key"].startswith(RESERVED_PREFIX):
        waits = f"it waits for input {row['wait_key']!r}, not an approval (use deliver())"
    elif row["status"] == Status.WAITING:
        waits = "it waits for its child runs, not an approval"
    else:
        waits = f"it is {row['status']} and asks for no approval now"
    return InvalidInputError(f"run #{run_id} has not asked for approval of {key!r}: "
                             f"{waits}; nothing was recorded")


# --------------------------------------------------------------------------- timeouts


def expired(at: datetime, limit: int) -> list[int]:
    """Waiting runs whose deadline passed (the partial index agentruns_wait_until)."""
    return list(AgentRun.objects.filter(status=Status.WAITING, wait_until__lt=at)
                .order_by("wait_until").values_list("pk", flat=True)[:limit])


@retry_on_lock()
def expire(run_id: int, at: datetime | None = None) -> bool:
    """Queue a run whose wait's deadline passed; its next `receive` raises WaitTimedOut.
    The deadline is re-checked under the lock: a delivery that just resumed it wins."""
    at = at or now()
    with transaction.atomic():
        row = _locked(pk=run_id, status=Status.WAITING, wait_until__lt=at)
        if row is None:
            return False
        RunWait.objects.filter(run_id=run_id, key=row["wait_key"]).update(timed_out_at=at)
        append_events([lifecycle(run_id, WAIT_TIMED_OUT, row["attempt"],
                                 key=row["wait_key"])], at)
        return _resume(run_id, row["attempt"], at, key=row["wait_key"], timed_out=True)
