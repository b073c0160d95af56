"""Limits per key: the claim of runs whose key has a row in the limits table, and the
writes of that table (a limit set, a key closed by a 429).

A run with a limit key is claimed here only if its key has a row; a key with none is
unlimited, and the ordinary claim takes its runs with the rest (its due query skips every
key that has a row, in the same statement, so the two never both take a key's runs).

Race-free across workers: the claim locks the key's row (FOR UPDATE on PostgreSQL, the
database's write lock on SQLite), then counts the key's running runs in a statement that
starts after the lock is held (READ COMMITTED: a fresh snapshot), and starts at most the
room left, all in one transaction. Another worker claiming the same key waits on the row
lock and then counts what this one started.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Exists, OuterRef, Q

from ..db import is_postgres, retry_on_lock
from ..models import AgentLimit, AgentRun, KeyWindowEntry
from ..outcomes import ScopePolicy
from ..rules.windows import FIELDS, is_pattern, resolve, row_limits, settings_table
from .claiming import _announce_started, _start
from .due import claim_row, due_queued, recheck_order
from .events import STARTED, append_events, lifecycle, now
from .failover import move_to_open_keys
from .fair import FAIR_ORDER
from .windows import (
    Admission,
    WindowUse,
    entries_for,
    estimate_of,
    running_and_window_use,
    start_room,
    write_entries,
)


def open_at(at: datetime) -> Q:
    """Limits rows whose key is not closed at `at`."""
    return Q(closed_until__isnull=True) | Q(closed_until__lte=at)


def limits_in_use() -> bool:
    """Whether any key has a row, so that the limited claim has anything to look at."""
    return AgentLimit.objects.exists()


@retry_on_lock()
def claim_limited(
    worker_id: str,
    queues: Sequence[str],
    limit: int,
    scopes: ScopePolicy,
    lease_ttls: dict[str, float],
    default_ttl: float,
    at: datetime | None = None,
    *,
    agents: frozenset[str] | None = None,
    fair: bool = False,
) -> list[AgentRun]:
    """Take up to `limit` due runs of limited (or closed) keys for `worker_id`, never more
    of a key than its limit leaves room for, and none of a closed key; with `fair`, each
    key's runs in fair order (transitions.fair)."""
    at = at or now()
    if limit <= 0 or (agents is not None and not agents):
        return []
    due = AgentRun.objects.due(queues, at).of_agents(agents)
    # One statement: the keys with a due run, and the pattern rows ("tenant:*") whose
    # fields a matching key without its own takes.
    found = list(AgentLimit.objects.filter(
        Q(open_at(at), Exists(due.filter(limit_key=OuterRef("key")))) | Q(key__endswith="*"))
        .values("key", *FIELDS))
    patterns = {r["key"]: row_limits(r) for r in found if is_pattern(r["key"])}
    keys = [r["key"] for r in found if not is_pattern(r["key"])]
    if not keys:
        return []  # the common case: no transaction at all
    claimed: list[AgentRun] = []
    table = settings_table()
    with transaction.atomic():
        rows = AgentLimit.objects.filter(key__in=keys).order_by("key")
        if is_postgres():
            rows = rows.select_for_update()  # in key order: claimers never deadlock
        locked = [(r["key"], resolve(r["key"], row_limits(r), patterns, table),
                   r["closed_until"]) for r in rows.values("key", "closed_until", *FIELDS)]
        # After the locks: a fresh snapshot, which sees what other claimers committed.
        # One statement: the keys' running runs and their windows (transitions.windows).
        running, uses = running_and_window_use(
            keys, [key for key, limits, _ in locked if limits.windowed], at)
        entries: list[KeyWindowEntry] = []
        stuck: list[str] = []  # keys whose runs cannot start now: failover may move them
        for key, limits, closed_until in locked:
            if closed_until is not None and closed_until > at:
                stuck.append(key)
                continue  # closed since the keys were read
            own = limit  # what the key's limits leave room for, this batch aside
            if limits.max_running is not None:
                own = min(own, limits.max_running - running.get(key, 0))
            use = uses.get(key, WindowUse())
            starts = start_room(limits, use)
            if starts is not None:
                own = min(own, starts)
            room = min(own, limit - len(claimed))
            started: list[AgentRun] = []
            refused = False
            if room > 0:
                started, reserved, refused = _start_key(worker_id, key, queues, room, scopes,
                                               lease_ttls, default_ttl, at, agents,
                                               Admission(limits, use) if limits.windowed
                                               else None, fair)
                claimed += started
                if limits.windowed:
                    entries += entries_for(key, started, reserved, at)
            if own <= len(started) or refused:
                stuck.append(key)  # full now, or a token/cost window turned runs away
            if len(claimed) >= limit:
                break
        write_entries(entries)
        if stuck:
            move_to_open_keys(stuck, at)  # picked up by the next claim, under their keys
        append_events([lifecycle(r.pk, STARTED, r.attempt, worker=worker_id)
                       for r in claimed], at)
        _announce_started(claimed, worker_id)
    return claimed


def _start_key(
    worker_id: str, key: str, queues: Sequence[str], room: int, scopes: ScopePolicy,
    lease_ttls: dict[str, float], default_ttl: float, at: datetime,
    agents: frozenset[str] | None, admission: Admission | None, fair: bool = False,
) -> tuple[list[AgentRun], dict[int, tuple[int, float]], bool]:
    """Start up to `room` due runs of `key`, in claim order (with `fair`, fair order:
    transitions.fair); with `admission`, only while their estimates fit the key's token and
    cost windows (the reservations returned, and whether a window turned runs away)."""
    qs = due_queued(queues, at, scopes, agents).filter(limit_key=key)
    if fair:
        qs = qs.order_by(*FAIR_ORDER)
    if is_postgres():
        qs = qs.select_for_update(skip_locked=True, of=("self",))
    picked = list(qs[:room])
    ids = [c["id"] for c in recheck_order([claim_row(r) for r in picked], scopes)]
    reserved: dict[int, tuple[int, float]] = {}
    refused = False
    if admission is not None:
        agent_of = {r.pk: r.agent for r in picked}
        for run_id in ids:
            estimate = estimate_of(agent_of[run_id], admission.use)
            if not admission.admit(*estimate):
                break
            reserved[run_id] = estimate
        refused = len(reserved) < len(ids)
        ids = [run_id for run_id in ids if run_id in reserved]
    started = _start(worker_id, ids, {r.pk: r.agent for r in picked}, lease_ttls,
                     default_ttl, at, read_back=picked)
    return started, reserved, refused


# --------------------------------------------------------------------------- the table


def write_limit(key: str, fields: dict[str, Any], at: datetime | None = None) -> None:
    """Set the given fields of a key's limits (None: back to the setting); the others and
    its closure stay."""
    at = at or now()
    AgentLimit.objects.update_or_create(key=key, defaults={**fields, "updated_at": at})


def failover_key(keys: Any, closed: str, at: datetime) -> str | None:
    """The key a run of failover `keys` moves to when `closed` closes: the next in the list
    (round the end) that is open at `at`; None without one."""
    if not isinstance(keys, list) or closed not in keys:
        return None
    i = keys.index(closed)
    others = [k for k in keys[i + 1:] + keys[:i] if isinstance(k, str)]
    shut = set(AgentLimit.objects.filter(key__in=others, closed_until__gt=at)
               .values_list("key", flat=True))
    return next((k for k in others if k not in shut), None)


def close_key(key: str, until: datetime, reason: str, at: datetime | None = None) -> None:
    """No run of `key` starts before `until`, on any worker (a provider's 429). A later
    closure wins; an earlier one leaves it. Joins the caller's transaction."""
    at = at or now()
    AgentLimit.objects.get_or_create(key=key, defaults={"updated_at": at})
    AgentLimit.objects.filter(Q(closed_until__isnull=True) | Q(closed_until__lt=until),
                              key=key).update(closed_until=until, closed_reason=reason[:255],
                                              updated_at=at)


def open_key(key: str, at: datetime | None = None) -> bool:
    """End a key's closure now (an operator who knows the provider is back): its runs may
    start at the next claim. False if it was not closed."""
    at = at or now()
    return AgentLimit.objects.filter(key=key, closed_until__gt=at).update(
        closed_until=None, closed_reason="", updated_at=at) > 0


def seed_settings_limits() -> None:
    """A row for each key of the LIMITS setting, so that its runs go through the limited
    claim (a row's own `max_running` stays: set_limit overrides the setting)."""
    keys = [k for k in settings_table() if not is_pattern(k)]
    if keys:
        AgentLimit.objects.bulk_create([AgentLimit(key=k) for k in keys], ignore_conflicts=True)


class LimitedClaim:
    """A worker's claim of the runs of keys with a limits row (`claim_limited`).

    Whether any key has a row is read at most once per `refresh` seconds: until then a new
    row only delays its key's runs (the ordinary claim skips them in its own statement),
    never lets one past its limit. `seed` gives the LIMITS setting's keys their rows, at
    the worker's start.
    """

    def __init__(self, refresh: float = 1.0) -> None:
        self.refresh = refresh
        self._read_at = float("-inf")
        self._in_use = False

    def seed(self) -> None:
        seed_settings_limits()

    def in_use(self, *, fresh: bool = True) -> bool:
        now = time.monotonic()
        if fresh and now - self._read_at >= self.refresh:
            self._in_use = limits_in_use()
            self._read_at = now
        return self._in_use

    def claim(self, worker_id: str, queues: Sequence[str], batch: int, scopes: ScopePolicy,
              ttls: dict[str, float], default_ttl: float,
              agents: frozenset[str] | None, fair: bool = False, *,
              fresh: bool = True) -> list[AgentRun]:
        """`claim_limited`, if any key has a row; `fresh=False` trusts the view of that as
        it is, however old."""
        if not self.in_use(fresh=fresh) or batch <= 0:
            return []
        return claim_limited(worker_id, queues, batch, scopes, ttls, default_ttl,
                             agents=agents, fair=fair)
