"""Connection faults at the worst moments (PostgreSQL): the worker logs, backs off, goes on,
and no run is lost.

Each fault is placed exactly: a second real connection holds a lock, so the worker's claim
(or settle) waits on it, visibly, in ``pg_stat_activity``; then its session is terminated,
or its statement times out, while it waits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import connection

from django_agentruns import enqueue
from django_agentruns.models import AgentRun, RunEvent, Status
from tests import helpers
from tests.testapp.chaos_agents import CHAOS
from tests.testapp.models import SideEffect

TABLE = AgentRun._meta.db_table
# The claim's SELECT ... FOR UPDATE SKIP LOCKED of lapsed runs, or its one statement that
# locks and starts due runs. Matched by its start (a regular expression): pg_stat_activity
# keeps only the first 1 kB of a query, and the column list is long.
CLAIM_SQL = f'^(SELECT "{TABLE}"."id", "{TABLE}"."agent"|WITH picked AS \\(SELECT "{TABLE}"."id")'

# settle_succeeded_many's guarded UPDATE (with its end events, in one statement), alone or
# at the head of the claim loop's settle-and-claim statement (transitions.handover)
SETTLE_SQL = ('^WITH v AS \\(SELECT \\(r->>0\\)::bigint AS run_id, \\(r->>1\\)::integer AS '
              'run_attempt, \\(r->>2\\)::jsonb AS run_output')

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only]


@contextmanager
def second_connection() -> Iterator[psycopg.Connection[Any]]:
    """A connection of its own to the test database, outside Django (so: outside its
    transaction handling), for holding locks and terminating sessions."""
    params = dict(connection.get_connection_params())
    params.pop("cursor_factory", None)
    params.pop("context", None)
    with psycopg.connect(**params, autocommit=True) as conn:
        yield conn


def waiting_backend(admin: psycopg.Connection[Any], query_pattern: str,
                    exclude: tuple[int, ...] = ()) -> int | None:
    """The pid of a session on the test database waiting on a lock in a query matching
    this regular expression."""
    row = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query ~ %s AND pid <> ALL(%s) ORDER BY pid",
        [query_pattern, list(exclude)]).fetchone()
    return None if row is None else int(row[0])


def terminate(admin: psycopg.Connection[Any], pid: int) -> None:
    row = admin.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()
    assert row is not None
    assert row[0], f"backend {pid} was not terminated"


def statuses(run_ids: list[int]) -> set[str]:
    return set(AgentRun.objects.filter(pk__in=run_ids).values_list("status", flat=True))


def release_and_finish(locker: psycopg.Connection[Any], worker: helpers.ManageProcess,
                       runs: list[int]) -> str:
    """The runs are still queued under the table lock; release it, see every run succeed
    with the worker still up, stop it cleanly, and return its log."""
    assert statuses(runs) == {Status.QUEUED}
    locker.execute("ROLLBACK")
    helpers.wait_until(lambda: statuses(runs) == {Status.SUCCEEDED}, timeout=60,
                       message="every run to succeed once the lock is gone")
    assert worker.returncode is None, worker.output()
    log = str(worker.stderr)
    assert worker.stop() == 0, worker.output()
    return log


def test_connection_terminated_mid_claim_loses_nothing(worker_env: dict[str, str]) -> None:
    runs = [enqueue(CHAOS, {"steps": 2}).pk for _ in range(4)]
    with second_connection() as locker, second_connection() as admin:
        # EXCLUSIVE lets plain reads through but stops the claim's SELECT ... FOR UPDATE.
        locker.execute("BEGIN")
        locker.execute(f'LOCK TABLE "{TABLE}" IN EXCLUSIVE MODE')
        with helpers.start_manage(["runworker", "--concurrency", "2"], worker_env) as worker:
            killed: tuple[int, ...] = ()
            for round_ in range(2):  # the first claim, then the retry after the backoff
                pid = helpers.wait_until(lambda k=killed: waiting_backend(admin, CLAIM_SQL, k),
                                         timeout=30, message=f"a claim blocked ({round_})")
                terminate(admin, pid)
                killed += (pid,)
            # Nothing was claimed while the claims died: the runs are all still queued.
            log = release_and_finish(locker, worker, runs)
    assert log.count("worker pass failed") >= 2, log
    assert "terminating connection due to administrator command" in log, log
    # The killed claims rolled back whole: one attempt each, no takeover, no double effect.
    assert set(AgentRun.objects.filter(pk__in=runs).values_list("attempt", flat=True)) == {1}
    assert not RunEvent.objects.filter(run_id__in=runs, type="run.abandoned").exists()
    assert SideEffect.objects.filter(run_id__in=runs, note="effect").count() == 2 * len(runs)


def test_connection_terminated_mid_settle_loses_nothing(worker_env: dict[str, str]) -> None:
    run = enqueue("tests.busy_sleep", {"seconds": 30}).pk
    with helpers.start_manage(["runworker"], worker_env) as worker:
        helpers.wait_until(lambda: SideEffect.objects.filter(run_id=run, note="start").exists(),
                           message="the agent to start")
        with second_connection() as locker, second_connection() as admin:
            locker.execute("BEGIN")
            locker.execute(f'SELECT 1 FROM "{TABLE}" WHERE id = %s FOR UPDATE', [run])
            SideEffect.objects.create(run_id=run, note="open")  # the agent returns now
            pid = helpers.wait_until(lambda: waiting_backend(admin, SETTLE_SQL), timeout=60,
                                     message="settle_succeeded blocked on the row lock")
            terminate(admin, pid)
            locker.execute("ROLLBACK")
        # The killed settle rolled back. It ran where the success went: the claim loop's
        # settle-and-claim statement (which hands it to the attempt store when it fails) or
        # the store's writer; either way it is written again on a fresh connection, so the
        # run succeeds on its first attempt.
        helpers.wait_until(lambda: statuses([run]) == {Status.SUCCEEDED}, timeout=60,
                           message="the run to succeed")
        assert worker.returncode is None, worker.output()
        log = worker.stderr
        assert worker.stop() == 0, worker.output()
    assert ("an attempt store writer lost its connection" in log
            or "worker pass failed" in log), log
    assert "terminating connection due to administrator command" in log, log
    row = AgentRun.objects.get(pk=run)
    assert row.attempt == 1
    types = list(RunEvent.objects.filter(run_id=run).values_list("type", flat=True))
    assert types == ["run.started", "run.succeeded"], types


def test_statement_timeout_on_the_claim_is_logged_and_survived(
    worker_env: dict[str, str],
) -> None:
    # The worker's sessions get a 300 ms statement_timeout (DATABASE_URL ?options=...).
    env = {**worker_env,
           "DATABASE_URL": worker_env["DATABASE_URL"] + "?options=-c%20statement_timeout%3D300"}
    runs = [enqueue(CHAOS, {"steps": 2}).pk for _ in range(3)]
    with second_connection() as locker:
        locker.execute("BEGIN")
        locker.execute(f'LOCK TABLE "{TABLE}" IN EXCLUSIVE MODE')
        with helpers.start_manage(["runworker"], env) as worker:
            helpers.wait_until(lambda: worker.stderr.count("statement timeout") >= 2,
                               timeout=30, message="two claims to time out")
            log = release_and_finish(locker, worker, runs)
    assert "worker pass failed" in log, log
    assert "canceling statement due to statement timeout" in log, log
    assert set(AgentRun.objects.filter(pk__in=runs).values_list("attempt", flat=True)) == {1}
