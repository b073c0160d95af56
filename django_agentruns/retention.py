"""Retention: delete finished runs and their events, in batches that hold no long locks."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import models, router, transaction
from django.db.models import Q, signals
from django.db.models.deletion import Collector
from django.utils import timezone

from .exceptions import InvalidInputError
from .models import TERMINAL, AgentRun, RunCheckpoint, RunEvent, RunStep
from .queries import dead_letter

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# Longer ago than this reaches before the year 1 (nothing finished then anyway).
LONGEST_DURATION = timedelta(days=365 * 1000)

# Columns that can hold megabytes: never selected by a purge, whatever receivers want.
RUN_PAYLOADS = ("input", "output", "checkpoint_state", "error_message", "error_traceback",
                "cancel_reason")
EVENT_PAYLOADS = ("payload",)


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
        where &= ~dead_letter()
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
            # Locked (PostgreSQL; SQLite's IMMEDIATE transaction holds the write lock): an
            # operator retry cannot requeue a run between this read and its delete.
            batch = list(AgentRun.objects.filter(where).order_by("id").select_for_update()
                         .values_list("id", flat=True)[:batch_size])
            if not batch:
                return report
            # Events first, by run, so the runs' delete has nothing left to cascade to;
            # the checkpoint history goes with them, and forks keep no link to a purged run.
            events = _delete_events(batch, batch_size)
            RunCheckpoint.objects.filter(run_id__in=batch).delete()  # fast: one DELETE
            RunStep.objects.filter(run_id__in=batch).delete()  # the steps too (forks copy theirs)
            AgentRun.objects.filter(forked_from_id__in=batch).update(forked_from=None)
            runs = _delete_by_pk(AgentRun, batch, RUN_PAYLOADS)
        report.runs += runs
        report.events += events
        report.batches += 1
        if progress is not None:
            progress(report)


def _delete_events(run_ids: list[int], batch_size: int) -> int:
    """Delete the runs' events, loading no payload and at most `batch_size` rows at once."""
    events = RunEvent.objects.filter(run_id__in=run_ids)
    if not _has_receivers(RunEvent):
        deleted, _ = events.delete()  # Django's fast delete: one DELETE, nothing loaded
        return deleted
    total = 0
    while ids := list(events.order_by("id").values_list("id", flat=True)[:batch_size]):
        total += _delete_by_pk(RunEvent, ids, EVENT_PAYLOADS)
    return total


def _delete_by_pk(model: type[models.Model], ids: list[int], payloads: tuple[str, ...]) -> int:
    """Delete rows by primary key as `QuerySet.delete()` would, signals included, but
    loading no payload column: receivers get instances with those fields deferred.

    Django's own delete loads every column of every row it collects (to hand receivers
    whole instances, or to follow the FK): 1,000 runs of 20 MB each is 20 GB of memory.
    The related rows (events) are already gone, so nothing is left to collect.
    """
    using = router.db_for_write(model)
    rows = model._base_manager.using(using).filter(pk__in=ids)
    collector = Collector(using=using, origin=rows)
    collector.collect(rows.defer(*payloads), collect_related=False)
    _, by_model = collector.delete()
    return by_model.get(model._meta.label, 0)


def _has_receivers(model: type[models.Model]) -> bool:
    return signals.pre_delete.has_listeners(model) or signals.post_delete.has_listeners(model)
