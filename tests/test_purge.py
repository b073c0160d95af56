"""Retention: `purge` deletes old finished runs and their events, keeps dead letters."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from django_agentruns.exceptions import InvalidInputError
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.retention import parse_duration, purge

pytestmark = pytest.mark.django_db

OLD = timezone.now() - timedelta(days=40)


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
    assert report.events == 6
    assert report.batches == 2
    left = set(AgentRun.objects.values_list("id", flat=True))
    assert left == {dead.pk, recent.pk, queued.pk, running.pk}
    assert not RunEvent.objects.filter(
        run_id__in=[old_ok.pk, old_cancelled.pk, interactive_error.pk]).exists()
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
    assert (dry.runs, dry.events) == (1, 2)
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
    assert out.getvalue().strip() == "would delete 1 runs and 2 events"
    out = StringIO()
    call_command("purge", "--older-than", "30d", stdout=out)
    assert out.getvalue().strip() == "deleted 1 runs and 2 events"
    assert AgentRun.objects.count() == 0


@pytest.mark.parametrize("args", [["--older-than", "soon"], ["--older-than", "1d", "--status",
                                                             "queued"],
                                  ["--older-than", "1d", "--batch-size", "0"]])
def test_the_command_refuses_bad_arguments(args: list[str]) -> None:
    with pytest.raises(CommandError):
        call_command("purge", *args)
