"""PREPARED_STATEMENTS (PostgreSQL): the claim and settle statements are planned once per
connection, and behave exactly as unprepared ones."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import override_settings

from django_agentruns import RunRequest, enqueue, enqueue_many, transitions
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.runtime.worker import Worker
from django_agentruns.transitions import AttemptRef, ScopePolicy, Settlement

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

WORKER = "prepared:1:abcd"


def prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


def claim_one() -> AgentRun:
    (run,) = transitions.claim(WORKER, ["default"], 1, ScopePolicy(), {}, 30.0,
                               include_lapsed=False)
    return run


def test_off_by_default_nothing_is_prepared() -> None:
    enqueue("tests.noop", {"n": 1})
    run = claim_one()
    assert transitions.settle_succeeded(AttemptRef(run.pk, 1, WORKER, 30.0), {"ok": 1}) \
        is Settlement.SUCCEEDED
    assert prepared_statements() == []


@override_settings(AGENTRUNS={"PREPARED_STATEMENTS": True})
def test_claim_and_settle_are_prepared_and_write_the_same_story() -> None:
    for n in range(3):
        enqueue("tests.noop", {"n": n})
    results = []
    for _ in range(3):
        run = claim_one()
        assert (run.status, run.attempt, run.claimed_by) == (Status.RUNNING, 1, WORKER)
        assert run.input == {"n": run.input["n"]}  # JSON decoded, as the ORM does
        results.append(transitions.settle_succeeded(AttemptRef(run.pk, 1, WORKER, 30.0),
                                                     {"done": run.input["n"]}))
    assert results == [Settlement.SUCCEEDED] * 3
    statements = prepared_statements()
    assert any(s.startswith("WITH picked AS") for s in statements), statements
    assert any(s.startswith("WITH v AS") and "done AS (UPDATE" in s for s in statements), \
        statements  # the settle's
    assert any('INSERT INTO "django_agentruns_agentrun"' in s for s in statements), \
        statements  # enqueue's
    # Only ours: Django's own statements stay unprepared.
    assert all(s.startswith(("WITH ", "INSERT INTO")) for s in statements), statements
    for row in AgentRun.objects.all():
        assert (row.status, row.output) == (Status.SUCCEEDED, {"done": row.input["n"]})
        assert list(RunEvent.objects.filter(run=row).order_by("seq")
                    .values_list("seq", "type")) == [(1, transitions.STARTED),
                                                     (2, transitions.SUCCEEDED)]


@override_settings(AGENTRUNS={"PREPARED_STATEMENTS": True})
def test_a_worker_with_prepared_statements_drains_its_queue() -> None:
    runs = [enqueue("tests.noop", {"n": n}) for n in range(10)]
    runs += enqueue_many([RunRequest("tests.noop", {"n": n}) for n in range(10, 20)])
    assert [AgentRun.objects.get(pk=r.pk).input for r in runs] == [{"n": n} for n in range(20)]
    stats = Worker(concurrency=4, burst=True, reap_interval=0).run(install_signals=False)
    assert stats.settled == {"succeeded": 20}
    assert set(AgentRun.objects.filter(pk__in=[r.pk for r in runs])
               .values_list("status", flat=True)) == {Status.SUCCEEDED}
