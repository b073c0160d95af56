"""Prometheus metrics as a scraper reads them: the web view and its permissions and token,
`runworker --metrics-port` as a real subprocess scraped over HTTP, and the package without
prometheus_client (a subprocess that blocks the import). Counters and gauges themselves are
tested in tests/test_metrics.py, whose helpers these tests share.
"""


import os
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client

from django_agentruns import enqueue
from django_agentruns.models import AgentRun, Status
from django_agentruns.ops import metrics
from tests import helpers
from tests.test_metrics import make_backlog, make_user, parse

try:
    from prometheus_client import REGISTRY
except ImportError:  # the skip below says what to install
    REGISTRY = None

# In CI (CI=true) a missing extra is a failure, not a skip: the `test` extra installs it.
MAY_SKIP = not os.environ.get("CI")
pytestmark = pytest.mark.skipif(MAY_SKIP and REGISTRY is None, reason="prometheus_client is "
                                "not installed: pip install 'django-agentruns[prometheus]'")

TOKEN = "scraper-token-0123456789"
METRICS_URL = "/agentruns/metrics/"

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
