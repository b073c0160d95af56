"""Which runs a claim may take: the due query, firing order per scope, lapsed leases.

Querysets (the admin and `why` read them too) and the due query's SQL compiled once per
shape for the claim.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q, QuerySet

from ..db import AmongUnindexed, RowBefore
from ..models import AgentRun, Status
from ..outcomes import ScopePolicy
from . import rawsql


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


def of_agents(qs: QuerySet[AgentRun], agents: frozenset[str] | None) -> QuerySet[AgentRun]:
    """Only runs of `agents` (None: of any agent).

    A worker claims only runs of agents it has, so that in a rolling deploy an old worker
    leaves a new agent's runs to a new worker instead of dead-lettering them. A filter on
    the due (or running) index's scan that no index on `agent` can serve: the claim keeps
    the due index's order whatever the planner's statistics say.
    """
    return qs if agents is None else qs.filter(AmongUnindexed(F("agent"), sorted(agents)))


def due_queued(
    queues: Iterable[str], at: datetime, scopes: ScopePolicy,
    agents: frozenset[str] | None = None,
) -> QuerySet[AgentRun]:
    """Queued runs that can start now, in claim order: priority, due time, firing order."""
    qs = of_agents(AgentRun.objects.filter(status=Status.QUEUED, queue__in=list(queues),
                                           available_at__lte=at), agents)
    return startable(qs, scopes).order_by("-priority", "available_at", "fired_seq", "id")


def awaited(
    queues: Iterable[str], at: datetime, scopes: ScopePolicy,
    agents: frozenset[str] | None = None,
) -> QuerySet[AgentRun]:
    """Queued runs due by time that a worker will get to without outside help.

    That is, all but those behind a run no worker releases: a dead letter (where the agent
    says it blocks) or a run still backing off; and, given `agents`, all but runs of other
    agents (a worker that has them takes those). A burst worker whose claim came back
    empty waits while any of these remain (another worker holds them, or the run ahead of
    them), and exits past the rest.
    """
    qs = of_agents(AgentRun.objects.filter(status=Status.QUEUED, queue__in=list(queues),
                                           available_at__lte=at), agents)
    for ordered, blocking in ((scopes.ordered - scopes.dead_letters_block, False),
                              (scopes.ordered & scopes.dead_letters_block, True)):
        stuck = Q(status=Status.QUEUED, available_at__gt=at)
        if blocking:
            stuck |= Q(status=Status.FAILED)
        if ordered:
            qs = qs.filter(~Q(agent__in=ordered) | ~Exists(ahead_in_scope().filter(stuck)))
    return qs


def lapsed(
    queues: Iterable[str] | None, at: datetime, agents: frozenset[str] | None = None
) -> QuerySet[AgentRun]:
    """Running runs whose lease has lapsed: their worker is gone (or too slow to count)."""
    qs = of_agents(AgentRun.objects.filter(status=Status.RUNNING, lease_expires__lt=at), agents)
    return qs if queues is None else qs.filter(queue__in=list(queues))


def due_elsewhere(
    queues: Iterable[str] | None, at: datetime, agents: frozenset[str]
) -> QuerySet[AgentRun]:
    """Queued, due runs of agents not in `agents`: a worker that has only `agents` leaves
    them to another (the metrics count them; a burst worker says it left them)."""
    qs = AgentRun.objects.filter(status=Status.QUEUED, available_at__lte=at).exclude(
        agent__in=sorted(agents))
    return qs if queues is None else qs.filter(queue__in=list(queues))


CLAIM_FIELDS = ("id", "agent", "status", "attempt", "requeue_count", "max_requeues",
                 "cancel_requested_at", "cancel_reason", "claimed_by", "scope", "fired_seq")


@functools.lru_cache(maxsize=512)
def compiled_due(
    vendor: str, queues: tuple[str, ...], scopes: ScopePolicy, limit: int, *, ids_only: bool,
    agents: frozenset[str] | None = None,
) -> rawsql.Compiled:
    """The due query's SQL for this shape, compiled once (`vendor` keys the cache).

    A worker's agents are fixed, so they are baked into the statement with its queues.
    """
    qs = due_queued(queues, rawsql.SENTINEL_TIME, scopes, agents)
    if vendor == "postgresql":
        qs = qs.select_for_update(skip_locked=True, of=("self",))
    with transaction.atomic():  # Django compiles FOR UPDATE only inside one (no statement runs)
        # ids_only: the one-statement claim, which needs only the id, and the start time
        # of the previous attempt to put back a run it must release.
        return rawsql.Compiled(qs.values("id", "started_at")[:limit] if ids_only
                               else qs[:limit])


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
        statuses = holding_statuses(c["agent"] in scopes.dead_letters_block)
        earlier = AgentRun.objects.filter(agent=c["agent"], scope=c["scope"],
                                          status__in=statuses).filter(
            Q(fired_seq__lt=c["fired_seq"]) | Q(fired_seq=c["fired_seq"], id__lt=c["id"]))
        if key in taken_scopes or earlier.exists():
            held.add(c["id"])
        taken_scopes.add(key)
    return [c for c in candidates if c["id"] not in held]
