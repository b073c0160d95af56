"""The attempt store's one-statement write, prepared (PostgreSQL, `PREPARED_STATEMENTS`):
its generic plan is made once per writer connection, from the tables' sizes then. Made
while the runs and events were few (a new install, a new partition), it must still read
by index once they are many: the writer's connection plans no sequential scan where an index
serves (`runtime.attempt_store._plan_by_index`).

Measured by the plan's own row counts (EXPLAIN ANALYZE), not by time."""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from django_agentruns import RunRequest, enqueue, enqueue_many, transitions
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.runtime import attempt_store
from django_agentruns.transitions import AttemptRef, ScopePolicy, rawsql
from django_agentruns.transitions.alone import _row
from django_agentruns.transitions.attempts import checkpoints_kept
from django_agentruns.transitions.batched import EmitWrite
from tests import helpers

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

WORKER = "plans:1:abcd"
LATER_EVENTS, PER_RUN = 3_000, 10  # other runs' history, written after the plan
EVENTS, RUNS = RunEvent._meta.db_table, AgentRun._meta.db_table


def emit_statement(ref: AttemptRef) -> tuple[str, list[Any]]:
    at = timezone.now()
    write = EmitWrite(ref, uuid.uuid4(), "llm.step", {"tokens": 256})
    return rawsql.fenced_alone([_row(write, at)], Status.RUNNING, at, checkpoints_kept())


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
            attempt_store._plan_by_index()
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        sql, params = emit_statement(ref)
        numbered = iter(range(1, len(params) + 1))
        cursor.execute("PREPARE plans_emit AS " + re.sub(
            r"%%|%s", lambda m: "%" if m[0] == "%%" else f"${next(numbered)}", sql))
        placeholders = ", ".join(["%s"] * len(params))
        cursor.execute(f"EXECUTE plans_emit ({placeholders})", params)  # planned here
        others = [r.pk for r in enqueue_many(
            [RunRequest("tests.noop") for _ in range(LATER_EVENTS // PER_RUN)])]
        RunEvent.objects.bulk_create(
            RunEvent(run_id=other, seq=seq, event_id=uuid.uuid4(), type="llm.step",
                     payload={}, attempt=1) for other in others for seq in range(PER_RUN))
        _, params = emit_statement(ref)
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE plans_emit ({placeholders})",
                       params)
        explained = cursor.fetchone()[0]
        cursor.execute("DEALLOCATE plans_emit")
        transaction.set_rollback(True)  # the SET and the writes with it
    return {table: helpers.plan_rows_read(explained, table) for table in (EVENTS, RUNS)}


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
