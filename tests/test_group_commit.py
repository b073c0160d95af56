"""Successes that finish together are written in one transaction (group commit), each
still fenced on its own; a lone success is written at once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import pytest
from django.db import close_old_connections, connection

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


def test_a_failed_write_reaches_every_success_in_its_batch() -> None:
    def write(items: Sequence[tuple[AttemptRef, Any]]) -> dict[AttemptRef, Settlement]:
        if len(items) > 1:
            raise psycopg.OperationalError("server closed the connection")
        return {r: Settlement.SUCCEEDED for r, _ in items}

    writer = GatedWriter(write)
    group = GroupCommit(writer)
    results = settle_in_threads(group, [ref(i) for i in range(1, 5)], writer)
    assert results[1] is Settlement.SUCCEEDED
    assert all(isinstance(results[i], psycopg.OperationalError) for i in (2, 3, 4))



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
