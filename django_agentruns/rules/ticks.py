"""When a schedule ticks: cron expressions (read by cronsim) and epoch-aligned intervals.

Pure: no models, so that `@agent(schedule=...)` can check its expression at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from django.utils import timezone

from ..exceptions import InvalidInputError

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MAX_EVERY = 366 * 86400


@dataclass(frozen=True)
class Timing:
    """When a schedule ticks: a cron expression in a time zone, or every N seconds."""

    cron: str = ""
    every: int | None = None
    tz: str = ""

    def zone(self) -> Any:
        return ZoneInfo(self.tz) if self.tz else timezone.get_default_timezone()

    def latest(self, at: datetime) -> datetime:
        """The latest tick at or before `at`."""
        if self.every:
            seconds = (at - EPOCH) // timedelta(seconds=self.every) * self.every
            return EPOCH + timedelta(seconds=seconds)
        # cronsim goes strictly before its start: start a second past `at`, truncated.
        start = at.astimezone(self.zone()).replace(microsecond=0) + timedelta(seconds=1)
        return next(CronSim(self.cron, start, reverse=True)).astimezone(UTC)

    def after(self, at: datetime) -> datetime:
        """The first tick strictly after `at`."""
        if self.every:
            return self.latest(at) + timedelta(seconds=self.every)
        return next(CronSim(self.cron, at.astimezone(self.zone()))).astimezone(UTC)

    def between(self, last: datetime, at: datetime, limit: int) -> list[datetime]:
        """Ticks in (last, at], at most the latest `limit` of them."""
        latest = self.latest(at)
        if latest <= last:
            return []
        if self.every:
            count = min(limit, (latest - last) // timedelta(seconds=self.every))
            return [latest - timedelta(seconds=self.every * k) for k in range(count)][::-1]
        ticks = [latest]
        back = CronSim(self.cron, latest.astimezone(self.zone()), reverse=True)
        while len(ticks) < limit:
            tick = next(back).astimezone(UTC)
            if tick <= last:
                break
            ticks.append(tick)
        return ticks[::-1]


def check_timing(cron: Any, every: Any, tz: Any, what: str) -> Timing:
    """A valid `Timing`, or `InvalidInputError` saying what is wrong (guarantee 10)."""
    if (cron is None) == (every is None):
        raise InvalidInputError(f"{what}: give exactly one of a cron expression or every=")
    if tz is not None and (not isinstance(tz, str) or not tz):
        raise InvalidInputError(f"{what}: tz must be an IANA time zone name, not {tz!r}")
    if tz:
        try:
            ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise InvalidInputError(f"{what}: unknown time zone {tz!r}") from None
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int) or \
                not 1 <= every <= MAX_EVERY:
            raise InvalidInputError(f"{what}: every must be whole seconds in 1..{MAX_EVERY}, "
                                    f"not {every!r}")
        return Timing(every=every, tz=tz or "")
    if not isinstance(cron, str) or len(cron) > 200:
        raise InvalidInputError(f"{what}: a cron expression is a string, not {cron!r:.80}")
    try:
        CronSim(cron, timezone.now())
    except (CronSimError, ValueError) as exc:
        raise InvalidInputError(f"{what}: bad cron expression {cron!r}: {exc}") from None
    return Timing(cron=cron, tz=tz or "")


