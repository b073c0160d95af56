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
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from .exceptions import InvalidInputError
from .models import Schedule
from .registry import NAME_PATTERN, AgentSpec, get_agent
from .rules.ticks import Timing, check_timing
from .validation import capped_json

logger = logging.getLogger("django_agentruns.schedules")

# The tick a run gets, as long as any: checking a schedule's input with it checks the
# input its runs will have.
SAMPLE_TICK = "2000-01-01T00:00:00+00:00"


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

