"""The overview's reads: how each agent and queue is doing, what is stuck, what failed how.

Read-only, and bounded: every read is a grouped query over an index (finished_at, the
partial due and running indexes, status+reason), or a sample of at most `SAMPLE` rows.
Percentiles are the database's own `percentile_cont` on PostgreSQL; elsewhere they are
computed here over the newest `SAMPLE` finished runs of the window (and say so).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import Aggregate, Count, F, FloatField, Max, Q
from django.db.models.functions import Substr, TruncHour, TruncMinute
from django.utils import timezone

from ..models import AgentRun, PausedQueue, Reason, Status
from ..queues import paused_queues
from ..registry import all_agents
from .metrics import Backlog, read_backlog
from .workers import Coverage

SAMPLE = 10_000
GROUPS = 50
STUCK = 20


class EpochPercentile(Aggregate):
    """PostgreSQL: `percentile_cont(p)` of `end - start` in seconds."""

    function = "percentile_cont"
    arg_joiner = " - "
    output_field = FloatField()

    def __init__(self, end: str, start: str, p: float) -> None:
        self.p = float(p)
        super().__init__(F(end), F(start))

    def as_sql(self, compiler: Any, connection: Any, function: str | None = None,
               template: str | None = None, arg_joiner: str | None = None,
               **extra: Any) -> Any:
        template = (f"percentile_cont({self.p!r}) WITHIN GROUP "
                    "(ORDER BY EXTRACT(EPOCH FROM (%(expressions)s)))")
        return super().as_sql(compiler, connection, template=template, **extra)


def percentile(values: Sequence[float], p: float) -> float | None:
    """`percentile_cont`'s answer: linear interpolation between the closest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    rank = p * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class AgentStats:
    agent: str
    runs: int = 0
    succeeded: int = 0
    dead_letters: int = 0
    duration_p50: float | None = None
    duration_p95: float | None = None
    wait_p50: float | None = None
    wait_p95: float | None = None

    @property
    def success_rate(self) -> float | None:
        return None if not self.runs else self.succeeded / self.runs


def agent_stats(since: datetime, *, in_database: bool | None = None) -> tuple[list[AgentStats],
                                                                               bool]:
    """Runs that finished since `since`, per agent; and whether percentiles were sampled.

    Duration is the last attempt's (started to finished), queue wait the time from its
    being due to that attempt's start; runs cancelled before starting have neither.
    """
    if in_database is None:
        in_database = connection.vendor == "postgresql"
    finished = AgentRun.objects.for_reading().filter(finished_at__gte=since).order_by()
    stats = {row["agent"]: AgentStats(row["agent"], row["n"], row["ok"], row["dead"])
             for row in finished.values("agent").annotate(
                 n=Count("id"), ok=Count("id", filter=Q(status=Status.SUCCEEDED)),
                 dead=Count("id", filter=Q(status=Status.FAILED, reason__in=[
                     Reason.RETRIES_EXHAUSTED, Reason.NOT_RETRYABLE])))}
    started = finished.filter(started_at__isnull=False)
    sampled = False
    if in_database:
        for row in started.values("agent").annotate(
                d50=EpochPercentile("finished_at", "started_at", 0.5),
                d95=EpochPercentile("finished_at", "started_at", 0.95),
                w50=EpochPercentile("started_at", "available_at", 0.5),
                w95=EpochPercentile("started_at", "available_at", 0.95)):
            s = stats[row["agent"]]
            s.duration_p50, s.duration_p95 = row["d50"], row["d95"]
            s.wait_p50, s.wait_p95 = _clamp(row["w50"]), _clamp(row["w95"])
    else:
        rows = list(started.order_by("-finished_at").values_list(
            "agent", "started_at", "finished_at", "available_at")[:SAMPLE])
        sampled = len(rows) == SAMPLE
        durations: dict[str, list[float]] = {}
        waits: dict[str, list[float]] = {}
        for agent, start, end, due in rows:
            if end is None or start is None or due is None:
                continue
            durations.setdefault(agent, []).append((end - start).total_seconds())
            waits.setdefault(agent, []).append(max(0.0, (start - due).total_seconds()))
        for agent, values in durations.items():
            s = stats[agent]
            s.duration_p50, s.duration_p95 = percentile(values, 0.5), percentile(values, 0.95)
            s.wait_p50, s.wait_p95 = percentile(waits[agent], 0.5), percentile(waits[agent], 0.95)
    return sorted(stats.values(), key=lambda s: (-s.dead_letters, -s.runs, s.agent)), sampled


def _clamp(seconds: float | None) -> float | None:
    return None if seconds is None else max(0.0, seconds)


@dataclass
class QueueStats:
    queue: str
    due: int = 0
    blocked: int = 0
    scheduled: int = 0
    running: int = 0
    oldest_due: float | None = None
    workers: int = 0
    paused: PausedQueue | None = None


def queue_stats(coverage: Coverage, at: datetime | None = None,
                backlog: Backlog | None = None) -> list[QueueStats]:
    """Every queue something is in, or an agent or a live worker serves."""
    backlog = backlog or read_backlog(at)
    paused = paused_queues()
    names = (set(backlog.due) | set(backlog.blocked) | set(backlog.scheduled)
             | set(backlog.running) | set(coverage.queues) | set(paused)
             | {spec.effective_queue() for spec in all_agents().values()})
    return [QueueStats(q, backlog.due.get(q, 0), backlog.blocked.get(q, 0),
                       backlog.scheduled.get(q, 0), backlog.running.get(q, 0),
                       backlog.oldest_due.get(q), coverage.queues.get(q, 0), paused.get(q))
            for q in sorted(names)]


@dataclass(frozen=True)
class Uncovered:
    queue: str
    agent: str
    due: int
    why: str


def uncovered(coverage: Coverage, at: datetime | None = None,
              limit: int = GROUPS) -> list[Uncovered]:
    """Due runs, by queue and agent, that no live worker will take: none serves the queue,
    or none serving it has the agent (added after the workers started, say)."""
    rows = (AgentRun.objects.for_reading()
            .filter(status=Status.QUEUED, available_at__lte=at or timezone.now())
            .order_by().values("queue", "agent").annotate(n=Count("id"))
            .order_by("-n", "queue", "agent")[:limit])
    found = []
    for row in rows:
        gap = coverage.gap(AgentRun(queue=row["queue"], agent=row["agent"]))
        if gap:
            found.append(Uncovered(row["queue"], row["agent"], row["n"], gap))
    return found


def stuck(at: datetime | None = None, limit: int = STUCK) -> tuple[list[AgentRun], int]:
    """Running runs whose lease lapsed and that nobody has taken back yet (newest first)."""
    runs = AgentRun.objects.for_reading().lapsed(at or timezone.now()).order_by("lease_expires")
    fields = ("id", "agent", "queue", "scope", "attempt", "claimed_by", "lease_expires")
    return list(runs.only(*fields)[:limit]), runs.count()


@dataclass
class DeadLetterGroup:
    agent: str
    error_type: str
    reason: str
    count: int
    last: datetime | None
    sample_id: int
    sample_message: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def dead_letter_groups(limit: int = GROUPS) -> list[DeadLetterGroup]:
    """Dead letters by agent, error class and reason, largest first, each with the newest
    run's message as a sample."""
    rows = (AgentRun.objects.for_reading().dead_letters().order_by()
            .values("agent", "error_type", "reason")
            .annotate(n=Count("id"), last=Max("finished_at"), newest=Max("id"))
            .order_by("-n", "agent", "error_type")[:limit])
    groups = [DeadLetterGroup(r["agent"], r["error_type"], r["reason"], r["n"], r["last"],
                              r["newest"]) for r in rows]
    messages = dict(AgentRun.objects.for_reading().filter(pk__in=[g.sample_id for g in groups])
                    .values_list("pk", Substr("error_message", 1, 300)))
    for group in groups:
        group.sample_message = messages.get(group.sample_id, "")
    return groups


@dataclass(frozen=True)
class Series:
    """Runs finished and dead-lettered per bucket, oldest bucket first (zeros included)."""

    start: datetime
    bucket: timedelta
    finished: list[int]
    dead: list[int]


def throughput(since: datetime, at: datetime | None = None) -> Series:
    """Per minute (per hour past six hours) from `since` to `at`, one grouped query."""
    at = at or timezone.now()
    hourly = at - since > timedelta(hours=6)
    bucket = timedelta(hours=1) if hourly else timedelta(minutes=1)
    trunc = TruncHour if hourly else TruncMinute
    # In the current time zone, as Trunc* buckets: boundaries agree for any UTC offset.
    start = _floor(timezone.localtime(since), bucket)
    size = int((at - start) / bucket) + 1
    finished, dead = [0] * size, [0] * size
    rows = (AgentRun.objects.for_reading()
            .filter(finished_at__gte=start, finished_at__lte=at).order_by()
            .annotate(slot=trunc("finished_at")).values("slot")
            .annotate(n=Count("id"), dead=Count("id", filter=Q(
                status=Status.FAILED, reason__in=[Reason.RETRIES_EXHAUSTED,
                                                  Reason.NOT_RETRYABLE]))))
    for row in rows:
        index = int((row["slot"] - start) / bucket)
        if 0 <= index < size:
            finished[index] += row["n"]
            dead[index] += row["dead"]
    return Series(start, bucket, finished, dead)


def _floor(value: datetime, bucket: timedelta) -> datetime:
    value = value.replace(second=0, microsecond=0)
    return value.replace(minute=0) if bucket >= timedelta(hours=1) else value
