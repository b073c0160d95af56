"""The backlog as the metrics read it: per queue (due, blocked, scheduled, running,
lapsed, waiting, paused), the dead letters per reason, the closed limit keys, and the due
runs of agents this process lacks. Read-only; `metrics.BacklogCollector` caches it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Count, Min, Q, Value
from django.utils import timezone

from ..states import Status


@dataclass(frozen=True)
class Backlog:
    """One reading of the backlog, per queue, and of the dead letters, per reason."""

    due: dict[str, int] = field(default_factory=dict)
    """Queued runs due now that may start: what the workers have yet to take."""
    blocked: dict[str, int] = field(default_factory=dict)
    """Queued runs due now but held back, on purpose, by an earlier run of their scope."""
    scheduled: dict[str, int] = field(default_factory=dict)
    """Queued runs not due yet (backing off after a failure, or enqueued with run_after)."""
    oldest_due: dict[str, float] = field(default_factory=dict)
    """Seconds the longest-waiting due run that may start has been due."""
    running: dict[str, int] = field(default_factory=dict)
    lapsed: dict[str, int] = field(default_factory=dict)
    """Running runs whose lease has lapsed: their worker died or stalled, and the reaper
    (or a claim) has not taken them back yet. Non-zero for long: no reaper is running."""
    waiting: dict[str, int] = field(default_factory=dict)
    """Runs waiting for a delivery, an approval or their child runs (no lease, no slot)."""
    paused: dict[str, int] = field(default_factory=dict)
    """1 for each paused queue (`pause_queue`): its workers claim nothing from it."""
    dead_letters: dict[str, int] = field(default_factory=dict)
    closed_keys: dict[str, float] = field(default_factory=dict)
    """Limit keys closed by a 429, with the seconds until they reopen."""
    window_fill: dict[tuple[str, str], float] = field(default_factory=dict)
    """How full each window of each limit key with windows is, by (key, window): 1 is full."""
    unknown_agents: dict[tuple[str, str], int] = field(default_factory=dict)
    """Due runs of agents not registered in this process, by (queue, agent): a worker
    claims only runs of agents it has, so its workers leave these to others."""


def read_backlog(at: datetime | None = None) -> Backlog:
    """Four grouped COUNTs, three answered from an index that holds only what it counts,
    the few paused queues, and the closed limit keys (a read of the small limits table).

    The queued runs come from the partial due index (status='queued'), the running and
    waiting ones from the status+reason index, the dead letters from the status+reason
    index: the size of the history (succeeded runs) costs nothing here. A due run of an
    ordered agent is also looked up in the scope-head index, to count it as blocked or not.
    The fourth reads the queued rows (the backlog, not the history) for their agent.
    """
    from ..models import AgentLimit, AgentRun, PausedQueue
    from ..queries import reading
    from ..registry import all_agents, scope_policy
    from ..rules.windows import FIELDS
    from ..transitions import window_fill
    from .visibility import count_due_elsewhere

    at = at or timezone.now()
    backlog = Backlog()
    due = Q(available_at__lte=at)
    # Runs held back by an earlier run of their scope wait on purpose: counted apart, so a
    # long ordered backlog does not read as workers falling behind.
    scope_held = AgentRun.objects.held(scope_policy())  # a condition (Q), no read
    startable = due if scope_held is None else due & ~scope_held
    queued = (AgentRun.objects.for_reading().filter(status=Status.QUEUED).order_by()
              .values("queue")
              .annotate(due=Count("id", filter=startable),
                        blocked=Count("id", filter=due & scope_held)
                        if scope_held is not None else Value(0),
                        later=Count("id", filter=Q(available_at__gt=at)),
                        oldest=Min("available_at", filter=startable)))
    for row in queued:
        backlog.due[row["queue"]] = row["due"]
        backlog.blocked[row["queue"]] = row["blocked"]
        backlog.scheduled[row["queue"]] = row["later"]
        if row["oldest"] is not None:
            backlog.oldest_due[row["queue"]] = max(0.0, (at - row["oldest"]).total_seconds())
    # Running and waiting runs: two ranges of the status+reason index, whatever the history.
    running = (AgentRun.objects.for_reading()
               .filter(status__in=(Status.RUNNING, Status.WAITING)).order_by()
               .values("queue")
               .annotate(n=Count("id", filter=Q(status=Status.RUNNING)),
                         lapsed=Count("id", filter=Q(status=Status.RUNNING,
                                                     lease_expires__lt=at)),
                         waiting=Count("id", filter=Q(status=Status.WAITING))))
    for held in running:
        if held["n"]:
            backlog.running[held["queue"]] = held["n"]
            backlog.lapsed[held["queue"]] = held["lapsed"]
        if held["waiting"]:
            backlog.waiting[held["queue"]] = held["waiting"]
    backlog.paused.update((name, 1) for name in
                          reading(PausedQueue.objects.all()).values_list("name", flat=True))
    dead = (AgentRun.objects.for_reading().dead_letters()
            .order_by().values("reason").annotate(n=Count("id")))
    backlog.dead_letters.update((row["reason"], row["n"]) for row in dead)
    backlog.unknown_agents.update(count_due_elsewhere(None, frozenset(all_agents()), at,
                                                          replica=True))
    limits = list(reading(AgentLimit.objects.all()).values("key", "closed_until", *FIELDS))
    backlog.closed_keys.update((row["key"], (row["closed_until"] - at).total_seconds())
                               for row in limits
                               if row["closed_until"] is not None and row["closed_until"] > at)
    backlog.window_fill.update(window_fill(at, limits))
    return backlog
