"""A real PostgreSQL restart mid-run is the engine's failure, not the agents': healthy runs
succeed without a requeue charged (a second hiccup would otherwise dead-letter them).

The server restarted is a private one this test starts (tests/private_postgres.py), never
the shared one the rest of the suite uses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from django_agentruns.models import AgentRun, RunEvent, RunPayload
from tests import helpers
from tests.private_postgres import PrivateServer, server_bindir

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only]

RUNS = 30
STEPS = 10
RUNS_TABLE = AgentRun._meta.db_table
EVENTS_TABLE = RunEvent._meta.db_table


@pytest.fixture
def private_server() -> Iterator[PrivateServer]:
    bindir = server_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on this machine")
    server = PrivateServer(bindir)
    try:
        server.start()
        yield server
    finally:
        helpers.close_all_started()  # workers first: they hold sessions on the server
        server.stop()


def query(server: PrivateServer, sql: str) -> list[tuple[Any, ...]]:
    """A read from the test's side; empty while the server is away."""
    try:
        with psycopg.connect(**server.params("agentruns"), connect_timeout=2) as conn:
            return list(conn.execute(sql).fetchall())
    except psycopg.OperationalError:
        return []


def test_a_server_restart_mid_run_charges_no_healthy_run(
    private_server: PrivateServer,
) -> None:
    settings = private_server.create_database("agentruns")
    env = helpers.subprocess_env(settings)
    migrated = helpers.run_manage(["migrate", "-v", "0"], env, timeout=180)
    assert migrated.returncode == 0, migrated.stderr
    enqueued = helpers.run_manage(["shell", "-c", (
        "from django_agentruns import enqueue\n"
        f"for _ in range({RUNS}): enqueue('tests.healthy', {{'steps': {STEPS}, 'sleep': 0.2}})"
    )], env, timeout=120)
    assert enqueued.returncode == 0, enqueued.stderr
    # A 10 s lease: no lease lapses across the restart, so nothing here is a lost attempt.
    env["AGENTRUNS_TEST_SETTINGS"] = json.dumps({"LEASE_TTL": 10.0})
    workers = [helpers.start_manage(["runworker", "--concurrency", "10"], env)
               for _ in range(2)]

    def mid_way() -> bool:
        rows = query(private_server, f"SELECT sum(checkpoint_count) FROM {RUNS_TABLE}")
        return bool(rows) and (rows[0][0] or 0) >= RUNS * STEPS // 5

    helpers.wait_until(mid_way, timeout=60, message="the runs to be a fifth done")
    private_server.restart()

    def settled() -> list[tuple[Any, ...]]:
        rows = query(private_server, f"SELECT status, requeue_count, attempt FROM {RUNS_TABLE} "
                                     f"WHERE status <> 'queued' AND status <> 'running'")
        return rows if len(rows) == RUNS else []

    rows = helpers.wait_until(settled, timeout=120, interval=0.2,
                              message="every run to settle after the restart")
    logs = []
    for worker in workers:
        assert worker.returncode is None, worker.output()  # still serving
        logs.append(worker.stderr)
        assert worker.stop() == 0, worker.output()
    log = "\n".join(logs)
    assert {row[0] for row in rows} == {"succeeded"}, log
    charged = query(private_server, f"SELECT p.value #>> '{{}}' FROM {RUNS_TABLE} r JOIN "
                                    f"{RunPayload._meta.db_table} p ON p.run_id = r.id AND "
                                    f"p.kind = 'traceback' WHERE r.requeue_count > 0 LIMIT 1")
    assert {row[1] for row in rows} == {0}, "".join(charged[0]) if charged else log
    # The restart did land mid-run: the attempt store's writers (or a context call) saw it.
    assert "writer lost its connection" in log or "storage call failed" in log, log
    retrying = query(private_server, f"SELECT count(*) FROM {EVENTS_TABLE} "
                                     f"WHERE type = 'run.retrying'")
    assert retrying == [(0,)], log
