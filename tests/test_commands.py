"""The management commands: arguments refused before any work, and `reap --dry-run`."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from django_agentruns import enqueue, transitions
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.registry import scope_policy
from django_agentruns.runtime.worker import Worker
from tests import helpers

BAD_RUNWORKER_ARGS: list[tuple[str, list[str], str]] = [
    ("concurrency-zero", ["--concurrency", "0"], "--concurrency"),
    ("concurrency-negative", ["--concurrency", "-3"], "--concurrency"),
    ("concurrency-word", ["--concurrency", "many"], "--concurrency"),
    ("concurrency-float", ["--concurrency", "2.5"], "--concurrency"),
    ("poll-negative", ["--poll-interval", "-1"], "--poll-interval"),
    ("poll-nan", ["--poll-interval", "nan"], "--poll-interval"),
    ("poll-inf", ["--poll-interval", "inf"], "--poll-interval"),
    ("poll-word", ["--poll-interval", "soon"], "--poll-interval"),
    ("grace-negative", ["--grace", "-5"], "--grace"),
    ("queues-comma", ["--queues", ","], "--queues"),
    ("queues-blank", ["--queues", " , ,"], "--queues"),
    ("queues-empty", ["--queues", ""], "--queues"),
    ("unknown-option", ["--concurency", "4"], "unrecognized"),
]


@pytest.fixture
def no_worker(monkeypatch: pytest.MonkeyPatch) -> list[Worker]:
    """Fail loudly if a command under test gets as far as starting a worker."""
    started: list[Worker] = []

    def refuse(self: Worker, install_signals: bool = True) -> Any:
        started.append(self)
        raise AssertionError("runworker started a worker despite bad arguments")

    monkeypatch.setattr(Worker, "run", refuse)
    return started


@pytest.mark.parametrize(("args", "named"), [c[1:] for c in BAD_RUNWORKER_ARGS],
                         ids=[c[0] for c in BAD_RUNWORKER_ARGS])
def test_runworker_refuses_bad_arguments(args: list[str], named: str,
                                         no_worker: list[Worker]) -> None:
    with pytest.raises(CommandError, match=named):
        call_command("runworker", *args)
    assert no_worker == []


@pytest.mark.parametrize(
    ("args", "queues", "concurrency", "poll"),
    [
        (["--queues", "a, b,,c", "--concurrency", "3", "--poll-interval", "0"], ["a", "b", "c"],
         3, 0.0),
        (["--poll-interval", "0.25"], ["default"], 1, 0.25),
    ],
    ids=["explicit", "defaults"],
)
def test_runworker_parses_good_arguments(
    monkeypatch: pytest.MonkeyPatch, args: list[str], queues: list[str], concurrency: int,
    poll: float,
) -> None:
    seen: list[Worker] = []

    def record(self: Worker, install_signals: bool = True) -> Any:
        seen.append(self)
        return self.stats

    monkeypatch.setattr(Worker, "run", record)
    out = StringIO()
    call_command("runworker", *args, stdout=out)
    (worker,) = seen
    assert (worker.queues, worker.concurrency, worker.poll_interval) == (queues, concurrency,
                                                                          poll)
    assert "claimed 0 runs" in out.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize(("args", "named"),
                         [(["--concurrency", "0"], "--concurrency"),
                          (["--queues", ","], "--queues"),
                          (["--poll-interval", "-1"], "--poll-interval")],
                         ids=["concurrency-zero", "queues-comma", "poll-negative"])
def test_runworker_from_the_command_line_exits_with_usage(
    worker_env: dict[str, str], args: list[str], named: str,
) -> None:
    enqueue("tests.once")  # a worker that started anyway would run it
    done = helpers.run_manage(["runworker", "--burst", *args], worker_env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "usage:" in done.stderr
    assert named in done.stderr
    assert AgentRun.objects.get().status == Status.QUEUED


def test_reap_refuses_a_bad_limit() -> None:
    with pytest.raises(CommandError, match="--limit"):
        call_command("reap", "--limit", "0")


# --------------------------------------------------------------------------- reap


def _stale_run() -> AgentRun:
    """A run claimed long ago by a worker that never renewed: its lease has lapsed."""
    run = enqueue("tests.noop")
    long_ago = timezone.now() - timedelta(minutes=5)
    AgentRun.objects.filter(pk=run.pk).update(available_at=long_ago)
    (claimed,) = transitions.claim("gone-worker", ["default"], 1, scope_policy(), {}, 2.0,
                                   long_ago)
    return claimed


def _snapshot() -> list[tuple[Any, ...]]:
    runs = list(AgentRun.objects.order_by("pk").values_list(
        "pk", "status", "attempt", "requeue_count", "claimed_by", "lease_expires",
        "available_at", "reason"))
    events = list(RunEvent.objects.order_by("pk").values_list("pk", "type"))
    return [*runs, *events]


@pytest.mark.django_db
def test_reap_dry_run_reports_and_changes_nothing() -> None:
    stale = _stale_run()
    enqueue("tests.noop")  # queued: not stale
    before = _snapshot()

    out = StringIO()
    call_command("reap", "--dry-run", stdout=out)
    assert out.getvalue().strip() == f"1 stale runs: [{stale.pk}]"
    assert _snapshot() == before

    # The same call without --dry-run does change it: the report above was not idle talk.
    out = StringIO()
    call_command("reap", stdout=out)
    assert "stale 1: requeued 1" in out.getvalue()
    reaped = AgentRun.objects.get(pk=stale.pk)
    assert (reaped.status, reaped.requeue_count, reaped.claimed_by) == (Status.QUEUED, 1, "")


@pytest.mark.django_db
def test_reap_dry_run_with_nothing_stale() -> None:
    enqueue("tests.noop")
    before = _snapshot()
    out = StringIO()
    call_command("reap", "--dry-run", stdout=out)
    assert out.getvalue().strip() == "0 stale runs: []"
    assert _snapshot() == before


@pytest.mark.django_db
def test_reap_dry_run_respects_the_limit() -> None:
    stale = sorted(_stale_run().pk for _ in range(3))
    out = StringIO()
    call_command("reap", "--dry-run", "--limit", "2", stdout=out)
    reported = out.getvalue().strip()
    assert reported.startswith("2 stale runs: ")
    assert AgentRun.objects.filter(pk__in=stale, status=Status.RUNNING).count() == 3
