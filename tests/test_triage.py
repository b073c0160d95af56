"""The overview's reads (django_agentruns.ops.triage) and the metrics' split of blocked from due."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from django_agentruns.admin.chart import svg
from django_agentruns.models import AgentRun, Reason, Status
from django_agentruns.ops import metrics, triage, workers

pytestmark = pytest.mark.django_db


def finished(agent: str, status: str, reason: str, *, took: float, waited: float,
             ago: float = 60, **fields: Any) -> AgentRun:
    end = timezone.now() - timedelta(seconds=ago)
    start = end - timedelta(seconds=took)
    return AgentRun.objects.create(
        agent=agent, queue="default", status=status, reason=reason, attempt=1,
        created_at=start - timedelta(seconds=waited), available_at=start - timedelta(
            seconds=waited), started_at=start, finished_at=end, **fields)


def test_percentile_interpolates_as_percentile_cont() -> None:
    assert triage.percentile([], 0.5) is None
    assert triage.percentile([4.0], 0.95) == 4.0
    assert triage.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert triage.percentile([float(n) for n in range(1, 101)], 0.95) == pytest.approx(95.05)


def history() -> None:
    for n in range(1, 11):  # 1..10 s, waited n/10 s
        finished("a.fast", Status.SUCCEEDED, Reason.COMPLETED, took=n, waited=n / 10)
    finished("a.fast", Status.FAILED, Reason.NOT_RETRYABLE, took=20, waited=1)
    finished("a.fast", Status.FAILED, Reason.ERROR, took=1, waited=0)  # interactive: no DL
    finished("b.slow", Status.FAILED, Reason.RETRIES_EXHAUSTED, took=100, waited=5)
    AgentRun.objects.create(agent="b.slow", queue="default", status=Status.CANCELLED,
                            reason=Reason.CANCELLED, finished_at=timezone.now())  # never ran
    finished("c.old", Status.SUCCEEDED, Reason.COMPLETED, took=1, waited=1, ago=7200)


def check_stats(stats: list[triage.AgentStats]) -> None:
    by = {s.agent: s for s in stats}
    assert set(by) == {"a.fast", "b.slow"}  # c.old finished before the window
    fast, slow = by["a.fast"], by["b.slow"]
    assert (fast.runs, fast.succeeded, fast.dead_letters) == (12, 10, 1)
    assert fast.success_rate == pytest.approx(10 / 12)
    durations = [*range(1, 11), 20, 1]
    assert fast.duration_p50 == pytest.approx(triage.percentile(durations, 0.5), abs=1e-3)
    assert fast.duration_p95 == pytest.approx(triage.percentile(durations, 0.95), abs=1e-3)
    assert fast.wait_p95 == pytest.approx(
        triage.percentile([n / 10 for n in range(1, 11)] + [1, 0], 0.95), abs=1e-3)
    assert (slow.runs, slow.succeeded, slow.dead_letters) == (2, 0, 1)
    assert slow.duration_p50 == pytest.approx(100, abs=1e-3)
    assert [s.agent for s in stats] == ["a.fast", "b.slow"]  # dead letters, then runs


def test_agent_stats_in_python_over_a_sample() -> None:
    history()
    stats, sampled = triage.agent_stats(timezone.now() - timedelta(hours=1), in_database=False)
    check_stats(stats)
    assert not sampled


@pytest.mark.postgres_only
def test_agent_stats_in_postgresql_with_percentile_cont(
        django_assert_num_queries: Any) -> None:
    history()
    with django_assert_num_queries(2):
        stats, sampled = triage.agent_stats(timezone.now() - timedelta(hours=1))
    assert connection.vendor == "postgresql"
    check_stats(stats)
    assert not sampled


def test_the_sample_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triage, "SAMPLE", 3)
    history()
    stats, sampled = triage.agent_stats(timezone.now() - timedelta(hours=1), in_database=False)
    assert sampled
    assert sum(s.runs for s in stats) == 14  # counts are exact; percentiles are sampled


def test_blocked_runs_are_counted_apart_from_due_ones() -> None:
    now = timezone.now()
    head = AgentRun.objects.create(agent="tests.ordered", queue="default", scope="s",
                                   status=Status.RUNNING, available_at=now - timedelta(hours=1),
                                   lease_expires=now + timedelta(minutes=1))
    for n in range(3):  # behind the running head of their scope, waiting for an hour
        AgentRun.objects.create(agent="tests.ordered", queue="default", scope="s",
                                available_at=now - timedelta(hours=1), fired_seq=n + 1)
    AgentRun.objects.create(agent="tests.noop", queue="default",
                            available_at=now - timedelta(seconds=5))
    backlog = metrics.read_backlog(now)
    assert (backlog.due, backlog.blocked) == ({"default": 1}, {"default": 3})
    assert 5 <= backlog.oldest_due["default"] < 60  # not the hour the blocked runs waited
    family = {f.name: f for f in metrics.BacklogCollector(read=lambda: backlog).collect()}
    assert [s.value for s in family["agentruns_queue_blocked"].samples
            if s.labels["queue"] == "default"] == [3]
    workers.register(_Worker())
    [default] = [q for q in triage.queue_stats(workers.Coverage.read(now), now)
                 if q.queue == "default"]
    assert (default.due, default.blocked, default.running, default.workers) == (1, 3, 1, 1)
    assert head.pk


class _Worker:
    worker_id, queues, concurrency, agent_names = "w", ["default"], 1, ["tests.noop"]


def test_stuck_lists_lapsed_runs_not_yet_taken_back() -> None:
    now = timezone.now()
    lapsed = AgentRun.objects.create(agent="tests.noop", queue="default", status=Status.RUNNING,
                                     attempt=1, claimed_by="gone:1:x",
                                     lease_expires=now - timedelta(seconds=30))
    AgentRun.objects.create(agent="tests.noop", queue="default", status=Status.RUNNING,
                            attempt=1, claimed_by="alive",
                            lease_expires=now + timedelta(seconds=60))
    runs, total = triage.stuck(now)
    assert ([r.pk for r in runs], total) == ([lapsed.pk], 1)


def test_dead_letters_are_grouped_by_agent_class_and_reason_with_a_sample() -> None:
    for n in range(3):
        finished("a", Status.FAILED, Reason.RETRIES_EXHAUSTED, took=1, waited=0,
                 error_type="TimeoutError", error_message=f"timed out #{n}")
    finished("a", Status.FAILED, Reason.NOT_RETRYABLE, took=1, waited=0,
             error_type="TimeoutError", error_message="gave up")
    newest = finished("b", Status.FAILED, Reason.NOT_RETRYABLE, took=1, waited=0,
                      error_type="PermissionError", error_message="x" * 400)
    groups = triage.dead_letter_groups()
    assert [(g.agent, g.error_type, g.reason, g.count) for g in groups] == [
        ("a", "TimeoutError", "retries_exhausted", 3),
        ("a", "TimeoutError", "not_retryable", 1),
        ("b", "PermissionError", "not_retryable", 1)]
    assert groups[0].sample_message == "timed out #2"
    assert (groups[2].sample_id, groups[2].sample_message) == (newest.pk, "x" * 300)


def test_throughput_counts_per_minute_with_empty_minutes_as_zero() -> None:
    now = timezone.now().replace(second=30, microsecond=0)
    for ago, status, reason in [(0, Status.SUCCEEDED, Reason.COMPLETED),
                                (0, Status.FAILED, Reason.NOT_RETRYABLE),
                                (120, Status.SUCCEEDED, Reason.COMPLETED),
                                (7200, Status.SUCCEEDED, Reason.COMPLETED)]:
        AgentRun.objects.create(agent="a", queue="default", status=status, reason=reason,
                                finished_at=now - timedelta(seconds=ago))
    series = triage.throughput(now - timedelta(minutes=10), now)
    assert series.bucket == timedelta(minutes=1)
    assert len(series.finished) == 11
    assert series.finished[-1] == 2
    assert series.dead[-1] == 1
    assert series.finished[-3] == 1
    assert sum(series.finished) == 3
    hourly = triage.throughput(now - timedelta(hours=24), now)
    assert hourly.bucket == timedelta(hours=1)
    assert sum(hourly.finished) == 4
    chart = str(svg(series))
    assert chart.startswith('<svg id="agentruns-chart"')
    assert chart.count("<polyline") == 2
    assert "peak 2" in chart
