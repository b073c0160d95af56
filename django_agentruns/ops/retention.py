"""Retention and erasure: delete finished runs and every row they own, in short
transactions that load no payload.

`delete_runs` is the one place that knows every table a run owns (OWNED_BY_RUN) and every
link other runs keep to it (LINKS_TO_RUN): `purge`, `erase` and the chunk pruning all go
through it, so a table added later is handled everywhere once it is listed here (a test
fails for any model with a foreign key to AgentRun that is not).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import models, router, transaction
from django.db.models import Q, signals
from django.db.models.deletion import Collector
from django.utils import timezone

from ..exceptions import InvalidInputError, RunNotFinishedError, RunNotFoundError
from ..history_models import GraphCheckpoint, GraphWrite
from ..models import (
    TERMINAL,
    AgentRun,
    KeyWindowEntry,
    RunCheckpoint,
    RunEvent,
    RunPayload,
    RunStep,
    RunUsage,
    RunWait,
    StreamChunk,
)
from ..queries import dead_letter
from . import partitions

logger = logging.getLogger("django_agentruns.retention")

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# Longer ago than this reaches before the year 1 (nothing finished then anyway).
LONGEST_DURATION = timedelta(days=365 * 1000)

# Columns that can hold megabytes: never selected by a purge, whatever receivers want.
RUN_PAYLOADS = ("error_message", "cancel_reason")  # input, output: RunPayload rows
EVENT_PAYLOADS = ("payload",)

OWNED_BY_RUN: tuple[tuple[type[models.Model], str, tuple[str, ...]], ...] = (
    # (model, its foreign key to the run, its payload columns): rows deleted with the run.
    (RunEvent, "run", EVENT_PAYLOADS),
    (RunCheckpoint, "run", ("state",)),
    # The values kept out of the run row: input, output, traceback.
    (RunPayload, "run", ("value",)),
    (RunWait, "run", ("prompt", "payload")),  # waits and the deliveries stored on them
    (StreamChunk, "run", ("text",)),  # SQLite's live output on its way to the readers
    (RunStep, "run", ("result", "error")),  # durable steps (a fork keeps its own copies)
    # A limit key's window entries: a run deleted within its window leaves that room free.
    (KeyWindowEntry, "run", ()),
    (RunUsage, "run", ()),  # each recorded model call (the totals are the run's columns)
)
"""Every table whose rows belong to one run."""

CHUNK_GRACE = timedelta(seconds=60)
"""How long a finished run's live-output rows stay for readers before a prune takes them."""

LINKS_TO_RUN: tuple[tuple[type[models.Model], str], ...] = (
    # Other runs that point at a deleted run outlive it, with the link cleared.
    (AgentRun, "parent"),  # a child, finished or not, carries on as a run of its own
    (AgentRun, "forked_from"),  # a fork keeps its copied checkpoints, not the link
    # A graph's checkpoints belong to its thread, which outlives the run that wrote them.
    (GraphCheckpoint, "run"),
)


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
    partitions: list[str] | None = None  # dropped (or, dry run, droppable) partitions


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
    """Delete matching runs and every row they own, `batch_size` runs per short
    transaction; first the live-output rows any finished run left behind."""
    if batch_size < 1:
        raise InvalidInputError("batch_size must be at least 1")
    where = purgeable(older_than, statuses, include_dead_letters, at)
    report = PurgeReport()
    if dry_run:
        report.runs = AgentRun.objects.filter(where).count()
        if RunEvent._meta.db_table in partitions.partitioned_tables():
            # Events go with their partition, not with their run.
            report.partitions = partitions.drop(dry_run=True, going=where).dropped
        else:
            report.events = RunEvent.objects.filter(
                run_id__in=AgentRun.objects.filter(where).values("id")).count()
        return report
    prune_finished_chunks()
    # Partitioned history stays where it is: its partition goes once all its runs are gone.
    # A run's payloads (values kept out of its row) go with it all the same.
    keep = {m for m in partitions.HISTORY_MODELS if m is not RunPayload
            and m._meta.db_table in partitions.partitioned_tables()}
    while True:
        with transaction.atomic():
            # Locked (PostgreSQL; SQLite's IMMEDIATE transaction holds the write lock): an
            # operator retry cannot requeue a run between this read and its delete.
            batch = list(AgentRun.objects.filter(where).order_by("id").select_for_update()
                         .values_list("id", flat=True)[:batch_size])
            if not batch:
                break
            deleted = delete_runs(batch, batch_size, keep=keep)
        runs, events = deleted[AgentRun], deleted.get(RunEvent, 0)
        report.runs += runs
        report.events += events
        report.batches += 1
        if progress is not None:
            progress(report)
    if keep:
        report.partitions = partitions.drop().dropped
    return report


def delete_runs(run_ids: list[int], batch_size: int = 1000, *,
                keep: Iterable[type[models.Model]] = ()) -> dict[type[models.Model], int]:
    """Delete these runs and every row they own, but for the tables in `keep` (partitioned
    history, left to the partition's drop); clear the links other runs keep to them.
    Rows deleted per model. The caller holds the runs (a locked read in its transaction).

    The owned rows go first, by run, so the runs' own delete has nothing left to cascade
    to, and no payload column is ever read.
    """
    counts: dict[type[models.Model], int] = {}
    with transaction.atomic():
        for model, field, payloads in OWNED_BY_RUN:
            if model in keep:
                continue
            counts[model] = _delete_owned(model, field, payloads, run_ids, batch_size)
        for model, field in LINKS_TO_RUN:
            model._base_manager.filter(**{f"{field}_id__in": run_ids}).update(**{field: None})
        counts[AgentRun] = _delete_by_pk(AgentRun, run_ids, RUN_PAYLOADS)
    return counts


def _delete_owned(model: type[models.Model], field: str, payloads: tuple[str, ...],
                  run_ids: list[int], batch_size: int) -> int:
    """Delete the runs' rows of `model`, loading no payload and at most `batch_size` ids
    at once."""
    rows = model._base_manager.filter(**{f"{field}_id__in": run_ids})
    if not _has_receivers(model):
        deleted, _ = rows.delete()  # Django's fast delete: one DELETE, nothing loaded
        return deleted
    total = 0
    while ids := list(rows.order_by("pk").values_list("pk", flat=True)[:batch_size]):
        total += _delete_by_pk(model, ids, payloads)
    return total


def prune_finished_chunks(limit: int = 10_000, at: datetime | None = None) -> int:
    """Delete live-output rows (SQLite) of runs that finished over CHUNK_GRACE ago: what a
    crashed or stopped worker left behind. A finished run's text is in its stored `stream`
    events; the grace lets the web pollers read a run's last chunks first."""
    before = (at or timezone.now()) - CHUNK_GRACE
    finished = AgentRun.objects.filter(status__in=TERMINAL, finished_at__lt=before).values("id")
    ids = list(StreamChunk.objects.filter(run_id__in=finished).order_by("id")
               .values_list("id", flat=True)[:limit])
    if not ids:
        return 0
    deleted, _ = StreamChunk.objects.filter(id__in=ids).delete()
    return deleted


@dataclass
class ErasureReport:
    run_id: int
    rows: dict[str, int]


def erase(run_id: int, *, by: str = "") -> ErasureReport:
    """Delete one finished (or cancelled) run and everything it stored, now, in one
    transaction: a data-protection request. An unfinished run is refused (cancel it first),
    since its worker would go on writing rows for it. A LangGraph thread only this run wrote
    goes with it (`own_threads`); a shared one keeps its rows, unlinked."""
    with transaction.atomic():
        row = (AgentRun.objects.filter(pk=run_id).select_for_update()
               .values_list("status", flat=True).first())
        if row is None:
            raise RunNotFoundError(f"no run {run_id}")
        if row not in TERMINAL:
            raise RunNotFinishedError(
                f"run {run_id} is {row}: only a finished or cancelled run can be erased; "
                f"cancel it first")
        threads = own_threads(run_id)
        deleted = delete_runs([run_id])
        deleted[GraphWrite] = GraphWrite.objects.filter(thread_id__in=threads).delete()[0]
        deleted[GraphCheckpoint] = GraphCheckpoint.objects.filter(
            thread_id__in=threads).delete()[0]
    rows = {model._meta.model_name or model.__name__: count for model, count in deleted.items()}
    logger.info("run %s erased by %s (%s)", run_id, by or "an unnamed operator",
                ", ".join(f"{count} {name}" for name, count in rows.items()),
                extra={"run_id": run_id, "erased_by": by})
    return ErasureReport(run_id, rows)


def own_threads(run_id: int) -> list[str]:
    """The LangGraph threads (`GraphCheckpoint.thread_id`) whose every checkpoint this run
    wrote: no other run's, none written outside a run or by a run since purged (their link
    is cleared). Those are the run's own (`run_graph`'s default thread is `agentrun-<id>`);
    a thread shared with anything else is the application's, kept until it deletes it."""
    written = set(GraphCheckpoint.objects.filter(run_id=run_id)
                  .values_list("thread_id", flat=True).distinct())
    # exclude(run_id=...) keeps the rows with no run too: those make a thread shared.
    shared = set(GraphCheckpoint.objects.filter(thread_id__in=written).exclude(run_id=run_id)
                 .values_list("thread_id", flat=True).distinct())
    return sorted(written - shared)


def _delete_by_pk(model: type[models.Model], ids: list[int], payloads: tuple[str, ...]) -> int:
    """Delete rows by primary key as `QuerySet.delete()` would, signals included, but
    loading no payload column: receivers get instances with those fields deferred.

    Django's own delete loads every column of every row it collects (to hand receivers
    whole instances, or to follow the FK): 1,000 runs of 20 MB each is 20 GB of memory.
    The owned rows are already gone, so nothing is left to collect.
    """
    using = router.db_for_write(model)
    rows = model._base_manager.using(using).filter(pk__in=ids)
    collector = Collector(using=using, origin=rows)
    collector.collect(rows.defer(*payloads), collect_related=False)
    _, by_model = collector.delete()
    return by_model.get(model._meta.label, 0)


def _has_receivers(model: type[models.Model]) -> bool:
    return signals.pre_delete.has_listeners(model) or signals.post_delete.has_listeners(model)
