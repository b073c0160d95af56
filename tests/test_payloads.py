"""Issue #29's narrow hot row, its second part: a run's error traceback is not a column of
the run row but its latest `RunPayload` of kind traceback (append-only, partitioned with
the history), which `AgentRun.error_traceback` reads through. Purge and erase delete a
run's payloads with it, on plain and on partitioned history."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_agentruns import enqueue, transitions
from django_agentruns.models import AgentRun, RunPayload, Status
from django_agentruns.ops.retention import erase, purge
from django_agentruns.outcomes import AttemptRef, ErrorInfo, Settlement
from django_agentruns.registry import scope_policy
from django_agentruns.rules.policy import Failure

pytestmark = pytest.mark.usefixtures("history_layout")
RUNS = AgentRun._meta.db_table


def claim_one(worker: str = "w-payload") -> AttemptRef:
    [run] = transitions.claim(worker, ["default"], 1, scope_policy(), {}, 30.0)
    return AttemptRef(run.pk, run.attempt, worker, 30.0)


def fail(ref: AttemptRef, traceback: str, *, retryable: bool = True) -> Settlement:
    return transitions.settle_failed(ref, Failure(retryable=retryable),
                                     ErrorInfo("ValueError", "bad", traceback))


def tracebacks(run_id: int) -> list[Any]:
    return list(RunPayload.objects.filter(run_id=run_id, kind=RunPayload.TRACEBACK)
                .order_by("id").values_list("value", flat=True))


def test_the_run_table_has_no_traceback_column(db: None) -> None:
    with connection.cursor() as cursor:
        columns = {c.name for c in connection.introspection.get_table_description(cursor, RUNS)}
    assert {"error_type", "error_message"} <= columns
    assert "error_traceback" not in columns


def test_a_failure_keeps_its_traceback_out_of_the_run_row(
        db: None, django_assert_num_queries: Any) -> None:
    run = enqueue("tests.noop")
    fresh = AgentRun.objects.get(pk=run.pk)
    with django_assert_num_queries(0):  # never failed: nothing to read
        assert fresh.error_traceback == ""
    ref = claim_one()
    text = "Traceback (most recent call last):\n  ValueError: bad\n" + "x" * 5000
    with CaptureQueriesContext(connection) as queries:
        assert fail(ref, text) is Settlement.REQUEUED
    updates = [q["sql"] for q in queries.captured_queries
               if q["sql"].lstrip().upper().startswith("UPDATE") and RUNS in q["sql"]]
    assert updates
    assert not any("x" * 100 in sql or "Traceback" in sql for sql in updates), updates
    assert tracebacks(run.pk) == [text]
    row = AgentRun.objects.get(pk=run.pk)
    with django_assert_num_queries(1):
        assert row.error_traceback == text
        assert row.error_traceback == text  # kept on the instance
    assert (row.error_type, row.error_message) == ("ValueError", "bad")


def test_the_latest_traceback_wins_and_an_abandon_clears_it(db: None) -> None:
    run = enqueue("tests.noop")
    fail(claim_one(), "first")
    AgentRun.objects.filter(pk=run.pk).update(available_at=timezone.now())
    fail(claim_one(), "second")
    assert AgentRun.objects.get(pk=run.pk).error_traceback == "second"
    AgentRun.objects.filter(pk=run.pk).update(available_at=timezone.now())
    ref = claim_one()
    assert transitions.abandon(ref, "stopping") is Settlement.REQUEUED
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.error_type, row.error_traceback) == ("AbandonedAttempt", "")
    assert tracebacks(run.pk) == ["first", "second", ""]


def test_an_abandon_without_an_earlier_traceback_writes_no_row(db: None) -> None:
    run = enqueue("tests.noop")
    transitions.abandon(claim_one(), "stopping")
    assert tracebacks(run.pk) == []
    assert AgentRun.objects.get(pk=run.pk).error_traceback == ""


def test_purge_and_erase_delete_the_runs_payloads(db: None) -> None:
    runs = [enqueue("tests.noop") for _ in range(3)]
    for run in runs:
        ref = claim_one()
        assert ref.run_id == run.pk
        fail(ref, f"boom {run.pk}", retryable=False)
    AgentRun.objects.filter(pk__in=[r.pk for r in runs[:2]]).update(
        finished_at=timezone.now() - timedelta(days=40))
    report = purge(timedelta(days=30), include_dead_letters=True)
    assert report.runs == 2
    assert set(RunPayload.objects.values_list("run_id", flat=True)) == {runs[2].pk}
    erase(runs[2].pk)
    assert not RunPayload.objects.exists()
    assert AgentRun.objects.filter(status=Status.FAILED).count() == 0


def test_a_new_run_enters_no_index_of_a_parent_or_origin_it_lacks(db: None) -> None:
    """Migration 0024: the parent and fork-origin indexes hold only runs that have one, and
    the payload table's run lookups use `agentruns_payload_kind` (which leads with the
    run), not an index of their own: a new run writes three index entries fewer."""
    with connection.cursor() as cursor:
        runs = connection.introspection.get_constraints(cursor, RUNS)
        payloads = connection.introspection.get_constraints(cursor, RunPayload._meta.db_table)
    on_column = {name: c["columns"] for name, c in runs.items() if c["index"]}
    assert on_column["agentruns_parent"] == ["parent_id"]
    assert on_column["agentruns_forked_from"] == ["forked_from_id"]
    # No other index of the run table is on either column alone (Django's full ones).
    assert sorted(n for n, cols in on_column.items()
                  if cols in (["parent_id"], ["forked_from_id"])) == [
        "agentruns_forked_from", "agentruns_parent"]
    payload_indexes = [c["columns"] for c in payloads.values()
                       if c["index"] and not c["primary_key"]]
    assert ["run_id"] not in payload_indexes
    assert any(cols[:1] == ["run_id"] for cols in payload_indexes)
    if connection.vendor == "postgresql":  # partial: a run without a parent is not in it
        with connection.cursor() as cursor:
            cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = %s",
                           ["agentruns_parent"])
            assert "WHERE (parent_id IS NOT NULL)" in cursor.fetchone()[0]


def payload_foreign_keys() -> list[str]:
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, RunPayload._meta.db_table)
    return [name for name, c in found.items() if c["foreign_key"]]


def test_the_payload_table_has_no_foreign_key_to_the_runs(db: None) -> None:
    """Migration 0026: the check cost every input an enqueue writes; purge and erase
    delete a run's payloads themselves (above), on plain history as on partitioned."""
    assert payload_foreign_keys() == []


def test_an_orm_delete_of_a_run_still_deletes_its_payloads(db: None) -> None:
    # The field stays a ForeignKey with CASCADE: Django's collector finds the rows.
    kept, gone = enqueue("tests.noop", {"keep": 1}), enqueue("tests.noop", {"drop": 1})
    AgentRun.objects.filter(pk=gone.pk).delete()
    assert list(RunPayload.objects.values_list("run_id", flat=True)) == [kept.pk]


@pytest.mark.django_db(transaction=True)
def test_migration_0026_drops_the_payload_foreign_key_and_makes_it_again(
        history_layout: str) -> None:
    from django.core.management import call_command

    call_command("migrate", "django_agentruns", "0025", verbosity=0)
    try:
        assert len(payload_foreign_keys()) == 1
        run = enqueue("tests.noop", {"q": 1})  # the old layout works with the new code
    finally:
        call_command("migrate", "django_agentruns", verbosity=0)
    assert payload_foreign_keys() == []
    assert AgentRun.objects.get(pk=run.pk).input == {"q": 1}
