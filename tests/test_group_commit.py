"""Successes that finish together are written in one transaction (group commit), each
still fenced on its own; a lone success is written at once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
import pytest
from django.db import DatabaseError, close_old_connections, connection

from django_agentruns import enqueue, transitions
from django_agentruns.group_commit import GroupCommit
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.transitions import AttemptRef, ScopePolicy, Settlement, due
from tests import helpers

WORKER = "group-commit:1:abcd"
Write = Callable[[Sequence[tuple[AttemptRef, Any]]], dict[AttemptRef, Settlement]]


def ref(run_id: int, attempt: int = 1) -> AttemptRef:
    return AttemptRef(run_id, attempt, WORKER, 2.0)


class GatedWriter:
    """Records each batch; the first write waits until the test opens the gate."""

    def __init__(self, write: Write | None = None) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.first = True
        self.write = write

    def __call__(self, items: Sequence[tuple[AttemptRef, Any]]) -> dict[AttemptRef, Settlement]:
        self.batches.append([r.run_id for r, _ in items])
        if self.first:
            self.first = False
            assert self.gate.wait(20), "the test never opened the gate"
        if self.write is not None:
            return self.write(items)
        return {r: Settlement.SUCCEEDED for r, _ in items}


def settle_in_threads(group: GroupCommit, refs: list[AttemptRef], writer: GatedWriter,
                      ) -> dict[int, Settlement | BaseException]:
    """The first ref settles alone (its write held at the gate); the rest queue behind it."""
    results: dict[int, Settlement | BaseException] = {}

    def settle(r: AttemptRef) -> None:
        try:
            results[r.run_id] = group.settle(r, {"n": r.run_id})
        except BaseException as exc:
            results[r.run_id] = exc
        finally:
            close_old_connections()

    threads = [threading.Thread(target=settle, args=(r,)) for r in refs]
    threads[0].start()
    helpers.wait_until(lambda: writer.batches, message="the first write to start")
    for t in threads[1:]:
        t.start()
    helpers.wait_until(lambda: group.waiting == len(refs) - 1,
                       message="the other successes to queue behind the first")
    writer.gate.set()
    for t in threads:
        t.join(20)
    group.close()
    return results


def test_a_lone_success_is_written_at_once_as_a_batch_of_one() -> None:
    writer = GatedWriter()
    writer.first = False
    group = GroupCommit(writer)
    assert group.settle(ref(1), None) is Settlement.SUCCEEDED
    assert group.settle(ref(2), None) is Settlement.SUCCEEDED
    assert writer.batches == [[1], [2]]
    group.close()
    with pytest.raises(RuntimeError, match="closed"):
        group.settle(ref(3), None)


def test_a_failed_write_is_followed_by_on_error_and_the_group_goes_on() -> None:
    calls: list[int] = []
    errors: list[str] = []

    def write(items: Sequence[tuple[AttemptRef, Any]]) -> dict[AttemptRef, Settlement]:
        calls.append(len(items))
        if len(calls) == 1:
            raise psycopg.OperationalError("server closed the connection")
        return {r: Settlement.SUCCEEDED for r, _ in items}

    group = GroupCommit(write, on_error=lambda: errors.append("closed"))
    with pytest.raises(psycopg.OperationalError):
        group.settle(ref(1), None)
    assert errors == ["closed"]
    assert group.settle(ref(1), None) is Settlement.SUCCEEDED
    group.close()


def test_successes_finishing_during_a_write_share_the_next_one() -> None:
    writer = GatedWriter()
    group = GroupCommit(writer)
    results = settle_in_threads(group, [ref(i) for i in range(1, 7)], writer)
    assert results == dict.fromkeys(range(1, 7), Settlement.SUCCEEDED)
    assert writer.batches[0] == [1]
    assert sorted(writer.batches[1]) == [2, 3, 4, 5, 6]
    assert (group.batches, group.settled, group.waiting) == (2, 6, 0)


def test_batches_are_capped() -> None:
    writer = GatedWriter()
    group = GroupCommit(writer, max_batch=2)
    results = settle_in_threads(group, [ref(i) for i in range(1, 6)], writer)
    assert set(results.values()) == {Settlement.SUCCEEDED}
    assert [len(b) for b in writer.batches] == [1, 2, 2]


def test_a_failed_batch_is_written_again_one_success_at_a_time() -> None:
    """One member's bad write must not take the others down with it (issue 12, item 3)."""
    errors: list[str] = []

    def write(items: Sequence[tuple[AttemptRef, Any]]) -> dict[AttemptRef, Settlement]:
        if len(items) > 1 or items[0][0].run_id == 3:
            raise psycopg.DataError(f"refused a batch of {len(items)}")
        return {r: Settlement.SUCCEEDED for r, _ in items}

    writer = GatedWriter(write)
    group = GroupCommit(writer, on_error=lambda: errors.append("closed"))
    results = settle_in_threads(group, [ref(i) for i in range(1, 6)], writer)
    assert results[1] is results[2] is results[4] is results[5] is Settlement.SUCCEEDED
    assert isinstance(results[3], psycopg.DataError)
    assert str(results[3]) == "refused a batch of 1", "its own write's error, not the batch's"
    assert writer.batches[0] == [1]
    assert sorted(writer.batches[1]) == [2, 3, 4, 5]
    assert sorted(writer.batches[2:]) == [[2], [3], [4], [5]]
    assert errors == ["closed", "closed"], "after the batch, and after run 3's own write"
    assert (group.batches, group.settled) == (4, 4), "writes that succeeded, and successes"


def claimed_runs(count: int) -> list[AgentRun]:
    for i in range(count):
        enqueue("tests.noop", {"i": i})
    runs = transitions.claim(WORKER, ["default"], count, ScopePolicy(), {}, 2.0,
                             include_lapsed=False)
    assert len(runs) == count
    return runs


@pytest.mark.django_db(transaction=True)
def test_a_batch_is_fenced_run_by_run_and_tells_each_story_once() -> None:
    runs = claimed_runs(5)
    # The third run's lease was lost to a reclaim: its success must not be written.
    lost = runs[2]
    AgentRun.objects.filter(pk=lost.pk).update(claimed_by="another-worker")
    writer = GatedWriter(lambda items: transitions.settle_succeeded_many(WORKER, items))
    group = GroupCommit(writer)
    results = settle_in_threads(group, [ref(r.pk, r.attempt) for r in runs], writer)

    assert results == {r.pk: Settlement.LOST if r is lost else Settlement.SUCCEEDED
                       for r in runs}
    assert [len(b) for b in writer.batches] == [1, 4]
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
    `marker`, as a value too large for the column would be refused."""
    table = AgentRun._meta.db_table
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"""CREATE OR REPLACE FUNCTION agentruns_test_refuse() RETURNS trigger
                AS $$ BEGIN IF NEW.output::text LIKE '%{marker}%' THEN
                RAISE EXCEPTION 'output refused' USING ERRCODE = 'data_exception'; END IF;
                RETURN NEW; END $$ LANGUAGE plpgsql""")
            cursor.execute(f'CREATE TRIGGER agentruns_test_refuse BEFORE UPDATE ON "{table}" '
                           f"FOR EACH ROW EXECUTE FUNCTION agentruns_test_refuse()")
        else:
            cursor.execute(f'CREATE TRIGGER agentruns_test_refuse BEFORE UPDATE ON "{table}" '
                           f"WHEN NEW.output LIKE '%{marker}%' "
                           f"BEGIN SELECT RAISE(ABORT, 'output refused'); END")


def drop_refusal() -> None:
    table = AgentRun._meta.db_table
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
    writer = GatedWriter(lambda items: transitions.settle_succeeded_many(WORKER, items))
    group = GroupCommit(writer, on_error=lambda: connection.close())
    refs = [ref(r.pk, r.attempt) for r in runs]
    results: dict[int, Settlement | BaseException] = {}

    def settle(r: AttemptRef) -> None:
        output = {"n": r.run_id, "tag": refusing_database if r.run_id == bad.pk else ""}
        try:
            results[r.run_id] = group.settle(r, output)
        except BaseException as exc:
            results[r.run_id] = exc
        finally:
            close_old_connections()

    threads = [threading.Thread(target=settle, args=(r,)) for r in refs]
    threads[0].start()
    helpers.wait_until(lambda: writer.batches, message="the first write to start")
    for t in threads[1:]:
        t.start()
    helpers.wait_until(lambda: group.waiting == 3, message="three successes to queue")
    writer.gate.set()
    for t in threads:
        t.join(20)
    group.close()

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
