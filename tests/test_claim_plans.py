"""The claim's statements over a large history (PostgreSQL): they read the runs they take,
not the backlog, whatever the planner's statistics say, and a prepared claim's generic
plan uses the backlog's partial indexes, so the server need not plan each claim afresh.

Measured by the plans' own row counts (EXPLAIN ANALYZE), not by time."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_agentruns import RunRequest, enqueue_many
from django_agentruns.models import AgentRun, Status
from django_agentruns.registry import scope_policy
from django_agentruns.transitions import claiming, hot_sql, rawsql
from django_agentruns.transitions.due import compiled_due
from django_agentruns.transitions.events import STARTED
from tests import helpers

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]

WORKER = "plans:1:abcd"
HISTORY, BACKLOG = 3_000, 1_000
TABLE = AgentRun._meta.db_table


@pytest.fixture
def backlog_after_analyze() -> Iterator[None]:
    """A history of finished runs, the statistics taken then (no run queued), and a backlog
    queued after: what a busy deployment looks like until autovacuum's next ANALYZE, which
    on a table of millions waits for a tenth of it to change."""
    with connection.cursor() as cursor:
        cursor.execute(f"REINDEX TABLE {TABLE}")  # compact, whatever tests ran before
    enqueue_many([RunRequest("tests.noop", {"n": n}) for n in range(HISTORY)])
    AgentRun.objects.update(status=Status.SUCCEEDED, finished_at=timezone.now())
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {TABLE}")
    enqueue_many([RunRequest("tests.noop", {"n": n}) for n in range(BACKLOG)])
    yield
    # ANALYZE writes the table's size into pg_class in place, which the test's rollback
    # does not undo: leave it as the later tests found it (an empty table). One DELETE,
    # not the ORM's cascade over every related table, and the transaction marked for
    # rollback, as it is rolled back anyway: Django then skips its check of the deferred
    # foreign keys, which for 4,000 deleted runs ran 36,000 queries (6-18 s a test).
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {TABLE}")
        cursor.execute(f"ANALYZE {TABLE}")
    transaction.set_rollback(True)


def claim_statement(limit: int) -> tuple[str, list[Any]]:
    due = compiled_due("postgresql", ("default",), scope_policy(), limit, ids_only=True,
                       naive=rawsql.naive_times())
    at = timezone.now()
    return hot_sql.claim_returning(due, at, WORKER, Status.RUNNING, Status.QUEUED, {},
                                   at + timedelta(seconds=30), STARTED)


def explain(sql: str, params: list[Any], *, generic: bool) -> int:
    with transaction.atomic(), connection.cursor() as cursor:
        if not generic:
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
        else:
            numbered = iter(range(1, len(params) + 1))
            text = re.sub(r"%%|%s", lambda m: "%" if m[0] == "%%" else f"${next(numbered)}",
                          sql)
            cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            cursor.execute(f"PREPARE plans_claim AS {text}")
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE plans_claim "
                           f"({', '.join(['%s'] * len(params))})", params)
        rows = helpers.plan_rows_read(cursor.fetchone()[0], TABLE)
        if generic:
            cursor.execute("DEALLOCATE plans_claim")
        transaction.set_rollback(True)  # the claim ran: take it back
    return rows


@pytest.mark.parametrize("limit", [1, 8])
def test_a_claim_reads_the_runs_it_takes_not_the_backlog(backlog_after_analyze: None,
                                                         limit: int) -> None:
    # Before, the UPDATE found its rows by scanning a partial index of every queued run
    # (the statistics counted none) and joining: one claim read the whole backlog.
    sql, params = claim_statement(limit)
    assert explain(sql, params, generic=False) <= 3 * limit


@pytest.mark.parametrize("limit", [1, 8])
def test_a_prepared_claims_generic_plan_reads_the_runs_it_takes(backlog_after_analyze: None,
                                                                limit: int) -> None:
    # Its constants (statuses, queues) are literals: with them as parameters the generic
    # plan could not use the backlog's partial indexes, so the server planned every claim
    # afresh rather than fall back to a scan of the whole table.
    sql, params = claim_statement(limit)
    assert explain(sql, params, generic=True) <= 3 * limit


def test_starting_runs_by_id_reads_those_runs_not_the_backlog(backlog_after_analyze: None) -> None:
    # The limited claim and a lapsed run's reclaim start runs by id (`claiming._start`),
    # their guard `transitions.guards.still`; as `status = 'queued'` beside the ids it
    # scanned the backlog's partial index on such statistics.
    ids = list(AgentRun.objects.filter(status=Status.QUEUED).order_by("-id")
               .values_list("id", flat=True)[:3])
    with CaptureQueriesContext(connection) as seen:
        started = claiming._start(WORKER, ids, dict.fromkeys(ids, "tests.noop"), {}, 30.0,
                                  timezone.now(), read_back=None)
    assert [r.pk for r in started] == ids
    [update] = [q["sql"] for q in seen.captured_queries if q["sql"].startswith("UPDATE")]
    assert explain(update, [], generic=False) <= 2 * len(ids)
