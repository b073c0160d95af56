"""Every write of a run's status, and every write an attempt makes, lives here.

Each transition is one short transaction: a guarded UPDATE (the row must still be in
the state the caller believes it is in) plus the event rows that tell the story. The
return value says whether it happened; a guard that matches no row is a result, not
an error. Nothing outside this module writes `AgentRun.status`.

Attempt writes (renew, emit, checkpoint, settle) are fenced by
`status='running' AND claimed_by=<worker> AND attempt=<n>`: a worker that lost its
lease cannot touch the run's new attempt.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from django.db import IntegrityError, connection, transaction
from django.db.models import Exists, F, Field, OuterRef, Q, QuerySet
from django.utils import timezone

from . import policy, rawsql, signals
from .conf import app_settings
from .db import RowBefore, is_postgres, retry_on_lock
from .models import AgentRun, Reason, RunEvent, Status
from .outcomes import (
    AttemptRef,
    CancelResult,
    ErrorInfo,
    Renewal,
    ScopePolicy,
    Settlement,
)
from .signals import send_after_commit

__all__ = ["AttemptRef", "CancelResult", "ErrorInfo", "Renewal", "ScopePolicy", "Settlement"]

EVENT_NAMESPACE = uuid.UUID("6f1b7a52-3d0c-4f0e-9a55-0a6e2b8c1d17")

STARTED = "run.started"
SUCCEEDED = "run.succeeded"
RETRYING = "run.retrying"
DEAD_LETTERED = "run.dead_lettered"
CANCELLED = "run.cancelled"
CANCEL_REQUESTED = "run.cancel_requested"
ABANDONED = "run.abandoned"
RETRIED = "run.retried"
CHECKPOINT = "run.checkpoint"


def now() -> datetime:
    return timezone.now()


# --------------------------------------------------------------------------- events


def lifecycle_event_id() -> uuid.UUID:
    """Lifecycle events are written with their guarded transition, so never twice."""
    return uuid.uuid4()


def emitted_event_id(run_id: int, checkpoints: int, position: int) -> uuid.UUID:
    """Deterministic: a retry resuming from the same checkpoint derives the same ids."""
    return uuid.uuid5(EVENT_NAMESPACE, f"{run_id}:{checkpoints}:{position}")


def _append_events(
    events: Sequence[tuple[int, str, dict[str, Any], int, uuid.UUID]], at: datetime
) -> None:
    """Append (run_id, type, payload, attempt, event_id) rows with the next per-run seq.

    One statement for any number of events. Callers hold the runs' rows (guarded UPDATE
    in the same transaction), so no other writer appends to these runs meanwhile and
    max(seq) + 1 is free.
    """
    if not events:
        return
    sql, params = rawsql.insert_events(events, at)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def _append_one(
    event: tuple[int, str, dict[str, Any], int, uuid.UUID], at: datetime, *,
    unless_exists: bool = False,
) -> bool:
    """Append one event in one statement, its seq computed in the INSERT itself.

    With `unless_exists`, an event whose id is already stored (a retry re-emitting) adds
    nothing. Returns whether a row was added.
    """
    run_id, type_, payload, attempt, event_id = event
    table = connection.ops.quote_name(RunEvent._meta.db_table)
    sql = (f"INSERT INTO {table} (run_id, seq, event_id, type, payload, attempt, created_at) "
           f"SELECT %s, COALESCE((SELECT MAX(seq) FROM {table} WHERE run_id = %s), 0) + 1, "
           f"%s, %s, %s, %s, %s")
    params = [run_id, run_id, _prep("event_id", event_id), type_, _prep("payload", payload),
              attempt, _prep("created_at", at)]
    if unless_exists:
        sql += f" WHERE NOT EXISTS (SELECT 1 FROM {table} WHERE event_id = %s)"
        params.append(params[2])
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return bool(cursor.rowcount)


def _prep(name: str, value: Any) -> Any:
    field = RunEvent._meta.get_field(name)
    assert isinstance(field, Field)
    return field.get_db_prep_value(value, connection)


def _lifecycle(run_id: int, type_: str, attempt: int, **payload: Any) -> tuple[
        int, str, dict[str, Any], int, uuid.UUID]:
    return (run_id, type_, payload, attempt, lifecycle_event_id())


# --------------------------------------------------------------------------- enqueue


class NewRun(NamedTuple):
    """A checked run to queue (`api` builds them): what differs from one new run to another."""

    agent: str
    queue: str
    priority: int
    scope: str
    fired_seq: int
    input: Any
    input_json: str  # `input` as the JSON text to store
    max_requeues: int
    available_at: datetime


# What each element of insert_runs' JSON array holds, in order (input as its JSON text).
_PER_RUN = ("agent", "queue", "priority", "scope", "fired_seq", "input", "max_requeues",
            "available_at")


def insert_runs(new: Sequence[NewRun], at: datetime) -> list[AgentRun]:
    """Queue `new` runs created `at` in one INSERT; return them saved, in the same order.

    One statement, so it needs no transaction of its own: in the caller's it stands or falls
    with it (enqueue is transactional), in autocommit it is all or nothing by itself.
    The rows travel as one JSON array that the database unpacks: no Python per field and
    row (bulk_create's cost), one parameter whatever the count (SQLite's limit on them
    never applies), and one short plan. Ids are drawn in array order, so the RETURNING
    ids, sorted, are the rows' in order.
    """
    sql, fixed = _insert_statement(connection.vendor)
    at_text = _json_time(at)
    rows = json.dumps([
        [r.agent, r.queue, r.priority, r.scope, r.fired_seq, r.input_json, r.max_requeues,
         at_text if r.available_at is at else _json_time(r.available_at)] for r in new])
    with connection.cursor() as cursor:
        cursor.execute(sql, [*fixed, connection.ops.adapt_datetimefield_value(at), rows])
        ids = sorted(pk for (pk,) in cursor.fetchall())
    fields = AgentRun._meta.concrete_fields
    names, alias = [f.attname for f in fields], connection.alias
    shared = {f.attname: f.get_default() for f in fields}
    shared.update(status=Status.QUEUED, created_at=at)
    runs = []
    for r, pk in zip(new, ids, strict=True):
        values = {**shared, **r._asdict(), "id": pk}
        runs.append(AgentRun.from_db(alias, names, [values[n] for n in names]))
    return runs


def _json_time(value: datetime) -> str:
    """A datetime as the JSON rows carry it: text the database reads as that instant."""
    return str(connection.ops.adapt_datetimefield_value(value.astimezone(UTC)))


@functools.cache
def _insert_statement(vendor: str) -> tuple[str, tuple[Any, ...]]:
    """insert_runs' INSERT, and the values of its fixed columns: status 'queued' and every
    other NOT NULL column at its (constant) model default. Then created_at and the rows
    are the parameters; nullable columns are left NULL."""
    fields = {f.attname: f for f in AgentRun._meta.concrete_fields}
    fixed = {name: Status.QUEUED if name == "status" else f.get_default()
             for name, f in fields.items()
             if name not in (*_PER_RUN, "created_at") and not f.primary_key and not f.null}
    qn = connection.ops.quote_name
    if vendor == "postgresql":
        # Cast to the column's type without its length: a value too long is an error, not cut.
        picks = [f"(r->>{i})::{str(fields[name].db_type(connection)).split('(')[0]}"
                 for i, name in enumerate(_PER_RUN)]
        source = "jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS rows(r, n) ORDER BY n"
    else:
        picks = [f"json_extract(value, '$[{i}]')" for i in range(len(_PER_RUN))]
        source = "json_each(%s) ORDER BY key"
    columns = ", ".join(qn(str(fields[name].column))
                        for name in (*_PER_RUN, *fixed, "created_at"))
    values = ", ".join([*picks, *["%s"] * (len(fixed) + 1)])
    sql = (f"INSERT INTO {qn(AgentRun._meta.db_table)} ({columns}) SELECT {values} "
           f"FROM {source} RETURNING {qn(str(AgentRun._meta.pk.column))}")
    return sql, tuple(fields[name].get_db_prep_save(value, connection)
                      for name, value in fixed.items())


# --------------------------------------------------------------------------- claim


def holding_statuses(blocking: bool) -> list[str]:
    statuses: list[str] = [Status.QUEUED, Status.RUNNING]
    return [*statuses, Status.FAILED] if blocking else statuses


def ahead_in_scope() -> QuerySet[AgentRun]:
    """Runs of the outer run's agent and scope ahead of it in firing order."""
    return AgentRun.objects.filter(
        RowBefore(F("fired_seq"), F("id"), OuterRef("fired_seq"), OuterRef("id")),
        agent=OuterRef("agent"), scope=OuterRef("scope"))


def earlier_holder(statuses: list[str]) -> QuerySet[AgentRun]:
    """An earlier run of the outer run's agent and scope, in one of `statuses`."""
    return ahead_in_scope().filter(status__in=statuses)


def startable(qs: QuerySet[AgentRun], scopes: ScopePolicy) -> QuerySet[AgentRun]:
    """Keep the runs no earlier run of their scope holds back (ordered agents only).

    Blocking agents are checked apart from the others so that each NOT EXISTS lists
    its statuses plainly and seeks the scope-head index once per status.
    """
    plain = scopes.ordered - scopes.dead_letters_block
    blocking = scopes.ordered & scopes.dead_letters_block
    if plain:
        qs = qs.filter(~Q(agent__in=plain) | ~Exists(earlier_holder(holding_statuses(False))))
    if blocking:
        qs = qs.filter(~Q(agent__in=blocking) | ~Exists(earlier_holder(holding_statuses(True))))
    return qs


def due_queued(queues: Iterable[str], at: datetime, scopes: ScopePolicy) -> QuerySet[AgentRun]:
    """Queued runs that can start now, in claim order: priority, due time, firing order."""
    qs = AgentRun.objects.filter(status=Status.QUEUED, queue__in=list(queues),
                                 available_at__lte=at)
    return startable(qs, scopes).order_by("-priority", "available_at", "fired_seq", "id")


def awaited(queues: Iterable[str], at: datetime, scopes: ScopePolicy) -> QuerySet[AgentRun]:
    """Queued runs due by time that a worker will get to without outside help.

    That is, all but those behind a run no worker releases: a dead letter (where the agent
    says it blocks) or a run still backing off. A burst worker whose claim came back empty
    waits while any of these remain (another worker holds them, or the run ahead of them),
    and exits past the rest.
    """
    qs = AgentRun.objects.filter(status=Status.QUEUED, queue__in=list(queues),
                                 available_at__lte=at)
    for agents, blocking in ((scopes.ordered - scopes.dead_letters_block, False),
                             (scopes.ordered & scopes.dead_letters_block, True)):
        stuck = Q(status=Status.QUEUED, available_at__gt=at)
        if blocking:
            stuck |= Q(status=Status.FAILED)
        if agents:
            qs = qs.filter(~Q(agent__in=agents) | ~Exists(ahead_in_scope().filter(stuck)))
    return qs


def lapsed(queues: Iterable[str] | None, at: datetime) -> QuerySet[AgentRun]:
    """Running runs whose lease has lapsed: their worker is gone (or too slow to count)."""
    qs = AgentRun.objects.filter(status=Status.RUNNING, lease_expires__lt=at)
    return qs if queues is None else qs.filter(queue__in=list(queues))


_CLAIM_FIELDS = ("id", "agent", "status", "attempt", "requeue_count", "max_requeues",
                 "cancel_requested_at", "cancel_reason", "claimed_by", "scope", "fired_seq")


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
    """
    at = at or now()
    if limit <= 0:
        return []
    queues = tuple(queues)
    fast = is_postgres()
    if fast and not include_lapsed and not scopes.ordered and not connection.in_atomic_block:
        # One statement, committed on its own: lock, start, and the start events.
        claimed = _claim_due_returning(worker_id, queues, limit, scopes, lease_ttls,
                                       default_ttl, at)
        _announce_started(claimed, worker_id)
        return claimed
    with transaction.atomic():
        claimed = _claim_lapsed(worker_id, queues, limit, lease_ttls, default_ttl, at) \
            if include_lapsed else []
        room = limit - len(claimed)
        if room > 0:
            due = _claim_due_returning if fast else _claim_due_checked
            started = due(worker_id, queues, room, scopes, lease_ttls, default_ttl, at)
            if fast and scopes.ordered:
                started = _release_held(started, scopes, worker_id)
        else:
            started = []
        # The fast path's statement appended its own start events.
        _append_events([_lifecycle(r.pk, STARTED, r.attempt, worker=worker_id)
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
    default_ttl: float, at: datetime,
) -> list[AgentRun]:
    """Lapsed runs, their lost attempt recorded as abandoned, then started again."""
    locked = _lock(lapsed(queues, at).order_by("id"), limit)
    ids = []
    for run in locked:
        decision = _abandon_locked(_claim_row(run), Q(lease_expires__lt=at), at,
                                   why="lease lapsed", apply_backoff=False)
        if decision is not None and decision.action == "retry":
            ids.append(run.pk)
    return _start(worker_id, ids, {r.pk: r.agent for r in locked}, lease_ttls, default_ttl,
                  at, read_back=None)


def _claim_due_returning(
    worker_id: str, queues: tuple[str, ...], limit: int, scopes: ScopePolicy,
    lease_ttls: dict[str, float], default_ttl: float, at: datetime,
) -> list[AgentRun]:
    """PostgreSQL: lock the due runs (SKIP LOCKED), start them and append their start
    events, in one statement."""
    due = _compiled_due(connection.vendor, queues, scopes, limit, ids_only=True)
    special = {agent: at + timedelta(seconds=ttl) for agent, ttl in lease_ttls.items()
               if ttl != default_ttl}
    sql, params = rawsql.claim_returning(due, at, worker_id, Status.RUNNING, Status.QUEUED,
                                         special, at + timedelta(seconds=default_ttl), STARTED)
    claimed = list(AgentRun.objects.raw(sql, params))
    claimed.sort(key=lambda r: (-r.priority, r.available_at, r.fired_seq, r.pk))
    return claimed


def _claim_due_checked(
    worker_id: str, queues: tuple[str, ...], limit: int, scopes: ScopePolicy,
    lease_ttls: dict[str, float], default_ttl: float, at: datetime,
) -> list[AgentRun]:
    """Lock the due rows, re-check firing order under the lock, then start them."""
    due = _compiled_due(connection.vendor, queues, scopes, limit, ids_only=False)
    locked = list(AgentRun.objects.raw(due.sql, due.bind(at)))
    candidates = _recheck_order([_claim_row(run) for run in locked], scopes)
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
        updated += AgentRun.objects.filter(pk__in=group, status=Status.QUEUED).update(
            status=Status.RUNNING, claimed_by=worker_id, attempt=F("attempt") + 1,
            lease_expires=at + timedelta(seconds=ttl), started_at=at,
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
    rows = [{**_claim_row(r), "status": Status.QUEUED} for r in started]
    kept = {row["id"] for row in _recheck_order(rows, scopes)}
    for run in started:
        if run.pk in kept:
            continue
        AgentRun.objects.filter(pk=run.pk, status=Status.RUNNING, claimed_by=worker_id,
                                attempt=run.attempt).update(
            status=Status.QUEUED, claimed_by="", attempt=F("attempt") - 1, lease_expires=None,
            started_at=getattr(run, "previous_started_at", None))  # from the claim statement
        RunEvent.objects.filter(run_id=run.pk, type=STARTED, attempt=run.attempt).delete()
    return [run for run in started if run.pk in kept]


@functools.lru_cache(maxsize=512)
def _compiled_due(
    vendor: str, queues: tuple[str, ...], scopes: ScopePolicy, limit: int, *, ids_only: bool
) -> rawsql.Compiled:
    """The due query's SQL for this shape, compiled once (`vendor` keys the cache)."""
    qs = due_queued(queues, rawsql.SENTINEL_TIME, scopes)
    if vendor == "postgresql":
        qs = qs.select_for_update(skip_locked=True, of=("self",))
    with transaction.atomic():  # Django compiles FOR UPDATE only inside one (no statement runs)
        # ids_only: the one-statement claim, which needs only the id, and the start time
        # of the previous attempt to put back a run it must release.
        return rawsql.Compiled(qs.values("id", "started_at")[:limit] if ids_only
                               else qs[:limit])


def _lock(qs: QuerySet[AgentRun], limit: int) -> list[AgentRun]:
    if is_postgres():
        qs = qs.select_for_update(skip_locked=True, of=("self",))
    return list(qs[:limit])


def _claim_row(run: AgentRun) -> dict[str, Any]:
    return {field: getattr(run, "pk" if field == "id" else field) for field in _CLAIM_FIELDS}


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
    return run


def _recheck_order(candidates: list[dict[str, Any]], scopes: ScopePolicy) -> list[dict[str, Any]]:
    """The claim stays the authority on firing order: re-check ordered runs under lock."""
    ordered = [c for c in candidates
               if c["status"] == Status.QUEUED and c["agent"] in scopes.ordered]
    if not ordered:
        return candidates
    held = set()
    taken_scopes: set[tuple[str, str]] = set()
    for c in ordered:
        key = (c["agent"], c["scope"])
        statuses = holding_statuses(c["agent"] in scopes.dead_letters_block)
        earlier = AgentRun.objects.filter(agent=c["agent"], scope=c["scope"],
                                          status__in=statuses).filter(
            Q(fired_seq__lt=c["fired_seq"]) | Q(fired_seq=c["fired_seq"], id__lt=c["id"]))
        if key in taken_scopes or earlier.exists():
            held.add(c["id"])
        taken_scopes.add(key)
    return [c for c in candidates if c["id"] not in held]


# --------------------------------------------------------------------------- attempt writes


@retry_on_lock()
def renew(ref: AttemptRef, at: datetime | None = None) -> Renewal:
    """Extend the lease at a step boundary; says whether the attempt may go on."""
    at = at or now()
    with transaction.atomic():
        return _renew_locked(ref, at)


def _renew_locked(ref: AttemptRef, at: datetime) -> Renewal:
    updated = AgentRun.objects.filter(ref.guard(), cancel_requested_at__isnull=True).update(
        lease_expires=ref.lease_until(at))
    if updated:
        return Renewal.OK
    return Renewal.CANCEL_REQUESTED if AgentRun.objects.filter(ref.guard()).exists() \
        else Renewal.LOST


@retry_on_lock()
def renew_many(
    worker_id: str, refs: Sequence[AttemptRef], at: datetime | None = None
) -> dict[AttemptRef, Renewal]:
    """The lease keeper's renewal: every live lease of a worker in one statement per TTL."""
    at = at or now()
    if not refs:
        return {}
    by_ttl: dict[float | None, list[AttemptRef]] = {}
    for ref in refs:
        by_ttl.setdefault(ref.lease_ttl, []).append(ref)
    with transaction.atomic():
        for ttl, group in by_ttl.items():
            if ttl is None:
                continue
            pairs = Q()
            for ref in group:
                pairs |= Q(pk=ref.run_id, attempt=ref.attempt)
            AgentRun.objects.filter(pairs, status=Status.RUNNING, claimed_by=worker_id).update(
                lease_expires=at + timedelta(seconds=ttl))
        rows = {
            (r["id"], r["attempt"]): r
            for r in AgentRun.objects.filter(pk__in=[ref.run_id for ref in refs]).values(
                "id", "attempt", "status", "claimed_by", "cancel_requested_at")
        }
    result = {}
    for ref in refs:
        row = rows.get((ref.run_id, ref.attempt))
        if row is None or row["status"] != Status.RUNNING or row["claimed_by"] != worker_id:
            result[ref] = Renewal.LOST
        elif row["cancel_requested_at"] is not None:
            result[ref] = Renewal.CANCEL_REQUESTED
        else:
            result[ref] = Renewal.OK
    return result


@retry_on_lock()
def emit(
    ref: AttemptRef, event_id: uuid.UUID, type_: str, payload: dict[str, Any],
    at: datetime | None = None,
) -> Renewal:
    """Renew, then append one event unless its id exists already (a retry re-emitting).

    The renewal comes first (ADR-104): a worker that lost the run appends nothing, so
    its events can never collide with the new owner's sequence.
    """
    at = at or now()
    with transaction.atomic():
        renewal = _renew_locked(ref, at)
        if renewal is not Renewal.OK:
            return renewal
        _append_one((ref.run_id, type_, payload, ref.attempt, event_id), at, unless_exists=True)
    return Renewal.OK


@retry_on_lock()
def checkpoint(ref: AttemptRef, state: Any, count: int, at: datetime | None = None) -> Renewal:
    """Save resume state as checkpoint number `count`, renewing the lease."""
    at = at or now()
    with transaction.atomic():
        updated = AgentRun.objects.filter(ref.guard(), cancel_requested_at__isnull=True).update(
            checkpoint_state=state, checkpoint_count=count, lease_expires=ref.lease_until(at))
        if not updated:
            return _renew_locked(ref, at)
        _append_events([_lifecycle(ref.run_id, CHECKPOINT, ref.attempt, count=count)], at)
    return Renewal.OK


# --------------------------------------------------------------------------- settle


def settle_succeeded(ref: AttemptRef, output: Any, at: datetime | None = None) -> Settlement:
    return settle_succeeded_many(ref.worker_id, [(ref, output)], at)[ref]


@retry_on_lock()
def settle_succeeded_many(
    worker_id: str, items: Sequence[tuple[AttemptRef, Any]], at: datetime | None = None
) -> dict[AttemptRef, Settlement]:
    """Record successful attempts of one worker: one transaction, two statements, any count.

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
    done: set[int] | None = None
    if is_postgres() and not connection.in_atomic_block:
        # One statement, committed on its own: the UPDATE and the end events together.
        done = _succeed_in_one_statement(worker_id, rows, at)
    if done is None:
        sql, params = rawsql.settle_succeeded(rows, worker_id, Status.RUNNING, Status.SUCCEEDED,
                                              Reason.COMPLETED, SUCCEEDED, at,
                                              with_events=False)
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                done = {row[0] for row in cursor.fetchall()}
            _append_events([(run_id, SUCCEEDED, {}, attempt, event_id)
                            for run_id, attempt, _, event_id in rows if run_id in done], at)
            _announce_succeeded(items, done)
    else:
        _announce_succeeded(items, done)
    return {ref: Settlement.SUCCEEDED if ref.run_id in done else Settlement.LOST
            for ref, _ in items}


def _succeed_in_one_statement(
    worker_id: str, rows: list[tuple[int, int, Any, uuid.UUID]], at: datetime
) -> set[int] | None:
    """None when an event of these runs was appended after the statement's snapshot (an
    operator's cancel request, racing): its seq collided, nothing was written, and the
    caller writes in two statements instead, the second seeing that event."""
    sql, params = rawsql.settle_succeeded(rows, worker_id, Status.RUNNING, Status.SUCCEEDED,
                                          Reason.COMPLETED, SUCCEEDED, at, with_events=True)
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return {row[0] for row in cursor.fetchall()}
    except IntegrityError:
        return None


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
    at = at or now()
    with transaction.atomic():
        row = _locked_row(ref.guard())
        if row is None:
            return Settlement.LOST
        if interactive:
            decision = policy.Decision("dead_letter", reason=Reason.ERROR)
        else:
            decision = _decide(row, failure)
        return _apply(row, ref.guard(), decision, error, at, events=[])


@retry_on_lock()
def settle_cancelled(ref: AttemptRef, at: datetime | None = None) -> Settlement:
    """The attempt stopped because a cancel was requested."""
    at = at or now()
    with transaction.atomic():
        row = _locked_row(ref.guard())
        if row is None:
            return Settlement.LOST
        return _apply(row, ref.guard(), policy.Decision("cancel"), None, at, events=[])


@retry_on_lock()
def abandon(ref: AttemptRef, why: str, at: datetime | None = None) -> Settlement:
    """The worker gave up its own attempt (graceful stop): a failed attempt, as if it died."""
    at = at or now()
    with transaction.atomic():
        row = _locked_row(ref.guard())
        if row is None:
            return Settlement.LOST
        decision = _abandon_locked(row, ref.guard(), at, why=why, apply_backoff=True)
    return _settlement(decision)


def _locked_row(guard: Q) -> dict[str, Any] | None:
    qs = AgentRun.objects.filter(guard)
    if is_postgres():
        qs = qs.select_for_update()
    row: dict[str, Any] | None = qs.values(*_CLAIM_FIELDS).first()
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


def _abandon_locked(
    row: dict[str, Any], guard: Q, at: datetime, *, why: str, apply_backoff: bool
) -> policy.Decision | None:
    """Record a lost attempt as a failed one, then requeue, dead-letter or cancel it.

    `guard` is re-checked inside the UPDATE (the reaper's staleness check), so a
    heartbeat or settle that landed since the row was read wins, and this does nothing.
    """
    decision = _decide(row, policy.Failure(retryable=True))
    if decision.action == "retry" and not apply_backoff:
        decision = policy.Decision("retry", delay=0.0)
    error = ErrorInfo("AbandonedAttempt", f"the attempt was abandoned: {why}", "")
    events = [_lifecycle(row["id"], ABANDONED, row["attempt"], why=why,
                         worker=row["claimed_by"])]
    result = _apply(row, Q(pk=row["id"], status=Status.RUNNING, attempt=row["attempt"]) & guard,
                    decision, error, at, events=events)
    return None if result is Settlement.LOST else decision


def _apply(
    row: dict[str, Any], guard: Q, decision: policy.Decision, error: ErrorInfo | None,
    at: datetime, *, events: list[tuple[int, str, dict[str, Any], int, uuid.UUID]],
) -> Settlement:
    run_id, attempt = row["id"], row["attempt"]
    errors = {} if error is None else {
        "error_type": error.type[:255], "error_message": error.message,
        "error_traceback": error.traceback}
    described = {} if error is None else {"error_type": error.type,
                                            "message": error.message[:2000]}
    if decision.action == "retry":
        fields: dict[str, Any] = {
            "status": Status.QUEUED, "requeue_count": F("requeue_count") + 1,
            "available_at": at + timedelta(seconds=decision.delay),
            "claimed_by": "", "lease_expires": None, **errors}
        events.append(_lifecycle(run_id, RETRYING, attempt, delay=round(decision.delay, 3),
                                 requeue=row["requeue_count"] + 1, **described))
        settlement = Settlement.REQUEUED
    elif decision.action == "cancel":
        fields = {"status": Status.CANCELLED, "reason": Reason.CANCELLED, "finished_at": at,
                  "lease_expires": None, **errors}
        events.append(_lifecycle(run_id, CANCELLED, attempt, reason=row["cancel_reason"]))
        settlement = Settlement.CANCELLED
    else:
        fields = {"status": Status.FAILED, "reason": decision.reason, "finished_at": at,
                  "lease_expires": None, **errors}
        events.append(_lifecycle(run_id, DEAD_LETTERED, attempt, reason=decision.reason,
                                 **described))
        settlement = Settlement.DEAD_LETTERED
    if not AgentRun.objects.filter(guard).update(**fields):
        return Settlement.LOST
    _append_events(events, at)
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
    return {"retry": Settlement.REQUEUED, "cancel": Settlement.CANCELLED,
            "dead_letter": Settlement.DEAD_LETTERED}[decision.action]


# --------------------------------------------------------------------------- reaper


def find_stale(at: datetime, limit: int) -> list[dict[str, Any]]:
    """Running runs whose lease lapsed (interactive runs hold none and never appear)."""
    return list(lapsed(None, at).order_by("lease_expires")
                .values(*_CLAIM_FIELDS)[:limit])


@retry_on_lock()
def reap_one(row: dict[str, Any], at: datetime) -> Settlement:
    """Reclaim one stale run, re-checking inside the UPDATE that it is still stale."""
    with transaction.atomic():
        stale = Q(lease_expires__lt=at, claimed_by=row["claimed_by"])
        fresh = _locked_row(Q(pk=row["id"], status=Status.RUNNING, attempt=row["attempt"]) & stale)
        if fresh is None:
            return Settlement.LOST
        decision = _abandon_locked(fresh, stale, at, why="lease lapsed", apply_backoff=True)
        settlement = _settlement(decision)
        if settlement is not Settlement.LOST:
            send_after_commit(signals.run_reaped, run_id=row["id"], agent=row["agent"],
                              attempt=row["attempt"], outcome=settlement.value)
    return settlement


# --------------------------------------------------------------------------- operators


@retry_on_lock()
def cancel(run_id: int, reason: str = "", at: datetime | None = None) -> CancelResult | None:
    """Cancel a queued run now, or ask a running one to stop. None: no such run."""
    at = at or now()
    with transaction.atomic():
        qs = AgentRun.objects.filter(pk=run_id)
        if is_postgres():
            qs = qs.select_for_update()
        row = qs.values("status", "attempt", "cancel_requested_at", "agent").first()
        if row is None:
            return None
        if row["status"] == Status.QUEUED:
            AgentRun.objects.filter(pk=run_id, status=Status.QUEUED).update(
                status=Status.CANCELLED, reason=Reason.CANCELLED, finished_at=at,
                cancel_requested_at=at, cancel_reason=reason)
            _append_events([_lifecycle(run_id, CANCELLED, row["attempt"], reason=reason)], at)
            send_after_commit(signals.run_cancelled, run_id=run_id, agent=row["agent"],
                              attempt=row["attempt"], reason=reason)
            return CancelResult.CANCELLED
        if row["status"] == Status.RUNNING:
            if row["cancel_requested_at"] is not None:
                return CancelResult.ALREADY_REQUESTED
            AgentRun.objects.filter(pk=run_id, status=Status.RUNNING,
                                    cancel_requested_at__isnull=True).update(
                cancel_requested_at=at, cancel_reason=reason)
            _append_events([_lifecycle(run_id, CANCEL_REQUESTED, row["attempt"],
                                       reason=reason)], at)
            return CancelResult.REQUESTED
        return CancelResult.NOT_CANCELLABLE


@retry_on_lock()
def operator_retry(run_id: int, by: str = "", at: datetime | None = None) -> bool | None:
    """Send a failed or cancelled run back to the queue with a fresh requeue budget.

    None: no such run; False: it is not failed or cancelled (nothing written).
    """
    at = at or now()
    with transaction.atomic():
        row = AgentRun.objects.filter(pk=run_id).values("status", "attempt", "reason").first()
        if row is None:
            return None
        updated = AgentRun.objects.filter(
            pk=run_id, status__in=(Status.FAILED, Status.CANCELLED)).update(
            status=Status.QUEUED, reason=Reason.NONE, requeue_count=0, available_at=at,
            claimed_by="", lease_expires=None, finished_at=None, cancel_requested_at=None,
            cancel_reason="")
        if not updated:
            return False
        _append_events([_lifecycle(run_id, RETRIED, row["attempt"], by=by,
                                   previous=row["reason"])], at)
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
        _append_events([_lifecycle(run.pk, STARTED, 1, worker=worker_id)], at)
    return run
