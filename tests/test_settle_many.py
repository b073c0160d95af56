"""Successes written together: `settle_succeeded_many` fences each run on its own and tells
each story once; a success the database refuses costs only its own write in the worker's
attempt store (which writes a failed batch's members again one by one)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest
from django.db import DatabaseError, close_old_connections, connection

from django_agentruns import transitions
from django_agentruns.models import AgentRun, RunEvent, RunPayload, Status
from django_agentruns.runtime.attempt_store import AttemptStore
from django_agentruns.transitions import (
    AttemptRef,
    Result,
    Settlement,
    SucceedWrite,
    due,
)
from tests import helpers
from tests.store_support import claim_runs

WORKER = "group-commit:1:abcd"


def ref(run_id: int, attempt: int = 1) -> AttemptRef:
    return AttemptRef(run_id, attempt, WORKER, 2.0)


def claimed_runs(count: int) -> list[AgentRun]:
    return claim_runs(count, WORKER, ttl=2.0)


@pytest.mark.django_db(transaction=True)
def test_a_batch_is_fenced_run_by_run_and_tells_each_story_once() -> None:
    runs = claimed_runs(5)
    # The third run's lease was lost to a reclaim: its success must not be written.
    lost = runs[2]
    AgentRun.objects.filter(pk=lost.pk).update(claimed_by="another-worker")
    results = transitions.settle_succeeded_many(
        WORKER, [(ref(r.pk, r.attempt), {"n": r.pk}) for r in runs])

    assert {r.run_id: s for r, s in results.items()} == {
        r.pk: Settlement.LOST if r is lost else Settlement.SUCCEEDED for r in runs}
    for r in runs:
        row = AgentRun.objects.get(pk=r.pk)
        events = list(RunEvent.objects.filter(run_id=r.pk).order_by("seq")
                      .values_list("seq", "type"))
        if r is lost:
            assert row.status == Status.RUNNING
            assert events == [(1, transitions.STARTED)]
        else:
            assert (row.status, row.output) == (Status.SUCCEEDED, {"n": r.pk})
            assert events == [(1, transitions.STARTED), (2, transitions.SUCCEEDED)]


@pytest.mark.django_db(transaction=True)
def test_claiming_outside_a_transaction_compiles_its_query_there_too() -> None:
    """The compiled due query is cached per shape: the first of a shape may be compiled
    in a worker's autocommit pass (regression: FOR UPDATE refused outside a transaction)."""
    due.compiled_due.cache_clear()
    assert not connection.in_atomic_block
    runs = claimed_runs(3)
    assert {r.status for r in runs} == {Status.RUNNING}
    assert [r.attempt for r in runs] == [1, 1, 1]


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_an_event_appended_while_a_settle_waits_is_not_overwritten() -> None:
    """PostgreSQL settles in one statement, its end event's seq computed from the
    statement's snapshot. A cancel request committed while the settle waited on the row
    lock collides with that seq: the settle then writes in two statements, and both
    events are kept, in order."""
    (run,) = claimed_runs(1)
    params = dict(connection.get_connection_params())
    params.pop("cursor_factory", None)
    params.pop("context", None)
    result: list[Settlement] = []
    with psycopg.connect(**params, autocommit=True) as other, \
            psycopg.connect(**params, autocommit=True) as admin:
        # An operator's cancel request, in flight: the row locked, its event appended.
        other.execute("BEGIN")
        other.execute(f'UPDATE "{AgentRun._meta.db_table}" SET cancel_requested_at = now() '
                      f"WHERE id = %s", [run.pk])
        other.execute(f'INSERT INTO "{RunEvent._meta.db_table}" (run_id, seq, event_id, type, '
                      f"payload, attempt, created_at) VALUES (%s, 2, gen_random_uuid(), "
                      f"'run.cancel_requested', '{{}}', 1, now())", [run.pk])

        def settle() -> None:
            try:
                result.append(transitions.settle_succeeded(ref(run.pk), {"ok": True}))
            finally:
                close_old_connections()

        thread = threading.Thread(target=settle)
        thread.start()
        helpers.wait_until(lambda: admin.execute(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query ~ '^WITH v'").fetchone(),
            message="the settle to wait on the row lock")
        other.execute("COMMIT")
        thread.join(20)
    assert result == [Settlement.SUCCEEDED]
    events = list(RunEvent.objects.filter(run_id=run.pk).order_by("seq")
                  .values_list("seq", "type"))
    assert events == [(1, transitions.STARTED), (2, "run.cancel_requested"),
                      (3, transitions.SUCCEEDED)]


def refuse_output(marker: str) -> None:
    """A database-level rejection of one success: a trigger refusing any output holding
    `marker` (its output payload row; an input holding it is let in), as a value too
    large for the column would be refused."""
    table = RunPayload._meta.db_table
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"""CREATE OR REPLACE FUNCTION agentruns_test_refuse() RETURNS trigger
                AS $$ BEGIN IF NEW.kind = 'output' AND NEW.value::text LIKE '%{marker}%' THEN
                RAISE EXCEPTION 'output refused' USING ERRCODE = 'data_exception'; END IF;
                RETURN NEW; END $$ LANGUAGE plpgsql""")
            cursor.execute(f'CREATE TRIGGER agentruns_test_refuse BEFORE INSERT ON "{table}" '
                           f"FOR EACH ROW EXECUTE FUNCTION agentruns_test_refuse()")
        else:
            cursor.execute(f'CREATE TRIGGER agentruns_test_refuse BEFORE INSERT ON "{table}" '
                           f"WHEN NEW.kind = 'output' AND NEW.value LIKE '%{marker}%' "
                           f"BEGIN SELECT RAISE(ABORT, 'output refused'); END")


def drop_refusal() -> None:
    table = RunPayload._meta.db_table
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f'DROP TRIGGER IF EXISTS agentruns_test_refuse ON "{table}"')
            cursor.execute("DROP FUNCTION IF EXISTS agentruns_test_refuse()")
        else:
            cursor.execute("DROP TRIGGER IF EXISTS agentruns_test_refuse")


@pytest.fixture
def refusing_database(transactional_db: None) -> Iterator[str]:
    marker = "refuse-me"
    refuse_output(marker)
    yield marker
    drop_refusal()


def test_a_member_the_database_refuses_leaves_the_batch_to_succeed(
        refusing_database: str) -> None:
    runs = claimed_runs(4)
    bad = runs[2]
    store = AttemptStore(1)
    try:
        futures = {r.pk: store.submit(SucceedWrite(
            ref(r.pk, r.attempt),
            {"n": r.pk, "tag": refusing_database if r.pk == bad.pk else ""}))
            for r in runs}
        results: dict[int, Result | BaseException] = {}
        for pk, future in futures.items():
            try:
                results[pk] = future.result(20)
            except DatabaseError as exc:
                results[pk] = exc
    finally:
        store.close()

    assert isinstance(results[bad.pk], DatabaseError), results
    assert "output refused" in str(results[bad.pk])
    for r in runs:
        row = AgentRun.objects.get(pk=r.pk)
        if r is bad:
            assert row.status == Status.RUNNING, "its write was refused: nothing recorded"
        else:
            assert results[r.pk] is Settlement.SUCCEEDED
            assert (row.status, row.output) == (Status.SUCCEEDED, {"n": r.pk, "tag": ""})
            assert RunEvent.objects.filter(run_id=r.pk, type=transitions.SUCCEEDED).count() == 1
