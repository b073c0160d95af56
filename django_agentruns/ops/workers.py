"""Who is serving: each worker's record of itself (`WorkerRecord`), for operators and `why`.

A worker registers at start, beats from its lease keeper (one UPDATE of one row, at most
every `beat_interval()`), and deletes its record on a graceful stop. A worker that died
leaves its record behind, no longer beating: `live(at)` leaves it out once `LEASE_TTL`
passes without a beat, as a run's lease would lapse. Records not seen for `PRUNE_AFTER`
are deleted at the next registration. Claims never read these rows: a missing or stale
record changes what an operator sees, never what runs.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from django.db.models import QuerySet
from django.utils import timezone

from ..conf import app_settings
from ..models import AgentRun, WorkerRecord
from ..queries import reading

logger = logging.getLogger("django_agentruns.worker")

PRUNE_AFTER = timedelta(days=1)
BEAT_AT_MOST = 5.0  # seconds: a beat is cheap, but a thousand workers beat too


class Serving(Protocol):
    """What a worker says about itself (`worker.Worker` has these)."""

    worker_id: str
    queues: list[str]
    concurrency: int

    @property
    def agent_names(self) -> list[str]: ...


def live_window() -> timedelta:
    """How long after its last beat a worker still counts as live: one lease TTL."""
    return timedelta(seconds=float(app_settings.LEASE_TTL))


def beat_interval() -> float:
    """Seconds between beats: a third of the lease TTL (as renewals), at most 5."""
    return min(BEAT_AT_MOST, float(app_settings.LEASE_TTL) / 3)


def _version() -> str:
    from ..conf import VERSION

    return VERSION


def register(worker: Serving, at: datetime | None = None) -> WorkerRecord:
    """Write (or rewrite) the worker's record, and prune records dead for `PRUNE_AFTER`."""
    at = at or timezone.now()
    WorkerRecord.objects.filter(last_seen_at__lt=at - PRUNE_AFTER).delete()
    record, _ = WorkerRecord.objects.update_or_create(
        worker_id=worker.worker_id,
        defaults={"host": socket.gethostname(), "pid": os.getpid(),
                  "queues": list(worker.queues), "concurrency": worker.concurrency,
                  "agents": sorted(worker.agent_names), "version": _version(),
                  "started_at": at, "last_seen_at": at})
    return record


def beat(worker_id: str, at: datetime | None = None) -> bool:
    """Say the worker is alive: one UPDATE. False if its record is gone (pruned, deleted)."""
    return WorkerRecord.objects.filter(worker_id=worker_id).update(
        last_seen_at=at or timezone.now()) > 0


def unregister(worker_id: str) -> None:
    """A graceful stop: the worker is not dead, it is gone; its record goes with it."""
    WorkerRecord.objects.filter(worker_id=worker_id).delete()


def live(at: datetime | None = None) -> QuerySet[WorkerRecord]:
    """The workers that beat within the last lease TTL."""
    at = at or timezone.now()
    return reading(WorkerRecord.objects.filter(last_seen_at__gte=at - live_window()))


def is_live(record: WorkerRecord, at: datetime | None = None) -> bool:
    return record.last_seen_at >= (at or timezone.now()) - live_window()


@dataclass(frozen=True)
class Coverage:
    """Which queues and agents the live workers serve, from one read of their records."""

    queues: dict[str, int]  # queue -> live workers serving it
    agents: dict[str, set[str]]  # agent -> queues of the live workers that have it
    workers: int

    @classmethod
    def read(cls, at: datetime | None = None) -> Coverage:
        queues: dict[str, int] = {}
        agents: dict[str, set[str]] = {}
        count = 0
        for record in live(at).only("queues", "agents"):
            count += 1
            for queue in record.queues:
                queues[queue] = queues.get(queue, 0) + 1
            for name in record.agents:
                agents.setdefault(name, set()).update(record.queues)
        return cls(queues, agents, count)

    def gap(self, run: AgentRun) -> str | None:
        """Why no live worker will take `run`, or None if one will (as far as records say)."""
        if not self.queues.get(run.queue):
            return f"no live worker serves queue {run.queue!r}" + (
                "" if self.workers else " (no worker has been seen in the last "
                f"{live_window().total_seconds():g}s)")
        if run.queue not in self.agents.get(run.agent, set()):
            return (f"no live worker serving queue {run.queue!r} has agent {run.agent!r}: "
                    "restart the workers after adding an agent (or run `runworker --reload` "
                    "in development)")
        return None


def live_ids(at: datetime | None = None) -> set[str]:
    """The ids of the live workers: one read, for a page of runs."""
    return set(live(at).values_list("worker_id", flat=True))


def lapse(run: AgentRun, live_workers: set[str], at: datetime | None = None) -> str | None:
    """A stuck run in words, "lease lapsed 42 s ago, worker w-1 gone"; None if its lease
    holds (or it is not running, or interactive: no lease)."""
    at = at or timezone.now()
    if run.status != "running" or run.lease_expires is None or run.lease_expires >= at:
        return None
    ago = (at - run.lease_expires).total_seconds()
    worker = run.claimed_by or "?"
    fate = "gone" if worker not in live_workers else "live but not renewing"
    return f"lease lapsed {ago:.0f} s ago, worker {worker} {fate}"


def rescuer(run: AgentRun, coverage: Coverage) -> str | None:
    """Who will take a stuck run back, as far as worker records say; None: nobody will
    (only a `manage.py reap` from cron, which leaves no record, or an operator)."""
    if coverage.workers and float(app_settings.REAP_INTERVAL) > 0:
        return (f"a live worker's own reap (every {float(app_settings.REAP_INTERVAL):g} s) "
                "will take it back")
    if coverage.queues.get(run.queue):
        return f"a live worker serving queue {run.queue!r} will take it back when it claims"
    return None


NOBODY_REAPS = ("no live worker will take it back, so it stays running until `manage.py "
                "reap` runs (from cron, or now) or an operator clicks Reap now in the admin")

