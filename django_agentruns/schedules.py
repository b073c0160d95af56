"""Schedules: one run per tick of a cron expression or an interval, however many workers.

Every schedule is a `Schedule` row: those declared with `@agent(schedule=..., every=...)`
are written by the workers that have the agent (origin "code"), the others by
`add_schedule` or the admin. Each worker serving the agent's queue takes part in ticking
(`Ticker`): the tick whose time has come moves the row's `last_tick` forward in one
compare-and-set UPDATE (guarded by the value it read), and the runs are enqueued in the
same transaction. One worker's UPDATE matches; the others' find `last_tick` moved and
enqueue nothing. No leader, no lock held between ticks: a unique step per schedule and tick.

A tick whose run cannot be enqueued (its input over a cap, its agent's `limit_key` raising
on it) backs off on the row (`failures`, `retry_at`, `last_error`), 10 s doubling up to an
hour, logged once per backoff by the worker whose UPDATE recorded it. A tick that comes
while the agent's queue is paused is skipped (`last_tick` moves on, no run): resuming the
queue releases no burst, and the next tick after it runs as usual.

Ticks are in UTC in the run's input (`input["tick"]`, ISO 8601). Cron expressions are
read by cronsim in the schedule's time zone (default `TIME_ZONE`), so "0 7 * * *" is 7:00
local time across DST changes; intervals are aligned to the Unix epoch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfoNotFoundError

from cronsim import CronSimError
from django.db import IntegrityError, transaction
from django.utils import timezone

from .conf import app_settings
from .db import retry_on_lock
from .exceptions import AgentRunsError, InvalidInputError
from .models import PausedQueue, Schedule
from .registry import NAME_PATTERN, AgentSpec, get_agent
from .ticks import Timing, check_timing
from .validation import capped_json

logger = logging.getLogger("django_agentruns.schedules")

REFRESH_INTERVAL = 1.0  # seconds between a worker's reads of the schedule rows
BACKOFF_START = 10.0  # seconds a schedule waits after its first failed tick
BACKOFF_MAX = 3600.0
# The tick a run gets, as long as any: checking a schedule's input with it checks the
# input its runs will have.
SAMPLE_TICK = "2000-01-01T00:00:00+00:00"
ERROR_MAX = 2000


def backoff_delay(failures: int) -> timedelta:
    """Seconds before the next try after `failures` failed ticks in a row: 10, 20, 40, ...
    capped at an hour (from the 10th failure on: 10 * 2**9 = 5120 > 3600)."""
    return timedelta(seconds=min(BACKOFF_MAX, BACKOFF_START * 2 ** min(max(failures, 1) - 1,
                                                                        20)))


def timing_of(schedule: Schedule) -> Timing:
    return Timing(cron=schedule.cron, every=schedule.every, tz=schedule.tz)


def next_tick(schedule: Schedule, at: datetime | None = None) -> datetime:
    """When `schedule` ticks next (after its last tick, or `at` if later)."""
    at = at or timezone.now()
    start = max(at, schedule.last_tick) if schedule.last_tick else at
    return timing_of(schedule).after(start)


# --------------------------------------------------------------------------- the API


def add_schedule(name: str, agent: str, *, cron: str | None = None, every: int | None = None,
                 input: dict[str, Any] | None = None, tz: str | None = None) -> Schedule:
    """Store a schedule: a run of `agent` per tick of `cron` (in `tz`, default TIME_ZONE)
    or `every` seconds, with `input` plus the tick's time under "tick". Its first tick is
    the next one to come. Adding a name again replaces that schedule (it keeps its place).

    Raises `InvalidInputError` or `UnknownAgentError` before anything is written.
    """
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidInputError(f"Schedule name {name!r:.80} must be 1-200 characters of "
                                "letters, digits and _ . : -")
    spec = get_agent(agent)
    timing = check_timing(cron, every, tz, f"Schedule {name!r}")
    payload = check_schedule_input(spec.name, input, f"Input of schedule {name!r}")
    at = timezone.now()
    with transaction.atomic():
        existing = Schedule.objects.select_for_update().filter(name=name).first()
        if existing is not None and existing.origin == Schedule.Origin.CODE:
            raise InvalidInputError(f"Schedule {name!r} is declared by @agent({name!r}, ...): "
                                    "change it in the code")
        row = existing or Schedule(name=name, origin=Schedule.Origin.DATABASE)
        if existing is None or timing != timing_of(existing):
            row.last_tick = timing.latest(at)
        row.agent, row.cron, row.every, row.tz = spec.name, timing.cron, timing.every, timing.tz
        row.input = payload
        row.failures, row.retry_at, row.last_error = 0, None, ""  # edited: try it again
        row.save()
    return row


def remove_schedule(name: str) -> bool:
    """Delete a schedule added at run time; False if there is none by that name. One
    declared on an agent is removed from the code (`@agent(..., schedule=...)`)."""
    row = Schedule.objects.filter(name=name).values_list("origin", flat=True).first()
    if row == Schedule.Origin.CODE:
        raise InvalidInputError(f"Schedule {name!r} is declared by @agent({name!r}, ...): "
                                "remove it from the code")
    deleted, _ = Schedule.objects.filter(name=name, origin=Schedule.Origin.DATABASE).delete()
    return bool(deleted)


def check_schedule_input(agent: str, value: Any, what: str) -> dict[str, Any]:
    """Refuse an input whose runs `enqueue` would refuse (size with the tick, a NUL
    character, the agent's `limit_key` raising on it): such a schedule could never tick."""
    from .api import RunRequest, check_request  # api imports the models' users

    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise InvalidInputError(f"{what} must be a JSON object (its runs get the tick in it), "
                                f"not {type(value).__name__}")
    capped_json(value, what, "MAX_INPUT_BYTES")
    check_request(RunRequest(agent, {**value, "tick": SAMPLE_TICK}))
    return value


def sync_declared(agents: Iterable[AgentSpec]) -> None:
    """Write the rows of schedules declared on `agents`, and drop those no longer declared.

    A row left as it is written nothing (workers start often); `enabled` is the admin's to
    change. Racing workers insert one row: the loser's INSERT fails, and it moves on.
    """
    at = timezone.now()
    for spec in agents:
        current = Schedule.objects.filter(name=spec.name).first()
        if spec.schedule_timing is None:
            if current is not None and current.origin == Schedule.Origin.CODE:
                Schedule.objects.filter(pk=current.pk, origin=Schedule.Origin.CODE).delete()
            continue
        timing = spec.schedule_timing
        if current is not None and current.origin != Schedule.Origin.CODE:
            logger.warning("agent %s declares a schedule, but a schedule of that name was "
                           "added at run time: keeping that one", spec.name)
            continue
        if current is not None and timing == timing_of(current) \
                and current.catch_up == spec.catch_up and current.agent == spec.name:
            continue
        row = current or Schedule(name=spec.name, origin=Schedule.Origin.CODE)
        if current is None or timing != timing_of(current):
            row.last_tick = timing.latest(at)
        row.agent, row.cron, row.every, row.tz = spec.name, timing.cron, timing.every, timing.tz
        row.catch_up = spec.catch_up
        try:
            with transaction.atomic():
                row.save()
        except IntegrityError:
            pass  # another worker wrote it first


# --------------------------------------------------------------------------- ticking


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
    from .api import RunRequest, enqueue_many  # api imports the models' users

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
