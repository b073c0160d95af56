"""The worker's prepared statements (PostgreSQL, `PREPARED_STATEMENTS`): the attempt
store's one-statement write and the claim. A generic plan is made once per connection,
from the tables' sizes then. Made while the runs and events were few (a new install, a new
partition), it must still read by index once they are many: the worker's connections, its
writers' and its claim loop's, plan no sequential scan where an index serves
(`transitions.plans.plan_by_index`). And a batch of hundreds of writes costs each of them
the same work as a batch of one: no part of the statement compares every pair.

Measured by the plans' own row counts (EXPLAIN ANALYZE), not by time."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from django_agentruns import RunRequest, enqueue, enqueue_many, transitions
from django_agentruns.models import AgentRun, Reason, RunCheckpoint, RunEvent, Status
from django_agentruns.registry import scope_policy
from django_agentruns.runtime import attempt_store
from django_agentruns.runtime.worker import Worker
from django_agentruns.transitions import AttemptRef, ScopePolicy, hot_sql, plans, rawsql
from django_agentruns.transitions.alone import _row
from django_agentruns.transitions.attempts import checkpoints_kept
from django_agentruns.transitions.batched import CheckpointWrite, EmitWrite
from django_agentruns.transitions.due import compiled_due
from tests import helpers
from tests.test_claim_plans import claim_statement

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

WORKER = "plans:1:abcd"
LATER_EVENTS, PER_RUN = 3_000, 10  # other runs' history, written after the plan
EVENTS, RUNS = RunEvent._meta.db_table, AgentRun._meta.db_table
STATES = RunCheckpoint._meta.db_table


def emit_statement(ref: AttemptRef) -> tuple[str, list[Any]]:
    at = timezone.now()
    write = EmitWrite(ref, uuid.uuid4(), "llm.step", {"tokens": 256})
    return rawsql.fenced_alone([_row(write, at)], Status.RUNNING, at, checkpoints_kept())


def prepare(cursor: Any, name: str, sql: str, params: list[Any]) -> str:
    """PREPARE `sql` as `name`, run it once on its generic plan (made now, from the
    tables' sizes now); the EXECUTE text to run it again with as many parameters."""
    cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
    numbered = iter(range(1, len(params) + 1))
    cursor.execute(f"PREPARE {name} AS " + re.sub(
        r"%%|%s", lambda m: "%" if m[0] == "%%" else f"${next(numbered)}", sql))
    execute = f"EXECUTE {name} ({', '.join(['%s'] * len(params))})"
    cursor.execute(execute, params)
    return execute


def explained(cursor: Any, execute: str, params: list[Any]) -> Any:
    cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {execute}", params)
    return cursor.fetchone()[0]


def grow_events() -> None:
    """LATER_EVENTS events of other runs."""
    others = [r.pk for r in enqueue_many(
        [RunRequest("tests.noop") for _ in range(LATER_EVENTS // PER_RUN)])]
    RunEvent.objects.bulk_create(
        RunEvent(run_id=other, seq=seq, event_id=uuid.uuid4(), type="llm.step",
                 payload={}, attempt=1) for other in others for seq in range(PER_RUN))


def rows_read_by_a_plan_made_early(set_up: bool) -> dict[str, int]:
    """Prepare the emit while the events table holds its run's one event, run it on its
    generic plan, let other runs write LATER_EVENTS events, then run the same cached plan
    again: the rows it reads.
    `set_up`: on a connection set up as the attempt store's writers are."""
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {EVENTS}")  # a new install's few pages
    enqueue("tests.noop", {"n": 1})
    (run,) = transitions.claim(WORKER, ["default"], 1, ScopePolicy(), {}, 60.0,
                               include_lapsed=False)
    ref = AttemptRef(run.pk, run.attempt, WORKER, 60.0)
    with transaction.atomic(), connection.cursor() as cursor:
        if set_up:
            plans.plan_by_index()
        execute = prepare(cursor, "plans_emit", *emit_statement(ref))
        grow_events()
        plan = explained(cursor, execute, emit_statement(ref)[1])
        cursor.execute("DEALLOCATE plans_emit")
        transaction.set_rollback(True)  # the SET and the writes with it
    return {table: helpers.plan_rows_read(plan, table) for table in (EVENTS, RUNS)}


@override_settings(AGENTRUNS={"PREPARED_STATEMENTS": True})
def test_a_writers_emit_planned_while_events_were_few_reads_by_index_once_they_are_many(
) -> None:
    read = rows_read_by_a_plan_made_early(set_up=True)
    # The run by its id; its last seq and the new event's id by index: its own few events.
    assert read[RUNS] <= 2, read
    assert read[EVENTS] <= 10, read


def test_without_the_writers_set_up_that_plan_scans_what_grew_for_each_emit() -> None:
    # What the set-up prevents: made while the tables were small, the plan scans one of
    # them whole for every emit after (here the runs; in a sync LLM-shaped trial the
    # events: 5 ms a statement, 89 at most).
    read = rows_read_by_a_plan_made_early(set_up=False)
    assert read[RUNS] + read[EVENTS] >= LATER_EVENTS // PER_RUN, read


def rows_a_claim_planned_early_reads(set_up: bool) -> int:
    """Prepare the claim while the events table is a new install's, claim a run on its
    generic plan, let other runs write LATER_EVENTS events, then claim the next run on
    the same cached plan: the events it reads (its start event's seq is one past the
    run's last)."""
    enqueue_many([RunRequest("tests.noop", {"n": n}) for n in range(2)])
    with connection.cursor() as cursor:
        # A new install's statistics, as autovacuum takes them: no event yet. (The flush
        # after the test, a TRUNCATE, forgets them.)
        cursor.execute(f"TRUNCATE {EVENTS}")
        cursor.execute(f"ANALYZE {EVENTS}")
    with transaction.atomic(), connection.cursor() as cursor:
        if set_up:
            plans.plan_by_index()
        execute = prepare(cursor, "plans_claim", *claim_statement(1))
        grow_events()
        plan = explained(cursor, execute, claim_statement(1)[1])
        cursor.execute("DEALLOCATE plans_claim")
        transaction.set_rollback(True)
    return helpers.plan_rows_read(plan, EVENTS)


@override_settings(AGENTRUNS={"PREPARED_STATEMENTS": True})
def test_a_claim_planned_while_events_were_few_reads_by_index_once_they_are_many() -> None:
    assert rows_a_claim_planned_early_reads(set_up=True) <= 10


def test_without_the_set_up_the_claims_plan_scans_every_event_for_each_run_it_starts(
) -> None:
    # What the claim loop's set-up prevents: in an LLM-shaped trial of 4,000 async runs
    # on 1,000 slots, 2 ms a run started by the last wave, 130 ms a claim of 64.
    assert rows_a_claim_planned_early_reads(set_up=False) >= LATER_EVENTS


@override_settings(AGENTRUNS={"PREPARED_STATEMENTS": True})
def test_a_batch_of_hundreds_costs_each_write_what_a_batch_of_one_does() -> None:
    """256 writes in one statement: emits, checkpoints, and checkpoints past
    CHECKPOINT_HISTORY (20) with old states to trim, on the generic plan made for one
    write while the tables were small. Before, it compared every pair of the batch's
    rows, three times: 268,000 rows handled for these 256 writes, against 5,000 now."""
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {EVENTS}, {STATES}")
    enqueue_many([RunRequest("tests.noop", {"n": n}) for n in range(256)])
    refs = [AttemptRef(run.pk, run.attempt, WORKER, 60.0) for run in transitions.claim(
        WORKER, ["default"], 256, ScopePolicy(), {}, 60.0, include_lapsed=False)]
    trimming, saving = refs[::8], [ref for n, ref in enumerate(refs) if n % 8 == 4]
    numbers = {ref.run_id: 30 for ref in trimming} | {ref.run_id: 6 for ref in saving}

    def statement(batch: list[AttemptRef]) -> tuple[str, list[Any]]:
        at = timezone.now()
        return rawsql.fenced_alone([_row(
            CheckpointWrite(ref, {"n": numbers[ref.run_id]}, numbers[ref.run_id])
            if ref.run_id in numbers else EmitWrite(ref, uuid.uuid4(), "llm.step", {}), at)
            for ref in batch], Status.RUNNING, at, checkpoints_kept())

    with transaction.atomic(), connection.cursor() as cursor:
        plans.plan_by_index()
        execute = prepare(cursor, "plans_batch", *statement(refs[1:2]))
        RunCheckpoint.objects.bulk_create(RunCheckpoint(run_id=ref.run_id, number=n, state={})
                                          for ref in refs for n in range(1, 6))
        grow_events()
        plan = explained(cursor, execute, statement(refs)[1])
        steps = RunEvent.objects.filter(type="llm.step", run_id__in=[r.run_id for r in refs])
        emitted = steps.count()
        kept = {ref.run_id: sorted(RunCheckpoint.objects.filter(run_id=ref.run_id)
                                   .values_list("number", flat=True))
                for ref in (trimming[0], saving[0], refs[1])}
        cursor.execute("DEALLOCATE plans_batch")
        transaction.set_rollback(True)
    assert helpers.plan_rows_handled(plan) <= 30 * len(refs), helpers.plan_rows_handled(plan)
    assert emitted == len(refs) - len(numbers) + 1  # and refs[1]'s when the plan was made
    assert kept == {trimming[0].run_id: [30],  # past 30 - 20 trimmed
                    saving[0].run_id: [1, 2, 3, 4, 5, 6], refs[1].run_id: [1, 2, 3, 4, 5]}


@pytest.mark.parametrize("prepared", [True, False])
def test_a_workers_claim_loop_plans_by_index_where_its_statements_are_prepared(
        prepared: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    settle_and_claim = transitions.settle_and_claim

    def claiming(*args: Any, **kwargs: Any) -> Any:
        with connection.cursor() as cursor:
            cursor.execute("SHOW enable_seqscan")
            seen.append(cursor.fetchone()[0])
        return settle_and_claim(*args, **kwargs)

    monkeypatch.setattr(transitions, "settle_and_claim", claiming)
    enqueue("tests.noop", {"n": 1})
    with override_settings(AGENTRUNS={"PREPARED_STATEMENTS": prepared}):
        stats = Worker(burst=True, reap_interval=0).run(install_signals=False)
    assert stats.settled == {"succeeded": 1}
    assert seen
    assert set(seen) == {"off" if prepared else "on"}


@pytest.mark.parametrize(("settings", "plans_by_index"), [
    ({"PREPARED_STATEMENTS": True}, True),
    ({"PREPARED_STATEMENTS": True, "LISTEN_DATABASE": "default"}, True),
    # Behind a pooler a session's SET would stay with a server connection others get next.
    ({"PREPARED_STATEMENTS": True, "LISTEN_DATABASE": "direct"}, False),
    ({"PREPARED_STATEMENTS": False}, False),
])
def test_a_store_writer_prepares_and_plans_by_index_only_on_a_direct_connection(
        settings: dict[str, Any], plans_by_index: bool) -> None:
    seen: list[tuple[str, int]] = []

    def apply(writes: Any) -> list[Any]:
        results = attempt_store._apply_writes(writes)
        with connection.cursor() as cursor:
            cursor.execute("SHOW enable_seqscan")
            scan = cursor.fetchone()[0]
            cursor.execute("SELECT count(*) FROM pg_prepared_statements "
                           "WHERE statement LIKE '%%fenced AS (UPDATE%%'")
            seen.append((scan, cursor.fetchone()[0]))
        return results

    enqueue("tests.noop", {"n": 1})
    (run,) = transitions.claim(WORKER, ["default"], 1, ScopePolicy(), {}, 60.0,
                               include_lapsed=False)
    ref = AttemptRef(run.pk, run.attempt, WORKER, 60.0)
    with override_settings(AGENTRUNS=settings):
        store = attempt_store.AttemptStore(1, apply=apply)
        try:
            store.call(EmitWrite(ref, uuid.uuid4(), "llm.step", {}))
        finally:
            store.close()
    assert seen == [("off", 1) if plans_by_index else ("on", 0)]
    assert RunEvent.objects.filter(run_id=run.pk, type="llm.step").count() == 1


def settle_and_claim_statement(settled: list[AttemptRef], limit: int) -> tuple[str, list[Any]]:
    """The claim loop's one statement: `settled` successes (no output), then `limit` claims."""
    due = compiled_due("postgresql", ("default",), scope_policy(), limit, ids_only=True,
                       naive=rawsql.naive_times())
    at = timezone.now()
    return hot_sql.settle_and_claim(
        [(ref.run_id, ref.attempt, None, transitions.lifecycle_event_id()) for ref in settled],
        WORKER, Status.RUNNING, Status.SUCCEEDED, Reason.COMPLETED, transitions.SUCCEEDED, due,
        at, Status.QUEUED, {}, at + timedelta(seconds=30), transitions.STARTED)


@override_settings(AGENTRUNS={"PREPARED_STATEMENTS": True})
def test_a_settle_and_claim_of_any_size_is_one_statement_that_settles_by_id() -> None:
    """The successes travel as one JSON parameter: every batch size is the same text, one
    prepared statement. Its generic plan, made for one success while the tables were
    small, settles 64 by id once the runs and events are many."""
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {EVENTS}")
    enqueue_many([RunRequest("tests.noop", {"n": n}) for n in range(66)])
    refs = [AttemptRef(run.pk, run.attempt, WORKER, 60.0) for run in transitions.claim(
        WORKER, ["default"], 65, ScopePolicy(), {}, 60.0, include_lapsed=False)]
    one = settle_and_claim_statement(refs[:1], 1)
    with transaction.atomic(), connection.cursor() as cursor:
        plans.plan_by_index()
        execute = prepare(cursor, "plans_settle", *one)
        grow_events()
        many = settle_and_claim_statement(refs[1:], 1)
        plan = explained(cursor, execute, many[1])
        settled = AgentRun.objects.filter(pk__in=[r.run_id for r in refs],
                                          status=Status.SUCCEEDED).count()
        ended = RunEvent.objects.filter(type=transitions.SUCCEEDED,
                                        run_id__in=[r.run_id for r in refs]).count()
        started = AgentRun.objects.filter(status=Status.RUNNING).exclude(
            pk__in=[r.run_id for r in refs]).count()
        cursor.execute("DEALLOCATE plans_settle")
        transaction.set_rollback(True)
    assert (many[0], len(many[1])) == (one[0], len(one[1]))
    # 64 and refs[0], settled when the plan was made; a run claimed each time.
    assert (settled, ended, started) == (65, 65, 2)
    # Each run by id, twice (the settle, and the claim's picking around it); its last seq
    # by index. A scan would read the 366 runs, or the 3,000 events, for each.
    read = {table: helpers.plan_rows_read(plan, table) for table in (RUNS, EVENTS)}
    assert read[RUNS] <= 4 * 65, read
    assert read[EVENTS] <= 2 * 65, read


@pytest.mark.parametrize("through", ["claim loop", "attempt store"])
def test_a_settle_finds_its_runs_by_id_when_the_statistics_count_no_running_run(
        through: str) -> None:
    """Statistics taken while every run was queued (a backlog analyzed before the workers
    started) count no running run. A status guard that an index of statuses matches sent
    the settle through every running run for its few; it reads each of its runs by id."""
    enqueue_many([RunRequest("tests.noop", {"n": n}) for n in range(400)])
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {RUNS}")
    refs = [AttemptRef(run.pk, run.attempt, WORKER, 60.0) for run in transitions.claim(
        WORKER, ["default"], 300, ScopePolicy(), {}, 60.0, include_lapsed=False)]
    assert len(refs) == 300
    settled = refs[:64]
    if through == "claim loop":
        sql, params = settle_and_claim_statement(settled, 1)
    else:
        sql, params = hot_sql.settle_succeeded(
            [(ref.run_id, ref.attempt, None, transitions.lifecycle_event_id())
             for ref in settled], WORKER, Status.RUNNING, Status.SUCCEEDED,
            Reason.COMPLETED, transitions.SUCCEEDED, timezone.now(), with_events=True)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
        done = AgentRun.objects.filter(status=Status.SUCCEEDED).count()
        transaction.set_rollback(True)
    assert done == 64
    # Each by id, twice at most (and the claim's one pick); the 300 running runs would
    # be read through the status index, the 400 runs by a scan.
    assert helpers.plan_rows_read(plan, RUNS) <= 2 * 64 + 8, helpers.plan_rows_read(plan, RUNS)
