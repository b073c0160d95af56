"""Prometheus metrics: attempts by outcome, queue wait and duration, the backlog gauges.

Counters and histograms are read back from prometheus_client's default registry as
deltas (they are process-wide); the backlog gauges from a collector with an injected
clock. `runworker --metrics-port` is a real subprocess scraped over HTTP. Without
prometheus_client installed (a subprocess that blocks the import) everything still
imports, and the one thing that cannot work says so.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections
from django.db.models import F
from django.test import Client
from django.utils import timezone

from django_agentruns import enqueue
from django_agentruns.models import AgentRun, Reason, Status
from django_agentruns.ops import metrics
from django_agentruns.runtime.worker import Worker
from tests import helpers

try:
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:  # the skip below says what to install
    REGISTRY = None

# In CI (CI=true) a missing extra is a failure, not a skip: the `test` extra installs it.
MAY_SKIP = not os.environ.get("CI")
pytestmark = pytest.mark.skipif(MAY_SKIP and REGISTRY is None, reason="prometheus_client is "
                                "not installed: pip install 'django-agentruns[prometheus]'")

TOKEN = "scraper-token-0123456789"
METRICS_URL = "/agentruns/metrics/"


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


# --------------------------------------------------------------------------- the web view


@pytest.fixture
def fresh_backlog() -> Iterator[None]:
    collector = metrics.register_backlog()
    assert collector is not None
    collector.clear()
    yield
    collector.clear()  # the next test reads its own database


def test_the_view_serves_the_metrics_to_users_who_may_view_runs(
        client: Client, db: None, fresh_backlog: None) -> None:
    make_backlog()
    client.force_login(make_user("viewer", "view_agentrun"))
    response = client.get(METRICS_URL)
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")
    values = parse(response.content.decode())
    assert values[("agentruns_queue_depth", frozenset({("queue", "default")}))] == 2
    assert values[("agentruns_dead_letters", frozenset({("reason", "retries_exhausted")}))] == 2
    assert "# TYPE agentruns_attempts_total counter" in response.content.decode()


def test_the_view_refuses_the_anonymous_and_users_without_permission(
        client: Client, db: None) -> None:
    response = client.get(METRICS_URL)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")

    client.force_login(make_user("canceller", "cancel_agentrun"))
    assert client.get(METRICS_URL).status_code == 403
    assert client.post(METRICS_URL).status_code == 405


def test_a_scraper_with_the_token_may_read_without_logging_in(
        client: Client, db: None, settings: Any, fresh_backlog: None) -> None:
    assert client.get(METRICS_URL, headers={"Authorization": f"Bearer {TOKEN}"}).status_code \
        == 401  # no token configured: no bearer is accepted
    settings.AGENTRUNS = {**settings.AGENTRUNS, "METRICS_TOKEN": TOKEN}
    assert client.get(METRICS_URL, headers={"Authorization": f"Bearer {TOKEN}"}).status_code \
        == 200
    for wrong in (f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", TOKEN, "Bearer "):
        assert client.get(METRICS_URL, headers={"Authorization": wrong}).status_code == 401


# --------------------------------------------------------------------------- runworker


def test_runworker_serves_its_metrics_on_the_given_port(worker_env: dict[str, str]) -> None:
    enqueue("tests.noop")
    enqueue("tests.noop")
    enqueue("tests.not_retryable")
    with helpers.start_manage(["runworker", "--metrics-port", "0", "--metrics-addr",
                               "127.0.0.1"], worker_env) as worker:
        found = helpers.wait_until(
            lambda: re.search(r"serving metrics on (http://127\.0\.0\.1:\d+)/metrics",
                              worker.stderr), message="the metrics server to start")
        url = f"{found.group(1)}/metrics"
        helpers.wait_until(lambda: not AgentRun.objects.filter(
            status__in=(Status.QUEUED, Status.RUNNING)).exists(), message="the runs to settle")

        def scraped() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
            with urllib.request.urlopen(url, timeout=5) as response:
                return parse(response.read().decode())

        # Settled in the database a moment before the worker counts it.
        values = helpers.wait_until(lambda: (v := scraped()) and v.get((
            "agentruns_attempts_total",
            frozenset({("agent", "tests.not_retryable"), ("outcome", "dead_lettered")}))) and v,
            message="the dead letter to be counted")
        worker.stop()
    assert values[("agentruns_attempts_total",
                   frozenset({("agent", "tests.noop"), ("outcome", "succeeded")}))] == 2
    assert values[("agentruns_queue_wait_seconds_count",
                   frozenset({("agent", "tests.noop")}))] == 2
    assert values[("agentruns_dead_letters", frozenset({("reason", "not_retryable")}))] == 1
    assert values[("agentruns_queue_depth", frozenset({("queue", "default")}))] == 0


def test_runworker_serves_metrics_on_loopback_unless_told(worker_env: dict[str, str]) -> None:
    """The metrics server has no authentication: it binds 127.0.0.1 by default."""
    with helpers.start_manage(["runworker", "--metrics-port", "0"], worker_env) as worker:
        found = helpers.wait_until(
            lambda: re.search(r"serving metrics on http://([^/]+):(\d+)/metrics",
                              worker.stderr), message="the metrics server to start")
        with socket.create_connection(("127.0.0.1", int(found.group(2))), timeout=5):
            pass
        worker.stop()
    assert found.group(1) == "127.0.0.1"


@pytest.mark.parametrize("flag", ["--metrics-addr", "--metrics-host"])
def test_the_metrics_bind_address_is_an_option(flag: str) -> None:
    from django_agentruns.management.commands.runworker import Command

    parser = Command().create_parser("manage.py", "runworker")
    assert parser.parse_args([]).metrics_addr == "127.0.0.1"
    assert parser.parse_args([flag, "0.0.0.0"]).metrics_addr == "0.0.0.0"


def test_a_worker_reports_the_due_runs_of_agents_it_lacks(worker_env: dict[str, str]) -> None:
    """A worker of old code in a rolling deploy: it leaves the new agent's runs queued,
    and its metrics say how many."""
    enqueue("tests.once")
    enqueue("tests.once")
    env = {**worker_env, "AGENTRUNS_TEST_HIDE_AGENTS": "tests.once"}
    with helpers.start_manage(["runworker", "--metrics-port", "0", "--metrics-addr",
                               "127.0.0.1"], env) as worker:
        found = helpers.wait_until(
            lambda: re.search(r"serving metrics on (http://127\.0\.0\.1:\d+)/metrics",
                              worker.stderr), message="the metrics server to start")
        with urllib.request.urlopen(f"{found.group(1)}/metrics", timeout=5) as response:
            values = parse(response.read().decode())
        worker.stop()
    key = frozenset({("queue", "default"), ("agent", "tests.once")})
    assert values[("agentruns_unknown_agent_runs", key)] == 2
    assert AgentRun.objects.filter(status=Status.QUEUED).count() == 2


def test_runworker_refuses_a_bad_or_busy_metrics_port() -> None:
    with pytest.raises(CommandError, match="must be a port number from 0 to 65535"):
        call_command("runworker", "--metrics-port", "70000")

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(CommandError, match=f"--metrics-port: cannot serve on "
                                               f"127.0.0.1:{port}"):
            call_command("runworker", "--metrics-port", str(port), "--metrics-addr",
                         "127.0.0.1")


# --------------------------------------------------------------------------- without the extras

WITHOUT_EXTRAS = """
import sys
sys.modules["prometheus_client"] = None  # as if not installed: importing it fails
sys.modules["opentelemetry"] = None
import django
django.setup()
from django.test import RequestFactory, override_settings
from django_agentruns import urls
from django_agentruns.ops import metrics, tracing
from django_agentruns.runtime import worker
from django_agentruns.streaming import sse as stream
from django_agentruns.models import AgentRun
assert not metrics.AVAILABLE and not tracing.AVAILABLE
metrics.observe_settlement("tests.noop", "succeeded", 0.5, 1.5)
assert metrics.register_backlog() is None
with tracing.attempt_span(AgentRun(pk=1, agent="a", queue="q", attempt=1), "w") as span:
    span.set_outcome("dead_lettered", ValueError("boom"))
try:
    metrics.serve(0)
except metrics.MetricsUnavailable as exc:
    print("serve:", exc)
with override_settings(AGENTRUNS={"METRICS_TOKEN": "t" * 20}):
    request = RequestFactory().get("/", headers={"Authorization": "Bearer " + "t" * 20})
    response = metrics.metrics_view(request)
print("view:", response.status_code, response.content.decode().strip())
if sys.argv[1:]:
    from django.core.management import execute_from_command_line
    execute_from_command_line(["manage.py", *sys.argv[1:]])
"""


def test_without_prometheus_client_everything_imports_and_metrics_say_why_not() -> None:
    env = helpers.subprocess_env(connection.settings_dict)
    done = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, "runworker",
                           "--metrics-port", "0"], env=env, cwd=helpers.REPO_ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    hint = "pip install 'django-agentruns[prometheus]'"
    assert f"serve: metrics need prometheus_client: {hint}" in done.stdout, done.stderr
    assert f"view: 501 Metrics need prometheus_client: {hint}" in done.stdout
    assert done.returncode == 1
    assert f"CommandError: --metrics-port: metrics need prometheus_client: {hint}" in \
        done.stderr
