"""The claim: due (or lapsed) runs taken for a worker and started, in one transaction."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Case, F, Q, QuerySet, Value, When

from .. import signals
from ..conf import app_settings
from ..db import is_postgres, retry_on_lock
from ..models import AgentRun, RunEvent, Status
from ..outcomes import DecisionAction, ScopePolicy
from ..signals import send_after_commit
from . import hot_sql, rawrows, rawsql
from .due import claim_row, compiled_due, recheck_order
from .events import STARTED, append_events, lifecycle, now
from .guards import still
from .settling import abandon_locked
from .windows import carry_entries

RELEASED_DEDUPE_KEY = Case(When(release_dedupe_at_start=True, then=Value("")),
                           default=F("dedupe_key"))


@retry_on_lock()
def claim(
    worker_id: str,
    queues: Sequence[str],
    limit: int,
    scopes: ScopePolicy,
    lease_ttls: dict[str, float],
    default_ttl: float,
    at: datetime | None = None,
    *,
    include_lapsed: bool = True,
    agents: frozenset[str] | None = None,
    fair: bool = False,
) -> list[AgentRun]:
    """Take up to `limit` due runs for `worker_id`, in one short transaction.

    On PostgreSQL one statement locks the due rows with SKIP LOCKED (so concurrent workers
    take different runs without waiting), starts them and appends their start events;
    where agents keep firing order, their runs are then re-checked in the same transaction
    and any held back is put back as it was. On SQLite the transaction holds the
    database's write lock (IMMEDIATE), and the UPDATE's status guard is the
    compare-and-set.
    A lapsed run is taken as it stands, its lost attempt recorded as abandoned
    (`include_lapsed=False` skips looking for them, for a worker that just did).
    `agents`: take only runs of these agents, due or lapsed (a worker's own; None: any).
    `fair`: due runs in fair order, their stamps before their age (transitions.fair).
    """
    at = at or now()
    if limit <= 0 or (agents is not None and not agents):
        return []
    queues = tuple(queues)
    fast = is_postgres()
    if fast and not include_lapsed and not scopes.ordered and not connection.in_atomic_block:
        # One statement, committed on its own: lock, start, and the start events.
        claimed = _claim_due_returning(worker_id, queues, limit, scopes, lease_ttls,
                                       default_ttl, at, agents, fair)
        _announce_started(claimed, worker_id)
        return claimed
    with transaction.atomic():
        claimed = _claim_lapsed(worker_id, queues, limit, lease_ttls, default_ttl, at,
                                agents) if include_lapsed else []
        room = limit - len(claimed)
        if room > 0:
            due = _claim_due_returning if fast else _claim_due_checked
            started = due(worker_id, queues, room, scopes, lease_ttls, default_ttl, at, agents,
                          fair)
            if fast and scopes.ordered:
                started = _release_held(started, scopes, worker_id)
        else:
            started = []
        # The fast path's statement appended its own start events.
        append_events([lifecycle(r.pk, STARTED, r.attempt, worker=worker_id)
                        for r in (claimed if fast else claimed + started)], at)
        claimed += started
        _announce_started(claimed, worker_id)
    return claimed


def _announce_started(claimed: list[AgentRun], worker_id: str) -> None:
    for r in claimed:
        send_after_commit(signals.run_started, run_id=r.pk, agent=r.agent, attempt=r.attempt,
                          worker_id=worker_id)


def _claim_lapsed(
    worker_id: str, queues: tuple[str, ...], limit: int, lease_ttls: dict[str, float],
    default_ttl: float, at: datetime, agents: frozenset[str] | None,
) -> list[AgentRun]:
    """Lapsed runs, their lost attempt recorded as abandoned, then started again (not from
    a paused queue: the reaper requeues those, to wait for the resume)."""
    locked = _lock(AgentRun.objects.lapsed(at, queues).of_agents(agents).unpaused()
                   .order_by("id"), limit)
    ids = []
    for run in locked:
        decision = abandon_locked(claim_row(run), Q(lease_expires__lt=at), at,
                                   why="lease lapsed", apply_backoff=False)
        if decision is not None and decision.action is DecisionAction.RETRY:
            ids.append(run.pk)
    reclaimed = _start(worker_id, ids, {r.pk: r.agent for r in locked}, lease_ttls,
                       default_ttl, at, read_back=None)
    carry_entries(reclaimed, at)
    return reclaimed


def _claim_due_returning(
    worker_id: str, queues: tuple[str, ...], limit: int, scopes: ScopePolicy,
    lease_ttls: dict[str, float], default_ttl: float, at: datetime,
    agents: frozenset[str] | None, fair: bool = False,
) -> list[AgentRun]:
    """PostgreSQL: lock the due runs (SKIP LOCKED), start them and append their start
    events, in one statement."""
    due = compiled_due(connection.vendor, queues, scopes, limit, ids_only=True, agents=agents,
                       naive=rawsql.naive_times(), fair=fair)
    special = {agent: at + timedelta(seconds=ttl) for agent, ttl in lease_ttls.items()
               if ttl != default_ttl}
    sql, params = hot_sql.claim_returning(due, at, worker_id, Status.RUNNING, Status.QUEUED,
                                         special, at + timedelta(seconds=default_ttl), STARTED)
    with rawrows.cursor(prepared=bool(app_settings.PREPARED_STATEMENTS)) as cursor:
        cursor.execute(sql, params)
        claimed = rawrows.runs_from(cursor, sql=sql)
    claimed.sort(key=fair_order if fair else age_order)
    return claimed


def age_order(run: AgentRun) -> tuple[Any, ...]:
    """The ordinary claim's order, for rows returned unordered."""
    return (-run.priority, run.available_at, run.fired_seq, run.pk)


def fair_order(run: AgentRun) -> tuple[Any, ...]:
    """FAIR_ORDER, for rows returned unordered."""
    return (-run.priority, run.fair_vstart, run.available_at, run.fired_seq, run.pk)


def _claim_due_checked(
    worker_id: str, queues: tuple[str, ...], limit: int, scopes: ScopePolicy,
    lease_ttls: dict[str, float], default_ttl: float, at: datetime,
    agents: frozenset[str] | None, fair: bool = False,
) -> list[AgentRun]:
    """Lock the due rows, re-check firing order under the lock, then start them."""
    due = compiled_due(connection.vendor, queues, scopes, limit, ids_only=False, agents=agents,
                       naive=rawsql.naive_times(), fair=fair)
    locked = list(AgentRun.objects.raw(due.sql, due.bind(at)))
    candidates = recheck_order([claim_row(run) for run in locked], scopes)
    ids = [c["id"] for c in candidates]
    return _start(worker_id, ids, {r.pk: r.agent for r in locked}, lease_ttls, default_ttl, at,
                  read_back=locked)


def _start(
    worker_id: str, ids: list[int], agent_of: dict[int, str], lease_ttls: dict[str, float],
    default_ttl: float, at: datetime, *, read_back: list[AgentRun] | None,
) -> list[AgentRun]:
    """Start the queued runs `ids` (in that order) for `worker_id`; return them as started.

    `read_back`: the rows as locked, to build the result from when every UPDATE matched
    (else, or when None, they are read again).
    """
    if not ids:
        return []
    by_ttl: dict[float, list[int]] = {}
    for run_id in ids:
        by_ttl.setdefault(lease_ttls.get(agent_of[run_id], default_ttl), []).append(run_id)
    updated = 0
    for ttl, group in by_ttl.items():
        updated += AgentRun.objects.filter(still(Status.QUEUED), pk__in=group).update(
            status=Status.RUNNING, claimed_by=worker_id, attempt=F("attempt") + 1,
            lease_expires=at + timedelta(seconds=ttl), started_at=at,
            dedupe_key=RELEASED_DEDUPE_KEY,  # a debounced run gives up its key as it starts
        )
    if read_back is not None and updated == len(ids):
        # Every locked row was updated as read: no need to read them back.
        wanted = set(ids)
        claimed = [_as_claimed(run, worker_id, at, by_ttl) for run in read_back
                   if run.pk in wanted]
    else:  # a compare-and-set lost a row, or a reclaim changed one: read what we hold
        claimed = list(AgentRun.objects.filter(pk__in=ids, status=Status.RUNNING,
                                               claimed_by=worker_id, started_at=at))
    claimed.sort(key=lambda r: ids.index(r.pk))
    return claimed


def _release_held(
    started: list[AgentRun], scopes: ScopePolicy, worker_id: str
) -> list[AgentRun]:
    """The claim stays the authority on firing order: re-check ordered runs just started
    (a fresh snapshot, under their locks) and put back as it was any that an earlier run
    of its scope holds (e.g. one an operator retried after the claim's snapshot).

    Same transaction as the claim, so no one ever sees them started.
    """
    rows = [{**claim_row(r), "status": Status.QUEUED} for r in started]
    kept = {row["id"] for row in recheck_order(rows, scopes)}
    for run in started:
        if run.pk in kept:
            continue
        AgentRun.objects.filter(pk=run.pk, status=Status.RUNNING, claimed_by=worker_id,
                                attempt=run.attempt).update(
            status=Status.QUEUED, claimed_by="", attempt=F("attempt") - 1, lease_expires=None,
            started_at=getattr(run, "previous_started_at", None))  # from the claim statement
        RunEvent.objects.filter(run_id=run.pk, type=STARTED, attempt=run.attempt).delete()
    return [run for run in started if run.pk in kept]


def _lock(qs: QuerySet[AgentRun], limit: int) -> list[AgentRun]:
    if is_postgres():
        qs = qs.select_for_update(skip_locked=True, of=("self",))
    return list(qs[:limit])


def _as_claimed(
    run: AgentRun, worker_id: str, at: datetime, by_ttl: dict[float, list[int]]
) -> AgentRun:
    """The row as the claim's UPDATE left it."""
    ttl = next(t for t, group in by_ttl.items() if run.pk in group)
    run.status = Status.RUNNING
    run.claimed_by = worker_id
    run.attempt += 1
    run.lease_expires = at + timedelta(seconds=ttl)
    run.started_at = at
    if run.release_dedupe_at_start:
        run.dedupe_key = ""
    return run
