"""Commits per run of a real burst worker draining no-op runs (PostgreSQL), counted by the
server (`pg_stat_database.xact_commit`), not timed.

A no-op run costs a claim and a settle: at most 2 commits with one slot, fewer when claims
and settles batch (concurrency 16, several processes). Whatever else a worker commits must
not grow with the runs: its start and stop (measured by an empty drain first) and its
per-second reads (ticker, limits, paused queues, lapsed leases), allowed for by the seconds
the drain took. A NOTIFY per finished run once cost every worker's listener one more
transaction per run (3 commits per run with one process, about 6 with four).
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from django.db import connection

from django_agentruns import enqueue_many
from django_agentruns.models import AgentRun, Status
from tests import helpers

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only]

PER_SECOND = 6  # background commits a worker process may make per second, runs or none


def server_url() -> str:
    url = helpers.database_url(connection.settings_dict)
    return url.rsplit("/", 1)[0] + "/postgres"  # the counters are read from elsewhere


def commits(name: str) -> int:
    """Once no session is left on `name` (a backend flushes its counters as it exits)."""
    with psycopg.connect(server_url(), autocommit=True) as admin:
        deadline = time.monotonic() + 30
        while admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s",
                            [name]).fetchone()[0]:  # type: ignore[index]
            assert time.monotonic() < deadline, "sessions stayed on the test database"
            time.sleep(0.05)
        time.sleep(0.5)  # the counters land a moment after the session leaves
        admin.execute("SELECT pg_stat_clear_snapshot()")
        row = admin.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                            [name]).fetchone()
        assert row is not None
        return int(row[0])


def drain(env: dict[str, str], processes: int, concurrency: int) -> tuple[int, float]:
    """A burst `runworker`: the commits it made, and the seconds it took."""
    name = str(connection.settings_dict["NAME"])
    connection.close()  # ours flush now, not during the drain
    before = commits(name)
    began = time.monotonic()
    done = helpers.run_manage(["runworker", "--burst", "--processes", str(processes),
                               "--concurrency", str(concurrency)], env, timeout=300)
    took = time.monotonic() - began
    assert done.returncode == 0, done.stderr
    return commits(name) - before, took


@pytest.mark.parametrize(("processes", "concurrency", "runs", "most"), [
    pytest.param(1, 1, 300, 2.0, id="one-slot"),
    pytest.param(4, 16, 1200, 1.0, id="four-processes-16-slots"),
])
def test_a_no_op_run_costs_at_most_its_claim_and_its_settle(
        worker_env: dict[str, str], processes: int, concurrency: int, runs: int,
        most: float) -> None:
    # No reaper; renewals and beats every 10 s (not 0.7 s as the suite's 2 s lease has
    # them). Persistent connections, as a worker should run (check W004): with
    # CONN_MAX_AGE=0 the claim loop reconnects each pass, and a connection's setup is a
    # commit of its own.
    env = {**worker_env, "AGENTRUNS_TEST_SETTINGS": '{"REAP_INTERVAL": 0, "LEASE_TTL": 30}',
           "DATABASE_URL": worker_env["DATABASE_URL"] + "?conn_max_age=600"}
    idle, idle_took = drain(env, processes, concurrency)  # start and stop alone
    enqueue_many([{"agent": "tests.noop", "input": {"n": i}} for i in range(runs)])
    spent, took = drain(env, processes, concurrency)
    assert AgentRun.objects.filter(status=Status.SUCCEEDED).count() == runs
    background = PER_SECOND * processes * max(0.0, took - idle_took)
    per_run = (spent - idle - background) / runs
    report: dict[str, Any] = {"commits": spent, "idle drain": idle, "seconds": round(took, 1),
                              "background allowance": background,
                              "raw per run": round((spent - idle) / runs, 3)}
    assert per_run <= most, report
