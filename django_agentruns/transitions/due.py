"""Which runs a claim may take: the due query, firing order per scope, lapsed leases.

Built from the named reads of `AgentRun.objects` (django_agentruns.queries), and the due
query's SQL compiled once per shape for the claim.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet

from ..models import AgentLimit, AgentRun, Status
from ..outcomes import ScopePolicy
from ..rules.windows import settings_limits
from . import rawsql
from .fair import FAIR_ORDER
from .windows import full_window_keys


def due_queued(
    queues: Iterable[str], at: datetime, scopes: ScopePolicy,
    agents: frozenset[str] | None = None,
) -> QuerySet[AgentRun]:
    """Queued runs that can start now, in claim order: priority, due time, firing order;
    given `agents`, only theirs (see `RunQuerySet.of_agents`); none of a paused queue."""
    qs = AgentRun.objects.due(queues, at).of_agents(agents).unpaused()
    return qs.startable(scopes).order_by("-priority", "available_at", "fired_seq", "id")


def awaited(
    queues: Iterable[str], at: datetime, scopes: ScopePolicy,
    agents: frozenset[str] | None = None,
) -> QuerySet[AgentRun]:
    """Queued runs due by time that a worker will get to without outside help (see
    `RunQuerySet.awaited`); given `agents`, all but runs of other agents (a worker that
    has them takes those)."""
    qs = AgentRun.objects.of_agents(agents).awaited(queues, at, scopes).unpaused().exclude(
        Exists(stopped_keys(at).filter(key=OuterRef("limit_key"))))
    full = full_window_keys(at)
    return qs.exclude(limit_key__in=full) if full else qs


def stopped_keys(at: datetime) -> QuerySet[AgentLimit]:
    """Limits rows whose key no worker will start a run of by itself: closed (until a
    time, like a backoff) or paused (a limit of 0)."""
    paused = [key for key, n in settings_limits().items() if n == 0]
    return AgentLimit.objects.filter(
        Q(closed_until__gt=at) | Q(max_running=0) | Q(max_running__isnull=True, key__in=paused))


def lapsed(
    queues: Iterable[str] | None, at: datetime, agents: frozenset[str] | None = None
) -> QuerySet[AgentRun]:
    """Running runs whose lease has lapsed: their worker is gone (or too slow to count)."""
    return AgentRun.objects.lapsed(at, queues).of_agents(agents)


def due_elsewhere(
    queues: Iterable[str] | None, at: datetime, agents: frozenset[str]
) -> QuerySet[AgentRun]:
    """Queued, due runs of agents not in `agents`: a worker that has only `agents` leaves
    them to another (the metrics count them; a burst worker says it left them)."""
    qs = AgentRun.objects.filter(status=Status.QUEUED, available_at__lte=at).exclude(
        agent__in=sorted(agents))
    return qs if queues is None else qs.filter(queue__in=list(queues))


def unlimited_keys() -> Q:
    """Runs the ordinary claim may take: no limit key, or a key with no limits row."""
    return Q(limit_key="") | ~Q(Exists(AgentLimit.objects.filter(key=OuterRef("limit_key"))))


CLAIM_FIELDS = ("id", "agent", "status", "attempt", "requeue_count", "max_requeues",
                 "cancel_requested_at", "cancel_reason", "claimed_by", "scope", "fired_seq")


@functools.lru_cache(maxsize=512)
def compiled_due(
    vendor: str, queues: tuple[str, ...], scopes: ScopePolicy, limit: int, *, ids_only: bool,
    agents: frozenset[str] | None = None, naive: bool = False, fair: bool = False,
) -> rawsql.Compiled:
    """The due query's SQL for this shape, compiled once (`vendor` keys the cache).

    A worker's agents are fixed, so they are baked into the statement with its queues.
    `fair`: in fair order, the runs' stamps before their age (transitions.fair).
    """
    # Runs whose limit key has a row are the limited claim's (transitions.limited). A run
    # with no key (the common case) passes on the OR's first term: no subquery for it.
    qs = due_queued(queues, rawsql.sentinel_time(naive), scopes, agents).filter(unlimited_keys())
    if fair:
        qs = qs.order_by(*FAIR_ORDER)
    if vendor == "postgresql":
        qs = qs.select_for_update(skip_locked=True, of=("self",))
    with transaction.atomic():  # Django compiles FOR UPDATE only inside one (no statement runs)
        # ids_only: the one-statement claim, which needs only the id, and the start time
        # of the previous attempt to put back a run it must release.
        return rawsql.Compiled(qs.values("id", "started_at")[:limit] if ids_only
                               else qs[:limit], naive=naive)


def claim_row(run: AgentRun) -> dict[str, Any]:
    return {field: getattr(run, "pk" if field == "id" else field) for field in CLAIM_FIELDS}


def recheck_order(candidates: list[dict[str, Any]], scopes: ScopePolicy) -> list[dict[str, Any]]:
    """The claim stays the authority on firing order: re-check ordered runs under lock."""
    ordered = [c for c in candidates
               if c["status"] == Status.QUEUED and c["agent"] in scopes.ordered]
    if not ordered:
        return candidates
    held = set()
    taken_scopes: set[tuple[str, str]] = set()
    for c in ordered:
        key = (c["agent"], c["scope"])
        earlier = AgentRun.objects.ahead_of(c["agent"], c["scope"], c["fired_seq"], c["id"]) \
            .holding(c["agent"] in scopes.dead_letters_block)
        if key in taken_scopes or earlier.exists():
            held.add(c["id"])
        taken_scopes.add(key)
    return [c for c in candidates if c["id"] not in held]
