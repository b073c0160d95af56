"""Proof under fire: hundreds of multi-step runs through workers that keep being killed.

See `tests.chaos.harness` for the faults and `tests.chaos.invariants` for what is checked.
Each test prints ``chaos: runs=N kills=K restarts=R sigterms=S checks=C violations=V`` in
pytest's terminal summary and fails, listing them, if any violation was found.
"""

from __future__ import annotations

import pytest
from django.db import connection

from tests.chaos.harness import Chaos
from tests.chaos.plan import ChaosConfig, ChaosReport
from tests.chaos.private import on_private_server
from tests.chaos.support import default_restart_mode
from tests.pgbouncer import PgBouncer


def assert_no_violations(report: ChaosReport) -> None:
    shown = "\n".join(f"- {v}" for v in report.violations[:50])
    more = len(report.violations) - 50
    assert not report.violations, (
        f"{report.summary()}\n{report.details()}\n{shown}"
        + (f"\n... and {more} more" if more > 0 else ""))


@pytest.mark.slow
@pytest.mark.postgres_only
def test_chaos_on_postgresql(worker_env: dict[str, str]) -> None:
    """The test database's sessions are ended mid-run (CHAOS_PG_RESTART=terminate, the
    default); with CHAOS_PG_RESTART=cluster, a real server restart of a private server
    this test starts (never the machine's)."""
    config = ChaosConfig(runs=500, workers=3, concurrency=4, seed=1,
                         pg_restart=default_restart_mode(), drain_workers=3)
    if config.pg_restart == "cluster":
        with on_private_server() as (env, server):
            report = Chaos(config, env, server=server).run()
    else:
        report = Chaos(config, worker_env).run()
    assert_no_violations(report)
    # The faults happened, and hit busy workers: otherwise this proves nothing.
    assert report.runs == 500
    assert report.kills >= 20, report.summary()
    assert report.restarts == (0 if config.pg_restart == "none" else 1), report.summary()
    assert report.sigterms == 1, report.summary()
    assert report.abandoned >= 10, report.details()
    assert report.waited >= 10, report.details()


@pytest.mark.slow
@pytest.mark.postgres_only
def test_chaos_with_a_real_restart_of_a_private_server(transactional_db: None) -> None:
    """A real server restart mid-run ("cluster"), of a server this test starts itself: the
    machine's server, shared with other work, is never restarted."""
    # Small, and no SIGTERM (too few runs to be sure a worker is busy): the restart is the
    # point here; test_chaos_on_postgresql has the rest.
    config = ChaosConfig(runs=80, workers=2, concurrency=3, seed=4, pg_restart="cluster",
                         chaos_seconds=30.0, drain_workers=2, sigterm=False)
    with on_private_server() as (env, server):
        report = Chaos(config, env, server=server).run()
    assert_no_violations(report)
    assert report.runs == 80
    assert report.restarts == 1, report.summary()


@pytest.mark.slow
@pytest.mark.postgres_only
def test_chaos_through_pgbouncer(worker_env: dict[str, str], pgbouncer: PgBouncer) -> None:
    """Production's topology: every worker and reaper connection through PgBouncer in
    transaction mode, the listener direct (LISTEN_DATABASE); PgBouncer restarts mid-run."""
    db = connection.settings_dict
    env = {**worker_env, "DATABASE_URL": pgbouncer.route(worker_env["DATABASE_URL"]),
           "AGENTRUNS_TEST_DIRECT": f"{db.get('HOST') or '127.0.0.1'}:{db.get('PORT') or 5432}"}
    config = ChaosConfig(runs=200, workers=3, concurrency=4, seed=3, pg_restart="pgbouncer",
                         chaos_seconds=60.0, drain_workers=3)
    report = Chaos(config, env, bouncer=pgbouncer).run()
    assert_no_violations(report)
    assert report.runs == 200
    assert report.restarts == 1, report.summary()
    assert report.kills >= 5, report.summary()
    assert report.sigterms == 1, report.summary()


@pytest.mark.slow
@pytest.mark.sqlite_only
def test_chaos_on_sqlite(worker_env: dict[str, str]) -> None:
    config = ChaosConfig(runs=150, workers=2, concurrency=3, seed=2, pg_restart="none",
                         freeze_every=8.0, drain_workers=2)
    report = Chaos(config, worker_env).run()
    assert_no_violations(report)
    assert report.runs == 150
    assert report.kills >= 5, report.summary()
    assert report.sigterms == 1, report.summary()
    assert report.abandoned >= 3, report.details()
    assert report.waited >= 3, report.details()
