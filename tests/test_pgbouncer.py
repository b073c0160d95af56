"""Behind PgBouncer in transaction mode: wake-ups either work (LISTEN_DATABASE, a direct
connection) or the worker says loudly that they do not, and keeps polling.

Each test routes a real `runworker` (or `manage.py check`) through a private pgbouncer
(tests/pgbouncer.py); the durability suites run through one in scripts/test-pgbouncer.sh.
"""

from __future__ import annotations

import re
import urllib.request

import pytest
from django.db import connection

from django_agentruns import enqueue
from django_agentruns.models import AgentRun, Status
from tests import helpers
from tests.pgbouncer import PgBouncer

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

POLL = 5.0  # long, so a wake-up and a poll cannot be mistaken for each other


def pooled_env(worker_env: dict[str, str], bouncer: PgBouncer, *, direct_listen: bool,
               **settings: object) -> dict[str, str]:
    """A subprocess environment whose `default` database goes through `bouncer`; with
    `direct_listen`, a `listen` alias reaches the server directly (LISTEN_DATABASE)."""
    env = {**worker_env, "DATABASE_URL": bouncer.route(worker_env["DATABASE_URL"])}
    env.pop("AGENTRUNS_TEST_DIRECT", None)
    if direct_listen:
        db = connection.settings_dict
        env["AGENTRUNS_TEST_DIRECT"] = f"{db.get('HOST') or '127.0.0.1'}:{db.get('PORT') or 5432}"
    if settings:
        import json

        env["AGENTRUNS_TEST_SETTINGS"] = json.dumps(settings)
    return env


def start_latency(run: AgentRun) -> float:
    run.refresh_from_db()
    assert run.started_at is not None
    return (run.started_at - run.created_at).total_seconds()


def wait_settled(run: AgentRun, timeout: float = 30) -> None:
    helpers.wait_until(lambda: AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED,
                       timeout=timeout, message=f"run {run.pk} to succeed")


def test_with_listen_database_a_wakeup_through_pgbouncer_is_well_under_the_poll(
        worker_env: dict[str, str], pgbouncer: PgBouncer) -> None:
    env = pooled_env(worker_env, pgbouncer, direct_listen=True)
    with helpers.start_manage(["runworker", "--poll-interval", str(POLL)], env) as worker:
        helpers.wait_until(lambda: "wake-ups on" in worker.stderr, timeout=60,
                           message="the listener's self-check to pass")
        latencies = []
        for n in range(5):
            run = enqueue("tests.noop", {"n": n})
            wait_settled(run, timeout=POLL * 3)
            latencies.append(start_latency(run))
        assert worker.stop() == 0, worker.output()
        assert "degraded" not in worker.stderr, worker.output()
        assert "'listen'" in worker.stderr  # the self-check ran on the direct alias
    assert max(latencies) < POLL / 5, latencies


def test_without_it_the_worker_warns_polls_and_exposes_the_metric(
        worker_env: dict[str, str], pgbouncer: PgBouncer) -> None:
    pytest.importorskip("prometheus_client")
    env = pooled_env(worker_env, pgbouncer, direct_listen=False)
    args = ["runworker", "--poll-interval", str(POLL), "--metrics-port", "0"]
    with helpers.start_manage(args, env) as worker:
        helpers.wait_until(lambda: "wake-ups degraded" in worker.stderr, timeout=60,
                           message="the degraded warning")
        text = worker.stderr
        assert "LISTEN_DATABASE" in text, text
        assert "PgBouncer" in text, text
        assert "every POLL_INTERVAL (5 s)" in text, text
        port = re.search(r"serving metrics on http://[^:]+:(\d+)/metrics", text)
        assert port, text
        body = urllib.request.urlopen(f"http://127.0.0.1:{port[1]}/metrics", timeout=10).read()
        assert b"agentruns_wakeups_degraded 1.0" in body
        # Polling still runs it, at the next look.
        run = enqueue("tests.noop")
        wait_settled(run, timeout=POLL * 3)
        assert worker.stop() == 0, worker.output()


def test_check_deploy_reports_degraded_wakeups_behind_pgbouncer(
        worker_env: dict[str, str], pgbouncer: PgBouncer) -> None:
    check = ["check", "--deploy", "--fail-level", "CRITICAL"]
    pooled = helpers.run_manage(check, pooled_env(worker_env, pgbouncer, direct_listen=False))
    assert pooled.returncode == 0, pooled.stderr
    assert "agentruns.W005" in pooled.stderr, pooled.stderr
    assert "LISTEN_DATABASE" in pooled.stderr, pooled.stderr
    assert "agentruns.W007" in pooled.stderr  # server-side cursors: inferred from the probe

    fixed = helpers.run_manage(check, pooled_env(worker_env, pgbouncer, direct_listen=True))
    assert fixed.returncode == 0, fixed.stderr
    assert "agentruns.W005" not in fixed.stderr, fixed.stderr
    assert "agentruns.W007" not in fixed.stderr, fixed.stderr  # the test settings disable them


def test_prepared_statements_break_behind_a_pooler_without_support(
        worker_env: dict[str, str], pgbouncer: PgBouncer) -> None:
    """Why W006 exists: PgBouncer 1.18 in transaction mode loses psycopg's prepared
    statements, and the check says so before the worker meets it."""
    env = pooled_env(worker_env, pgbouncer, direct_listen=True, PREPARED_STATEMENTS=True)
    result = helpers.run_manage(["check", "--fail-level", "CRITICAL"], env)
    assert "agentruns.W006" in result.stderr, result.stderr


def test_the_self_check_fails_through_pgbouncer_even_though_a_session_hears_itself(
        pgbouncer: PgBouncer) -> None:
    """The probe is sent on a connection of its own: the listening session would hear its
    own NOTIFY through the pooler and pass a check that enqueues then fail."""
    import psycopg

    from django_agentruns.db import connect_params, probe_channel, self_check

    direct = connect_params("default")
    pooled = {**direct, "port": pgbouncer.port}
    channel = probe_channel("worker-a")
    with psycopg.connect(**pooled, autocommit=True) as listening:
        listening.execute(f"LISTEN {channel}")
        listening.execute(f"NOTIFY {channel}, 'self'")
        assert [n.payload for n in listening.notifies(timeout=2, stop_after=1)] == ["self"]
        assert self_check(listening, channel, timeout=1.0) is False
    with psycopg.connect(**direct, autocommit=True) as listening:
        listening.execute(f"LISTEN {channel}")
        assert self_check(listening, channel) is True
