"""Retention: `purge` deletes old finished runs and their events, keeps dead letters."""

from __future__ import annotations

import threading
import tracemalloc
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction
from django.db.models.signals import post_delete, pre_delete
from django.dispatch import Signal
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_agentruns import retry
from django_agentruns.exceptions import InvalidInputError
from django_agentruns.models import (
    AgentRun,
    Reason,
    RunCheckpoint,
    RunEvent,
    RunPayload,
    Status,
)
from django_agentruns.ops import partitions
from django_agentruns.ops.retention import parse_duration, purge
from tests import helpers

# Each test runs on plain history tables and on partitioned ones (tests/conftest.py).
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("history_layout")]

OLD = timezone.now() - timedelta(days=40)


def purged_events(n: int) -> int:
    """Events a purge deletes with its runs: none when history is partitioned (they go
    with their partition, tests/test_partitions.py)."""
    return 0 if partitions.partitioned_tables() else n


def make(status: str, reason: str = "", finished_days_ago: float | None = 40,
         events: int = 2) -> AgentRun:
    finished = None if finished_days_ago is None else \
        timezone.now() - timedelta(days=finished_days_ago)
    run = AgentRun.objects.create(agent="tests.noop", queue="default", status=status,
                                  reason=reason, finished_at=finished, created_at=OLD)
    import uuid

    RunEvent.objects.bulk_create(RunEvent(run=run, seq=i + 1, event_id=uuid.uuid4(), type="x")
                                 for i in range(events))
    return run


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("15m", 900), ("12h", 43200),
                                               ("30d", 2592000), ("2w", 1209600),
                                               ("1.5h", 5400)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "30", "d", "30 days", "-1d", "1y"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(InvalidInputError, match="duration"):
        parse_duration(text)


def test_purge_deletes_old_finished_runs_and_their_events_only() -> None:
    old_ok = make(Status.SUCCEEDED, Reason.COMPLETED)
    old_cancelled = make(Status.CANCELLED, Reason.CANCELLED)
    dead = make(Status.FAILED, Reason.RETRIES_EXHAUSTED)
    interactive_error = make(Status.FAILED, Reason.ERROR)
    recent = make(Status.SUCCEEDED, Reason.COMPLETED, finished_days_ago=1)
    queued = make(Status.QUEUED, finished_days_ago=None)
    running = make(Status.RUNNING, finished_days_ago=None)

    report = purge(timedelta(days=30), batch_size=2)

    assert report.runs == 3
    assert report.events == purged_events(6)
    assert report.batches == 2
    left = set(AgentRun.objects.values_list("id", flat=True))
    assert left == {dead.pk, recent.pk, queued.pk, running.pk}
    assert RunEvent.objects.filter(
        run_id__in=[old_ok.pk, old_cancelled.pk, interactive_error.pk]).count() == \
        6 - purged_events(6)
    assert RunEvent.objects.filter(run_id=dead.pk).count() == 2


def test_dead_letters_go_only_when_asked() -> None:
    dead = make(Status.FAILED, Reason.NOT_RETRYABLE)
    assert purge(timedelta(days=30)).runs == 0
    assert purge(timedelta(days=30), include_dead_letters=True).runs == 1
    assert not AgentRun.objects.filter(pk=dead.pk).exists()


def test_status_filter_and_dry_run() -> None:
    make(Status.SUCCEEDED, Reason.COMPLETED)
    cancelled = make(Status.CANCELLED, Reason.CANCELLED)
    dry = purge(timedelta(days=30), statuses=["cancelled"], dry_run=True)
    assert (dry.runs, dry.events) == (1, purged_events(2))
    assert AgentRun.objects.count() == 2
    assert purge(timedelta(days=30), statuses=["cancelled"]).runs == 1
    assert not AgentRun.objects.filter(pk=cancelled.pk).exists()


def test_unfinished_statuses_cannot_be_purged() -> None:
    with pytest.raises(InvalidInputError, match="only finished runs"):
        purge(timedelta(days=1), statuses=["running"])


def test_the_command_prints_counts() -> None:
    make(Status.SUCCEEDED, Reason.COMPLETED)
    out = StringIO()
    call_command("purge", "--older-than", "30d", "--dry-run", stdout=out)
    assert out.getvalue().strip() == f"would delete 1 runs and {purged_events(2)} events"
    out = StringIO()
    call_command("purge", "--older-than", "30d", stdout=out)
    assert out.getvalue().strip() == f"deleted 1 runs and {purged_events(2)} events"
    assert AgentRun.objects.count() == 0


@pytest.mark.parametrize("args", [["--older-than", "soon"], ["--older-than", "1d", "--status",
                                                             "queued"],
                                  ["--older-than", "1d", "--batch-size", "0"]])
def test_the_command_refuses_bad_arguments(args: list[str]) -> None:
    with pytest.raises(CommandError):
        call_command("purge", *args)


# --------------------------------------------------------------------------- payloads stay unread

BIG = "x" * 2_000_000  # per column: a purge that loaded rows would hold megabytes per run
PAYLOAD_COLUMNS = ('"input"', '"output"', '"state"', '"value"', '"payload"')


def make_big(runs: int, events: int) -> list[int]:
    ids = [make(Status.SUCCEEDED, Reason.COMPLETED, events=events).pk for _ in range(runs)]
    # Written past the size caps on purpose: what purge must cope with is what is stored.
    AgentRun.objects.filter(pk__in=ids).update(checkpoint_count=1)
    helpers.store_payloads(ids, RunPayload.INPUT, {"blob": BIG})
    helpers.store_payloads(ids, RunPayload.OUTPUT, {"blob": BIG})
    RunCheckpoint.objects.bulk_create(
        RunCheckpoint(run_id=pk, number=1, state={"blob": BIG}) for pk in ids)
    RunPayload.objects.bulk_create(
        RunPayload(run_id=pk, kind=RunPayload.TRACEBACK, value=BIG) for pk in ids)
    RunEvent.objects.filter(run_id__in=ids).update(payload={"blob": BIG})
    return ids


@pytest.fixture(params=["no receivers", "receivers"])
def deleted_by_receivers(request: pytest.FixtureRequest) -> Iterator[list[tuple[str, int]]]:
    """(model, pk) per pre_delete and post_delete sent, with receivers on both models when
    the param asks; they must still get every row, as from `QuerySet.delete()`."""
    seen: list[tuple[str, int]] = []
    if request.param == "no receivers":
        yield seen
        return

    def receiver(sender: type, instance: Any, signal: Signal, **kwargs: Any) -> None:
        seen.append((f"{'pre' if signal is pre_delete else 'post'}:{sender.__name__}",
                     instance.pk))

    hooks = [(s, m) for s in (pre_delete, post_delete) for m in (AgentRun, RunEvent)]
    for signal, model in hooks:
        signal.connect(receiver, sender=model, weak=False)
    try:
        yield seen
    finally:
        for signal, model in hooks:
            signal.disconnect(receiver, sender=model)


def test_purge_never_selects_a_payload_column(
        deleted_by_receivers: list[tuple[str, int]]) -> None:
    ids = make_big(runs=3, events=2)
    kept = make(Status.SUCCEEDED, Reason.COMPLETED, finished_days_ago=1)
    event_ids = list(RunEvent.objects.filter(run_id__in=ids).values_list("id", flat=True))

    with CaptureQueriesContext(connection) as queries:
        report = purge(timedelta(days=30), batch_size=2)

    assert (report.runs, report.events, report.batches) == (3, purged_events(6), 2)
    assert list(AgentRun.objects.values_list("id", flat=True)) == [kept.pk]
    assert RunEvent.objects.count() == 8 - purged_events(6)
    reads = [q["sql"] for q in queries.captured_queries
             if q["sql"].lstrip().upper().startswith("SELECT")]
    assert reads, "purge read no ids?"
    for sql in reads:
        assert not any(column in sql for column in PAYLOAD_COLUMNS), sql
    if deleted_by_receivers:
        for when in ("pre", "post"):
            assert sorted(pk for name, pk in deleted_by_receivers
                          if name == f"{when}:AgentRun") == sorted(ids)
            # A dropped partition sends no signal: nor do its rows, left to the drop.
            assert sorted(pk for name, pk in deleted_by_receivers
                          if name == f"{when}:RunEvent") == \
                (sorted(event_ids) if purged_events(1) else [])


def test_purge_memory_stays_below_one_payload(
        deleted_by_receivers: list[tuple[str, int]]) -> None:
    make_big(runs=4, events=1)
    tracemalloc.start()
    try:
        report = purge(timedelta(days=30))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.runs == 4
    # Loading the rows would hold 4 runs x 4 columns + 4 events of 2 MB each (32+ MB).
    assert peak < len(BIG), f"purge peaked at {peak} bytes"


# --------------------------------------------------------------------------- racing an operator


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_run_retried_while_purge_reads_its_batch_is_kept() -> None:
    """The batch's rows are locked as they are read: a retry committing first takes the run
    out of the batch (without the lock, purge would delete the queued run by id)."""
    run = make(Status.FAILED, Reason.ERROR)
    done: list[int] = []

    def purging() -> None:
        try:
            done.append(purge(timedelta(days=30)).runs)
        finally:
            connections.close_all()  # this thread's own connection

    thread = threading.Thread(target=purging, name="test-purge")
    with transaction.atomic():
        assert retry(run.pk)  # holds the row's lock until this commits
        thread.start()
        helpers.wait_until(_waiting_for_a_lock, message="purge to wait for the row")
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert done == [0]
    run.refresh_from_db()
    assert run.status == Status.QUEUED
    assert RunEvent.objects.filter(run_id=run.pk, type="x").count() == 2


def _waiting_for_a_lock() -> bool:
    with connection.cursor() as cursor:
        # Activity is read once per transaction unless the snapshot is cleared.
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                       "current_database() AND wait_event_type = 'Lock'")
        return bool(cursor.fetchone()[0])
