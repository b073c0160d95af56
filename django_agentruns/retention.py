"""Retention: delete finished runs and their events, in batches that hold no long locks."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from .exceptions import InvalidInputError
from .models import DEAD_LETTER_REASONS, TERMINAL, AgentRun, RunEvent, Status

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# Longer ago than this reaches before the year 1 (nothing finished then anyway).
LONGEST_DURATION = timedelta(days=365 * 1000)


def parse_duration(text: str) -> timedelta:
    """`90s`, `15m`, `12h`, `30d`, `2w` -> a timedelta."""
    match = DURATION.match(text)
    if not match:
        raise InvalidInputError(f"a duration is a number and a unit (s, m, h, d, w), e.g. 30d; "
                                f"not {text!r}")
    seconds = float(match[1]) * UNITS[match[2]]
    if seconds > LONGEST_DURATION.total_seconds():
        raise InvalidInputError(f"a duration is at most {LONGEST_DURATION.days}d (1000 years), "
                                f"not {text!r}")
    return timedelta(seconds=seconds)


@dataclass
class PurgeReport:
    runs: int = 0
    events: int = 0
    batches: int = 0


def purgeable(
    older_than: timedelta, statuses: Iterable[str] | None = None,
    include_dead_letters: bool = False, at: datetime | None = None,
) -> Q:
    """Finished runs that ended before `at - older_than`; dead letters only if asked."""
    chosen = list(statuses) if statuses is not None else list(TERMINAL)
    unknown = set(chosen) - set(TERMINAL)
    if unknown:
        raise InvalidInputError(f"only finished runs can be purged ({', '.join(TERMINAL)}); "
                                f"not {', '.join(sorted(unknown))}")
    try:
        cutoff = (at or timezone.now()) - older_than
    except OverflowError:
        raise InvalidInputError(f"older_than reaches before the year 1: {older_than!r}") from None
    where = Q(status__in=chosen, finished_at__lt=cutoff)
    if not include_dead_letters:
        where &= ~Q(status=Status.FAILED, reason__in=DEAD_LETTER_REASONS)
    return where


def purge(
    older_than: timedelta, *, statuses: Iterable[str] | None = None,
    include_dead_letters: bool = False, batch_size: int = 1000, dry_run: bool = False,
    at: datetime | None = None, progress: Callable[[PurgeReport], None] | None = None,
) -> PurgeReport:
    """Delete matching runs and their events, `batch_size` runs per short transaction."""
    if batch_size < 1:
        raise InvalidInputError("batch_size must be at least 1")
    where = purgeable(older_than, statuses, include_dead_letters, at)
    report = PurgeReport()
    if dry_run:
        report.runs = AgentRun.objects.filter(where).count()
        report.events = RunEvent.objects.filter(
            run_id__in=AgentRun.objects.filter(where).values("id")).count()
        return report
    while True:
        with transaction.atomic():
            batch = list(AgentRun.objects.filter(where).order_by("id")
                         .values_list("id", flat=True)[:batch_size])
            if not batch:
                return report
            # Events first, by run: the FK would cascade, but one statement per table
            # keeps the batch to two index-driven deletes.
            events, _ = RunEvent.objects.filter(run_id__in=batch).delete()
            _, by_model = AgentRun.objects.filter(id__in=batch).delete()
        report.runs += by_model.get(AgentRun._meta.label, 0)
        report.events += events
        report.batches += 1
        if progress is not None:
            progress(report)
