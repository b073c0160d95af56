"""Prometheus metrics: attempts by outcome, queue wait and duration, the backlog gauges.

Counters and histograms are read back from prometheus_client's default registry as
deltas (they are process-wide); the backlog gauges from a collector with an injected
clock. Scraping (the view, `runworker --metrics-port`, no prometheus_client) is tested in
tests/test_metrics_serving.py.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections
from django.db.models import F
from django.utils import timezone

from django_agentruns import enqueue
from django_agentruns.models import AgentRun, Reason, Status
from django_agentruns.ops import metrics
from django_agentruns.runtime.worker import Worker

try:
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:  # the skip below says what to install
    REGISTRY = None

# In CI (CI=true) a missing extra is a failure, not a skip: the `test` extra installs it.
MAY_SKIP = not os.environ.get("CI")
pytestmark = pytest.mark.skipif(MAY_SKIP and REGISTRY is None, reason="prometheus_client is "
                                "not installed: pip install 'django-agentruns[prometheus]'")



def _observed() -> Any:
    """The worker's own metrics, without the backlog collector (which reads the database)."""
    registry = CollectorRegistry()
    for metric in (metrics.ATTEMPTS, metrics.QUEUE_WAIT, metrics.DURATION):
        registry.register(metric)
    return registry


OBSERVED = _observed() if REGISTRY is not None else None


def sample(name: str, **labels: str) -> float:
    return OBSERVED.get_sample_value(name, labels) or 0.0


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def burst() -> None:
    """Run everything due with an in-process worker (it joins its threads on return)."""
    Worker(burst=True, reap_interval=0).run(install_signals=False)


def make_user(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(
        content_type__app_label="django_agentruns", codename__in=codenames))
    return user


# --------------------------------------------------------------------------- observations


def test_observe_settlement_counts_the_attempt_and_observes_wait_and_duration() -> None:
    labels = {"agent": "tests.metrics_unit"}
    before = (sample("agentruns_attempts_total", outcome="requeued", **labels),
              sample("agentruns_queue_wait_seconds_count", **labels),
              sample("agentruns_queue_wait_seconds_sum", **labels),
              sample("agentruns_attempt_duration_seconds_bucket", outcome="requeued", le="2.5",
                     **labels))

    metrics.observe_settlement("tests.metrics_unit", "requeued", 0.75, 3.0)
    metrics.observe_settlement("tests.metrics_unit", "requeued", None, None)  # interactive

    assert sample("agentruns_attempts_total", outcome="requeued", **labels) == before[0] + 2
    assert sample("agentruns_queue_wait_seconds_count", **labels) == before[1] + 1
    assert sample("agentruns_queue_wait_seconds_sum", **labels) == before[2] + 0.75
    assert sample("agentruns_attempt_duration_seconds_bucket", outcome="requeued", le="2.5",
                  **labels) == before[3]  # 3 s is above the 2.5 s bucket
    assert sample("agentruns_attempt_duration_seconds_bucket", outcome="requeued", le="5.0",
                  **labels) >= 1


def test_a_worker_counts_every_settlement_by_agent_and_outcome(transactional_db: None) -> None:
    def counts() -> dict[tuple[str, str], float]:
        return {(agent, outcome): sample("agentruns_attempts_total", agent=agent,
                                         outcome=outcome)
                for agent, outcome in [("tests.flaky", "requeued"), ("tests.flaky", "succeeded"),
                                       ("tests.not_retryable", "dead_lettered"),
                                       ("tests.steps", "succeeded")]}

    before = counts()
    waits_before = {le: sample("agentruns_queue_wait_seconds_bucket", agent="tests.steps", le=le)
                    for le in ("2.5", "10.0")}
    durations_before = {le: sample("agentruns_attempt_duration_seconds_bucket",
                                   agent="tests.steps", outcome="succeeded", le=le)
                        for le in ("0.25", "5.0")}
    enqueue("tests.flaky", {"succeed_on": 2})
    enqueue("tests.not_retryable")
    steps = enqueue("tests.steps", {"steps": 3, "sleep": 0.1})
    # Due five seconds ago: its queue wait is at least that.
    AgentRun.objects.filter(pk=steps.pk).update(available_at=F("available_at") -
                                                timedelta(seconds=5))

    burst()

    after = counts()
    assert {key: after[key] - before[key] for key in after} == {
        ("tests.flaky", "requeued"): 1, ("tests.flaky", "succeeded"): 1,
        ("tests.not_retryable", "dead_lettered"): 1, ("tests.steps", "succeeded"): 1}
    waited = {le: sample("agentruns_queue_wait_seconds_bucket", agent="tests.steps", le=le) -
              waits_before[le] for le in waits_before}
    assert waited == {"2.5": 0, "10.0": 1}
    took = {le: sample("agentruns_attempt_duration_seconds_bucket", agent="tests.steps",
                       outcome="succeeded", le=le) - durations_before[le]
            for le in durations_before}
    assert took == {"0.25": 0, "5.0": 1}  # three steps of 0.1 s


# --------------------------------------------------------------------------- backlog gauges


def make_backlog() -> None:
    """Runs in every state, made directly (test data, not transitions)."""
    now = timezone.now()
    for queue, available_at, status, reason in [
        ("default", now - timedelta(seconds=30), Status.QUEUED, ""),
        ("default", now - timedelta(seconds=2), Status.QUEUED, ""),
        ("default", now + timedelta(hours=1), Status.QUEUED, ""),
        ("mail", now, Status.QUEUED, ""),
        ("mail", now, Status.RUNNING, ""),
        ("default", now, Status.RUNNING, ""),
        ("default", now, Status.FAILED, Reason.NOT_RETRYABLE),
        ("mail", now, Status.FAILED, Reason.RETRIES_EXHAUSTED),
        ("mail", now, Status.FAILED, Reason.RETRIES_EXHAUSTED),
        ("default", now, Status.FAILED, Reason.ERROR),  # an interactive failure
        ("default", now, Status.CANCELLED, Reason.CANCELLED),
        *[("default", now, Status.SUCCEEDED, Reason.COMPLETED)] * 3,
    ]:
        AgentRun.objects.create(agent="tests.noop", queue=queue, available_at=available_at,
                                status=status, reason=reason)


def test_the_backlog_is_four_grouped_counts_and_the_closed_keys(
        db: None, django_assert_num_queries: Any) -> None:
    make_backlog()
    with django_assert_num_queries(6):  # and the (few) paused queues, and the closed keys
        backlog = metrics.read_backlog()
    assert backlog.due == {"default": 2, "mail": 1}
    assert backlog.scheduled == {"default": 1, "mail": 0}
    assert backlog.running == {"default": 1, "mail": 1}
    assert backlog.dead_letters == {"not_retryable": 1, "retries_exhausted": 2}
    assert 30 <= backlog.oldest_due["default"] < 60
    assert 0 <= backlog.oldest_due["mail"] < 30
    assert backlog.unknown_agents == {}  # every run's agent is registered here


def test_due_runs_of_agents_this_process_lacks_are_counted_by_queue_and_agent(
        db: None) -> None:
    """What a worker of this process leaves queued for another (a rolling deploy's new
    agent): due runs only, queued ones only."""
    now = timezone.now()
    for queue, agent, status, due_in in [
        ("default", "tests.from_the_future", Status.QUEUED, -5),
        ("default", "tests.from_the_future", Status.QUEUED, 0),
        ("mail", "tests.from_the_future", Status.QUEUED, -1),
        ("mail", "tests.also_new", Status.QUEUED, -1),
        ("default", "tests.from_the_future", Status.QUEUED, 3600),  # not due
        ("default", "tests.from_the_future", Status.RUNNING, 0),
        ("default", "tests.from_the_future", Status.FAILED, 0),
        ("default", "tests.noop", Status.QUEUED, -5),  # registered here
    ]:
        AgentRun.objects.create(agent=agent, queue=queue, status=status,
                                available_at=now + timedelta(seconds=due_in))
    assert metrics.read_backlog(now).unknown_agents == {
        ("default", "tests.from_the_future"): 2, ("mail", "tests.from_the_future"): 1,
        ("mail", "tests.also_new"): 1}

    samples = {(s.name, s.labels["queue"], s.labels["agent"]): s.value
               for family in metrics.BacklogCollector(ttl=0).collect()
               if family.name == "agentruns_unknown_agent_runs" for s in family.samples}
    assert samples == {
        ("agentruns_unknown_agent_runs", "default", "tests.from_the_future"): 2,
        ("agentruns_unknown_agent_runs", "mail", "tests.from_the_future"): 1,
        ("agentruns_unknown_agent_runs", "mail", "tests.also_new"): 1}


def test_the_backlog_counts_lapsed_leases_in_the_running_count(
        db: None, django_assert_num_queries: Any) -> None:
    now = timezone.now()
    for queue, expires in [("default", now - timedelta(seconds=5)), ("default", now +
                           timedelta(seconds=30)), ("mail", now + timedelta(seconds=30))]:
        AgentRun.objects.create(agent="tests.noop", queue=queue, status=Status.RUNNING,
                                lease_expires=expires)
    with django_assert_num_queries(6):  # and the paused queues, and the closed keys
        backlog = metrics.read_backlog()
    assert backlog.running == {"default": 2, "mail": 1}
    assert backlog.lapsed == {"default": 1, "mail": 0}
    collector = metrics.BacklogCollector(read=lambda: backlog)
    assert gauges(collector)[("agentruns_leases_lapsed", "default")] == 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gauges(collector: metrics.BacklogCollector) -> dict[tuple[str, str], float]:
    return {(s.name, next(iter(s.labels.values()))): s.value
            for family in collector.collect() for s in family.samples}


def test_the_collector_reads_once_per_ttl_and_keeps_drained_queues_at_zero(
        db: None, django_assert_num_queries: Any) -> None:
    make_backlog()
    clock = FakeClock()
    collector = metrics.BacklogCollector(ttl=15, clock=clock)
    with django_assert_num_queries(6):  # and the paused queues, and the closed keys
        first = gauges(collector)
    assert first[("agentruns_queue_depth", "default")] == 2
    assert first[("agentruns_queue_scheduled", "default")] == 1
    assert first[("agentruns_running", "mail")] == 1
    assert first[("agentruns_dead_letters", "retries_exhausted")] == 2
    assert first[("agentruns_queue_oldest_due_seconds", "default")] >= 30

    AgentRun.objects.filter(queue="mail").delete()
    clock.now += 14.9
    with django_assert_num_queries(0):
        assert gauges(collector) == first  # N scrapers in a TTL cost one reading
    clock.now += 0.2
    with django_assert_num_queries(6):
        drained = gauges(collector)
    assert drained[("agentruns_queue_depth", "mail")] == 0  # reported, not gone
    assert drained[("agentruns_running", "mail")] == 0
    assert drained[("agentruns_dead_letters", "retries_exhausted")] == 0
    assert drained[("agentruns_queue_depth", "default")] == 2


def test_the_collector_shows_paused_queues(db: None) -> None:
    from django_agentruns import pause_queue, resume_queue

    make_backlog()
    pause_queue("mail")
    clock = FakeClock()
    collector = metrics.BacklogCollector(ttl=15, clock=clock)
    reading = gauges(collector)
    assert reading[("agentruns_queue_paused", "mail")] == 1
    assert reading[("agentruns_queue_paused", "default")] == 0
    resume_queue("mail")
    clock.now += 16
    assert gauges(collector)[("agentruns_queue_paused", "mail")] == 0


def test_the_collector_serves_its_last_reading_when_the_database_fails(
        caplog: pytest.LogCaptureFixture) -> None:
    readings = [metrics.Backlog(due={"default": 4}), DatabaseError("server closed the "
                                                                   "connection")]

    def read() -> metrics.Backlog:
        reading = readings.pop(0)
        if isinstance(reading, Exception):
            raise reading
        return reading

    clock = FakeClock()
    collector = metrics.BacklogCollector(ttl=1, clock=clock, read=read)
    assert gauges(collector)[("agentruns_queue_depth", "default")] == 4
    clock.now += 5
    assert gauges(collector)[("agentruns_queue_depth", "default")] == 4
    assert readings == []
    assert "could not read the run backlog" in caplog.text


def test_registering_the_collector_reads_nothing(db: None,
                                                  django_assert_num_queries: Any) -> None:
    registry = CollectorRegistry()
    with django_assert_num_queries(0):
        registry.register(metrics.BacklogCollector())
    # Described, so the names are known without a reading.
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(metrics.BacklogCollector())


def test_a_reading_on_a_scrape_thread_closes_the_connection_it_opened(
        transactional_db: None) -> None:
    """The exporter answers each scrape on a new thread: a connection left open there would
    never be reused or closed."""
    make_backlog()
    seen: dict[str, Any] = {}

    def scrape() -> None:
        seen["depth"] = gauges(metrics.BacklogCollector(ttl=0))[("agentruns_queue_depth",
                                                                   "default")]
        seen["open"] = connections[DEFAULT_DB_ALIAS].connection is not None

    thread = threading.Thread(target=scrape)
    thread.start()
    thread.join(timeout=20)
    assert seen == {"depth": 2, "open": False}

    connection.ensure_connection()  # a thread that had one open (a request's) keeps it
    gauges(metrics.BacklogCollector(ttl=0))
    assert connection.connection is not None
