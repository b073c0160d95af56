"""What each history write costs the database: one index probe per event for the stored-id
check whatever the statistics say, and no index the run's own unique key already serves."""

from __future__ import annotations

import uuid

import pytest
from django.apps import apps
from django.db import connection
from django.utils import timezone

from django_agentruns.models import AgentRun, RunEvent
from django_agentruns.transitions import rawsql

# Every history table whose rows are found by run, with the unique key or index that leads
# with the run and serves those reads (migration 0025 dropped Django's index beside it).
LEADING_WITH_RUN = {
    "runevent": "agentruns_event_run_seq",
    "runcheckpoint": "agentruns_checkpoint_number",
    "runstep": "agentruns_step_occurrence",
    "runusage": "agentruns_usage_key",
    "runwait": "agentruns_wait_run_key",
    "streamchunk": "agentruns_chunk_run",
    "keywindowentry": "agentruns_window_run",
}


def _insert(run: AgentRun, events: list[tuple[str, uuid.UUID]]) -> set[uuid.UUID]:
    sql, params = rawsql.insert_new_events(
        [(run.pk, type_, {"n": n}, 1, event_id) for n, (type_, event_id) in enumerate(events)],
        timezone.now())
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {uuid.UUID(str(row[1])) for row in cursor.fetchall()}


@pytest.mark.django_db
def test_a_batch_adds_only_the_events_not_stored_and_numbers_them_after_the_last() -> None:
    run = AgentRun.objects.create(agent="tests.noop")
    first, second, third = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    assert _insert(run, [("a", first), ("b", second)]) == {first, second}
    # A retry re-emits `second` as the last of a new batch: only `third` is added.
    assert _insert(run, [("c", third), ("b", second)]) == {third}
    stored = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", "type"))
    assert stored == [(1, "a"), (2, "b"), (3, "c")]


@pytest.mark.postgres_only
@pytest.mark.django_db
def test_the_stored_id_check_probes_an_index_on_a_table_its_statistics_call_empty() -> None:
    """Statistics taken while the events table was empty, then thousands of events (a new
    deployment's first minutes, before autovacuum analyzes): as `NOT EXISTS`, the check
    became a hash anti-join that read the whole table for every batch the writers sent."""
    table = RunEvent._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table}")
    runs = AgentRun.objects.bulk_create([AgentRun(agent="tests.noop") for _ in range(300)])
    RunEvent.objects.bulk_create([RunEvent(run=run, seq=n, event_id=uuid.uuid4(), type="x",
                                           payload={"pad": "p" * 20})
                                  for run in runs for n in range(1, 11)])
    sql, params = rawsql.insert_new_events(
        [(run.pk, "y", {}, 1, uuid.uuid4()) for run in runs[:20]], timezone.now(), [None] * 20)
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (COSTS OFF) " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Anti Join" not in plan, plan
    assert f"Seq Scan on {table}" not in plan, plan


@pytest.mark.django_db
def test_history_tables_keep_no_index_on_the_run_alone() -> None:
    """Migration 0025: each table's reads by run use its key that leads with the run; an
    index on the run alone cost every event, checkpoint and step one more insert."""
    for model_name, leading in LEADING_WITH_RUN.items():
        model = apps.get_model("django_agentruns", model_name)
        with connection.cursor() as cursor:
            constraints = connection.introspection.get_constraints(
                cursor, model._meta.db_table)
        indexes = {name: c["columns"] for name, c in constraints.items()
                   if c["index"] or c["unique"]}
        assert indexes[leading][0] == "run_id", model_name
        assert ["run_id"] not in indexes.values(), (model_name, indexes)
