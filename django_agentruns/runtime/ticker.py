"""A worker's part in ticking schedules: one compare-and-set UPDATE per tick, no leader."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfoNotFoundError

from cronsim import CronSimError
from django.db import transaction
from django.utils import timezone

from ..conf import app_settings
from ..db import retry_on_lock
from ..exceptions import AgentRunsError
from ..models import PausedQueue, Schedule
from ..registry import AgentSpec
from ..schedules import sync_declared, timing_of

logger = logging.getLogger("django_agentruns.schedules")

REFRESH_INTERVAL = 1.0  # seconds between a worker's reads of the schedule rows
BACKOFF_START = 10.0  # seconds a schedule waits after its first failed tick
BACKOFF_MAX = 3600.0
ERROR_MAX = 2000


def backoff_delay(failures: int) -> timedelta:
    """Seconds before the next try after `failures` failed ticks in a row: 10, 20, 40, ...
    capped at an hour (from the 10th failure on: 10 * 2**9 = 5120 > 3600)."""
    return timedelta(seconds=min(BACKOFF_MAX, BACKOFF_START * 2 ** min(max(failures, 1) - 1,
                                                                        20)))


class Ticker:
    """A worker's part in ticking the schedules of its agents on its queues."""

    def __init__(self, agents: dict[str, AgentSpec], queues: Iterable[str]) -> None:
        served = set(queues)
        self._agents = sorted(n for n, s in agents.items() if s.effective_queue() in served)
        self._queues = {n: agents[n].effective_queue() for n in self._agents}
        self._declared = [agents[n] for n in self._agents]
        self._rows: list[Schedule] = []
        self._read_at = -math.inf
        self._synced = False
        # The first tick after each row's last_tick, by (id, last_tick, updated_at): most
        # passes of the worker's loop then compute no tick at all.
        self._due: dict[tuple[Any, ...], datetime] = {}

    def tick(self, at: datetime | None = None) -> int:
        """Enqueue the runs of every tick that has come; return how many this worker did."""
        if not self._agents:
            return 0
        if not self._synced:
            sync_declared(self._declared)
            self._synced = True
        if time.monotonic() - self._read_at >= REFRESH_INTERVAL:
            self._rows = list(Schedule.objects.filter(enabled=True, agent__in=self._agents))
            self._read_at = time.monotonic()
            self._due = {k: v for k, v in self._due.items()
                         if k in {self._key(r) for r in self._rows}}
        at = at or timezone.now()
        return sum(self._tick_one(row, at) for row in self._rows
                   if ((due := self._due_at(row)) is None or due <= at)
                   and (row.retry_at is None or row.retry_at <= at))

    def seconds_to_next(self, at: datetime | None = None) -> float | None:
        """Seconds until the next tick of a schedule this worker ticks (None: none)."""
        at = at or timezone.now()
        ticks = [max(due, row.retry_at) if row.retry_at else due for row in self._rows
                 if (due := self._due_at(row)) is not None]
        return max(0.0, (min(ticks) - at).total_seconds()) if ticks else None

    @staticmethod
    def _key(row: Schedule) -> tuple[Any, ...]:
        return (row.pk, row.last_tick, row.updated_at)

    def _due_at(self, row: Schedule) -> datetime | None:
        """When `row` ticks next after its last tick (None: now, or it cannot tell)."""
        if row.last_tick is None:
            return None
        key = self._key(row)
        if key not in self._due:
            try:
                self._due[key] = timing_of(row).after(row.last_tick)
            except (CronSimError, ValueError, ZoneInfoNotFoundError):
                return None  # _tick_one logs it
        return self._due[key]

    def _tick_one(self, row: Schedule, at: datetime) -> int:
        timing = timing_of(row)
        try:
            if row.last_tick is None:  # added in the admin: its first tick is the next one
                ticks: list[datetime] = []
                new_last = timing.latest(at)
            else:
                limit = int(app_settings.SCHEDULE_MAX_CATCH_UP) if row.catch_up else 1
                ticks = timing.between(row.last_tick, at, limit)
                if not ticks:
                    return 0
                new_last = ticks[-1]
        except (CronSimError, ValueError, ZoneInfoNotFoundError) as exc:
            logger.error("schedule %s cannot tick (%s): fix it in the admin", row.name, exc)
            return 0
        try:
            done = _advance(row, new_last, ticks, self._queues.get(row.agent))
        except AgentRunsError as exc:  # its input does not pass (a setting changed, ...)
            self._back_off(row, at, exc)
            return 0
        if done is None:  # another worker moved it first: read where it stands
            self._reread(row)
            return 0
        row.last_tick, row.failures, row.retry_at = new_last, 0, None
        return done

    def _back_off(self, row: Schedule, at: datetime, exc: Exception) -> None:
        """Record the failed tick on the row, so that no worker tries it again before
        `retry_at`; only the worker whose UPDATE recorded it logs it: once per backoff."""
        failures = row.failures + 1
        retry_at = at + backoff_delay(failures)
        recorded = Schedule.objects.filter(
            pk=row.pk, last_tick=row.last_tick, updated_at=row.updated_at,
            failures=row.failures,
        ).update(failures=failures, retry_at=retry_at, last_error=str(exc)[:ERROR_MAX])
        if not recorded:  # another worker recorded it (or the schedule was edited)
            self._reread(row)
            return
        row.failures, row.retry_at = failures, retry_at
        logger.error("schedule %s: could not enqueue its run (%s); failed %s time(s) in a "
                     "row, next try at %s", row.name, exc, failures, retry_at.isoformat(),
                     extra={"schedule": row.name, "failures": failures})

    @staticmethod
    def _reread(row: Schedule) -> None:
        fresh = Schedule.objects.filter(pk=row.pk).only(
            "last_tick", "updated_at", "failures", "retry_at").first()
        if fresh is not None:
            row.last_tick, row.updated_at = fresh.last_tick, fresh.updated_at
            row.failures, row.retry_at = fresh.failures, fresh.retry_at


@retry_on_lock()
def _advance(row: Schedule, new_last: datetime, ticks: list[datetime],
             queue: str | None) -> int | None:
    """Move `row.last_tick` to `new_last` if no one did since it was read (nor edited the
    schedule), and enqueue a run per tick in the same transaction. None: someone did.
    While the agent's queue is paused the ticks are skipped: no run, `last_tick` moves on."""
    from ..api import RunRequest, enqueue_many

    with transaction.atomic():
        moved = Schedule.objects.filter(
            pk=row.pk, enabled=True, last_tick=row.last_tick, updated_at=row.updated_at,
        ).update(last_tick=new_last, failures=0, retry_at=None, last_error="")
        if not moved:
            return None
        if ticks and queue is not None and PausedQueue.objects.filter(name=queue).exists():
            logger.info("schedule %s: skipped its tick %s (queue %s is paused)", row.name,
                        ticks[-1].isoformat(), queue)
            return 0
        enqueue_many([RunRequest(row.agent, {**row.input, "tick": tick.isoformat()})
                      for tick in ticks])
    if ticks:
        logger.info("schedule %s: enqueued %s run(s) for %s", row.name, len(ticks),
                    ticks[-1].isoformat())
    return len(ticks)
