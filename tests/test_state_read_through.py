"""Issue #29's narrow hot row, its first part: a run's resume state is not a column of the
run row. It is the checkpoint history's row number `checkpoint_count`, which
`AgentRun.checkpoint_state` reads through; a checkpoint writes that one history row and
only the count and lease of the run row. Migration 0019 moves existing states out."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_agentruns import enqueue, fork, transitions
from django_agentruns.models import AgentRun, RunCheckpoint
from django_agentruns.outcomes import AttemptRef, Renewal
from django_agentruns.queries import load_states
from django_agentruns.registry import scope_policy
from django_agentruns.transitions import CheckpointWrite, apply_writes

RUNS = AgentRun._meta.db_table


def claim_one(worker: str = "w-state") -> AttemptRef:
    [run] = transitions.claim(worker, ["default"], 1, scope_policy(), {}, 30.0)
    return AttemptRef(run.pk, run.attempt, worker, 30.0)


def run_updates(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries
            if q["sql"].lstrip().upper().startswith(("UPDATE", "WITH")) and RUNS in q["sql"]
            and "UPDATE" in q["sql"].upper()]


def test_the_run_table_has_no_state_column(db: None) -> None:
    with connection.cursor() as cursor:
        columns = {c.name for c in connection.introspection.get_table_description(cursor, RUNS)}
    assert "checkpoint_count" in columns
    assert "checkpoint_state" not in columns


@pytest.mark.usefixtures("history_layout")
@pytest.mark.parametrize("path", ["one write", "batched"])
def test_a_checkpoint_writes_its_state_to_the_history_only(db: None, path: str) -> None:
    enqueue("tests.noop")
    ref = claim_one()
    state = {"messages": ["x" * 100] * 3}
    with CaptureQueriesContext(connection) as queries:
        if path == "one write":
            assert transitions.checkpoint(ref, state, 1) is Renewal.OK
        else:
            with transaction.atomic():
                assert apply_writes([CheckpointWrite(ref, state, 1)]) == [Renewal.OK]
    updates = run_updates(queries)
    assert updates, "the checkpoint did not update the run row?"
    for sql in updates:
        assert "messages" not in sql, sql
        assert "checkpoint_state" not in sql, sql
    assert list(RunCheckpoint.objects.filter(run_id=ref.run_id).values_list(
        "number", "state")) == [(1, state)]
    run = AgentRun.objects.get(pk=ref.run_id)
    assert (run.checkpoint_count, run.checkpoint_state) == (1, state)


@pytest.mark.usefixtures("history_layout")
def test_the_state_reads_through_once_and_follows_a_refresh(
        db: None, django_assert_num_queries: Any) -> None:
    enqueue("tests.noop")
    ref = claim_one()
    run = AgentRun.objects.get(pk=ref.run_id)
    with django_assert_num_queries(0):  # no checkpoint yet: nothing to read
        assert run.checkpoint_state is None
    transitions.checkpoint(ref, {"step": 1}, 1)
    transitions.checkpoint(ref, {"step": 2}, 2)
    run.refresh_from_db()
    with django_assert_num_queries(1):
        assert run.checkpoint_state == {"step": 2}
        assert run.checkpoint_state == {"step": 2}  # kept on the instance
    assert AgentRun(checkpoint_count=3).checkpoint_state is None  # not saved: no query


@pytest.mark.usefixtures("history_layout")
def test_a_claims_runs_read_their_states_in_one_query(
        db: None, django_assert_num_queries: Any) -> None:
    for i in range(3):
        enqueue("tests.noop", {"i": i})
    refs = [claim_one() for _ in range(3)]
    for n, ref in enumerate(refs[:2], start=1):
        transitions.checkpoint(ref, {"saved": n}, n)
    runs = list(AgentRun.objects.order_by("pk"))
    with django_assert_num_queries(1):
        load_states(runs)
    with django_assert_num_queries(0):
        assert [run.checkpoint_state for run in runs] == [{"saved": 1}, {"saved": 2}, None]
    with django_assert_num_queries(0):
        load_states(runs)  # read already


def test_the_newest_state_survives_a_history_of_zero(db: None, settings: Any) -> None:
    settings.AGENTRUNS = {**settings.AGENTRUNS, "CHECKPOINT_HISTORY": 0}
    enqueue("tests.noop")
    ref = claim_one()
    for n in (1, 2, 3):
        transitions.checkpoint(ref, {"n": n}, n)
    assert list(RunCheckpoint.objects.values_list("number", flat=True)) == [3]
    assert AgentRun.objects.get().checkpoint_state == {"n": 3}


@pytest.mark.usefixtures("history_layout")
@pytest.mark.parametrize("saved", [0, 2])
def test_a_migrated_state_reads_through_and_forks(db: None, saved: int) -> None:
    enqueue("tests.noop")
    ref = claim_one()
    for n in range(1, saved + 1):
        transitions.checkpoint(ref, {"v1": n}, n)
    assert transitions.migrate_version(ref, {"v2": saved}, 2, 1) is Renewal.OK
    run = AgentRun.objects.get(pk=ref.run_id)
    assert (run.agent_version, run.checkpoint_count, run.checkpoint_state) == \
        (2, saved, {"v2": saved})
    assert RunCheckpoint.objects.filter(run_id=ref.run_id, number=saved).count() == 1
    forked = fork(run.pk)
    assert forked.checkpoint_state == ({"v2": saved} if saved else None)


def test_a_migration_to_no_state_before_any_checkpoint_writes_no_row(db: None) -> None:
    enqueue("tests.noop")
    ref = claim_one()
    assert transitions.migrate_version(ref, None, 2, 1) is Renewal.OK
    assert not RunCheckpoint.objects.exists()
    assert AgentRun.objects.get().checkpoint_state is None


# --------------------------------------------------------------------------- migration 0019


def insert_run(cursor: Any, state: str | None, count: int, version: int = 1,
               traceback: str = "") -> int:
    """A run row as migration 0018 left the table (state still a column)."""
    at = timezone.now()
    cursor.execute(
        f"INSERT INTO {RUNS} (agent, queue, priority, scope, fired_seq, input, status, reason,"
        " attempt, requeue_count, max_requeues, claimed_by, available_at, limit_key, fair_key,"
        " snooze_count, input_tokens, output_tokens, cost, checkpoint_state, checkpoint_count,"
        " agent_version, cancel_reason, error_type, error_message, error_traceback, created_at,"
        " wait_key, spawn_key, dedupe_key, steps_copied, release_dedupe_at_start) VALUES"
        " ('tests.noop', 'default', 0, '', 0, '{}', 'queued', '', 0, 0, 3, '', %s, '', '', 0,"
        " 0, 0, 0.0, %s, %s, %s, '', %s, '', %s, %s, '', '', '', %s, %s)",
        [at, state, count, version, "ValueError" if traceback else "", traceback, at, False,
         False])
    cursor.execute(f"SELECT max(id) FROM {RUNS}")
    return int(cursor.fetchone()[0])


@pytest.mark.django_db(transaction=True)
def test_migrations_0019_0020_move_states_and_tracebacks_out_of_the_run_row_and_back(
) -> None:
    call_command("migrate", "django_agentruns", "0018", verbosity=0)
    try:
        with connection.cursor() as cursor:
            fresh = insert_run(cursor, None, 0)
            resumed = insert_run(cursor, '{"step": 2}', 2)
            migrated = insert_run(cursor, '{"v2": true}', 3, 2)  # its history row is older
            at_zero = insert_run(cursor, '{"v2": 0}', 0, 2)  # migrated before a checkpoint
            failed = insert_run(cursor, None, 0, traceback="Traceback: 'quoted' \"and\"\n é")
            table = RunCheckpoint._meta.db_table
            cursor.execute(f"INSERT INTO {table} (run_id, number, state, created_at) VALUES "
                           f"(%s, 1, '{{\"step\": 1}}', %s), (%s, 2, '{{\"step\": 2}}', %s), "
                           f"(%s, 3, '{{\"v1\": true}}', %s)",
                           [resumed, timezone.now(), resumed, timezone.now(), migrated,
                            timezone.now()])
    finally:
        call_command("migrate", "django_agentruns", verbosity=0)
    states = {run.pk: run.checkpoint_state for run in AgentRun.objects.all()}
    assert states == {fresh: None, resumed: {"step": 2}, migrated: {"v2": True},
                      at_zero: {"v2": 0}, failed: None}
    assert {run.pk: run.error_traceback for run in AgentRun.objects.all()} == {
        fresh: "", resumed: "", migrated: "", at_zero: "",
        failed: "Traceback: 'quoted' \"and\"\n é"}
    assert sorted(RunCheckpoint.objects.values_list("run_id", "number", "state")) == sorted([
        (resumed, 1, {"step": 1}), (resumed, 2, {"step": 2}), (migrated, 3, {"v2": True}),
        (at_zero, 0, {"v2": 0})])
    # And back: the column returns with the states.
    call_command("migrate", "django_agentruns", "0018", verbosity=0)
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT id, checkpoint_state, error_traceback FROM {RUNS} "
                           f"ORDER BY id")
            rows = cursor.fetchall()
            back = [(pk, value if value is None or isinstance(value, dict)
                     else json.loads(value)) for pk, value, _ in rows]
    finally:
        call_command("migrate", "django_agentruns", verbosity=0)
    assert back == [(fresh, None), (resumed, {"step": 2}), (migrated, {"v2": True}),
                    (at_zero, {"v2": 0}), (failed, None)]
    assert [text for _, _, text in rows] == ["", "", "", "", "Traceback: 'quoted' \"and\"\n é"]
