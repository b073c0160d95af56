"""Partitioned history (`HISTORY_PARTITION`): partitions made ahead of the id sequence, rows
of every history table routed across a boundary, a span dropped only when every run of it
is purged, dry runs that change nothing; SQLite ignores the setting.

Each PostgreSQL test converts the history tables inside its own transaction (DDL rolls
back in PostgreSQL), so the shared test database keeps its plain tables for the others.
"""

from __future__ import annotations

import importlib
import json
import uuid
from datetime import timedelta
from io import StringIO
from typing import Any

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from django_agentruns import enqueue
from django_agentruns.flow_models import RunUsage
from django_agentruns.models import (
    AgentRun,
    Reason,
    RunCheckpoint,
    RunEvent,
    RunPayload,
    RunStep,
    RunWait,
    Status,
)
from django_agentruns.ops import partitions
from django_agentruns.ops.retention import erase, purge
from django_agentruns.runtime.worker import Worker
from django_agentruns.transitions.events import append_events
from tests import helpers

pytestmark = pytest.mark.django_db
SPAN = 10
OLD = timezone.now() - timedelta(days=40)


@pytest.fixture
def partitioned(settings: Any) -> int:
    """History partitioned in spans of SPAN run ids, from the current sequence on."""
    settings.AGENTRUNS = {"HISTORY_PARTITION": SPAN}
    assert partitions.convert(SPAN) == partitions.history_tables()
    return SPAN


def new_run(status: str = Status.SUCCEEDED, **fields: Any) -> AgentRun:
    fields.setdefault("finished_at", OLD if status in (Status.SUCCEEDED, Status.FAILED) else None)
    return AgentRun.objects.create(agent="tests.noop", queue="default", status=status,
                                   reason=Reason.COMPLETED if status == Status.SUCCEEDED else "",
                                   created_at=OLD, **fields)


def write_history(run: AgentRun) -> None:
    """One row in each history table, as the ORM writes them, plus an event the engine's
    own statement appends (its seq computed in the INSERT)."""
    RunEvent.objects.create(run=run, seq=1, event_id=uuid.uuid4(), type="x", payload={"a": 1})
    append_events([(run.pk, "y", {"b": 2}, 1, uuid.uuid4())], timezone.now())
    RunCheckpoint.objects.create(run=run, number=1, state={"step": 1})
    RunWait.objects.create(run=run, key="k", payload={"ok": True})
    RunStep.objects.create(run=run, name="s", occurrence=1, result={"r": 1})
    RunUsage.objects.create(run=run, attempt=1, seq=1, input_tokens=3)


def spans() -> set[tuple[int, int]]:
    return {(p.lo, p.hi) for p in partitions.partitions()}


def counts(run_id: int) -> list[int]:
    return [m.objects.filter(run_id=run_id).count()
            for m in (RunEvent, RunCheckpoint, RunWait, RunStep, RunUsage)]


@pytest.mark.postgres_only
def test_layout_keys_hold_the_run_id_and_no_foreign_key_touches_history(partitioned: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT conrelid::regclass::text, contype, pg_get_constraintdef(oid) "
                       "FROM pg_constraint WHERE contype IN ('p', 'u', 'f') AND "
                       "(conrelid::regclass::text = ANY(%s) OR confrelid::regclass::text = "
                       "ANY(%s))", [partitions.history_tables()] * 2)
        rows = cursor.fetchall()
    assert rows
    assert not [r for r in rows if r[1] == "f"]
    assert all("run_id" in definition for _, _, definition in rows), rows
    events = {d for t, _, d in rows if t == "django_agentruns_runevent"}
    assert {"PRIMARY KEY (id, run_id)", "UNIQUE (run_id, event_id)",
            "UNIQUE (run_id, seq)"} <= events


@pytest.mark.postgres_only
def test_partitions_are_made_ahead_and_rows_cross_a_boundary(partitioned: int) -> None:
    first = new_run()
    # Made ahead of the sequence already, as it stood at `convert`, the id before `first`
    # (not `first`'s own bound: from an id ending in 9 that one is a span further on).
    target = partitions.target_bound(first.pk - 1, SPAN)
    assert max(hi for _, hi in spans()) == target
    assert partitions.ensure(dry_run=True).created == []
    runs = [first] + [new_run() for _ in range(target - SPAN - 1 - first.pk)]
    # The next id enters the last span: ensure makes one more, and says so first.
    planned = partitions.ensure(dry_run=True).created
    assert len(planned) == len(partitions.history_tables())
    assert max(hi for _, hi in spans()) == target  # the dry run changed nothing
    report = partitions.ensure()
    assert sorted(report.created) == sorted(planned)
    assert max(hi for _, hi in spans()) == target + SPAN
    runs.append(new_run())
    assert runs[-1].pk // SPAN != first.pk // SPAN  # across at least one boundary
    for run in runs:
        write_history(run)
    for run in runs:
        assert counts(run.pk) == [2, 1, 1, 1, 1]
        assert list(RunEvent.objects.filter(run=run).values_list("seq", flat=True)) == [1, 2]
    # Each row sits in the partition of its run's span.
    with connection.cursor() as cursor:
        cursor.execute("SELECT tableoid::regclass::text, run_id FROM django_agentruns_runevent")
        for table, run_id in cursor.fetchall():
            assert table == f"django_agentruns_runevent_p{run_id // SPAN * SPAN}"


@pytest.mark.postgres_only
def test_an_enqueue_near_the_partitions_top_makes_the_next_ones(
        partitioned: int, django_capture_on_commit_callbacks: Any) -> None:
    """A run's input is a payload row in its span's partition: enqueues that come within
    half a span of the top make more (after their transaction commits), as a worker's
    chores would, so enqueueing with no worker running never runs out of partitions."""
    top = max(hi for _, hi in spans())
    runs = []
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        while not runs or runs[-1].pk < top - SPAN // 2:
            runs.append(enqueue("tests.noop", {"n": len(runs)}))
    assert callbacks  # the last enqueues asked for partitions once committed
    assert max(hi for _, hi in spans()) > top
    with django_capture_on_commit_callbacks(execute=True):
        while runs[-1].pk < top + 2:  # past the old top: into the partitions just made
            runs.append(enqueue("tests.noop", {"n": len(runs)}))
    assert [AgentRun.objects.get(pk=run.pk).input for run in runs] == \
        [{"n": n} for n in range(len(runs))]
    with connection.cursor() as cursor:
        cursor.execute("SELECT tableoid::regclass::text, run_id FROM django_agentruns_runpayload "
                       "WHERE kind = 'input'")
        for table, run_id in cursor.fetchall():
            assert table == f"django_agentruns_runpayload_p{run_id // SPAN * SPAN}"


@pytest.mark.postgres_only
def test_purge_drops_a_span_only_when_every_run_of_it_is_purged(partitioned: int) -> None:
    # Fill the current span and the next one, so both are old (the sequence passed them).
    first = new_run()
    lo = first.pk // SPAN * SPAN
    runs = [first] + [new_run() for _ in range(lo + 2 * SPAN - first.pk - 1)]
    partitions.ensure()
    for run in runs:
        write_history(run)
    new_run(Status.QUEUED)  # the sequence is past both spans now
    waiting = next(r for r in runs if r.pk >= lo + SPAN)
    AgentRun.objects.filter(pk=waiting.pk).update(status=Status.WAITING, finished_at=None,
                                                  reason="")
    before = spans()
    dry = purge(timedelta(days=30), dry_run=True)
    assert dry.partitions == [partitions.partition_name(t, lo)
                              for t in sorted(partitions.history_tables())]
    assert spans() == before
    assert AgentRun.objects.filter(pk=first.pk).exists()

    report = purge(timedelta(days=30))
    assert report.runs == len(runs) - 1
    assert sorted(report.partitions or []) == sorted(dry.partitions)
    assert (lo, lo + SPAN) not in spans()
    assert (lo + SPAN, lo + 2 * SPAN) in spans()  # the waiting run keeps its span
    assert counts(waiting.pk) == [2, 1, 1, 1, 1]
    # A purged run of the kept span: its rows stay, unread, until the span goes.
    gone = next(r for r in runs if r.pk >= lo + SPAN and r.pk != waiting.pk)
    assert not AgentRun.objects.filter(pk=gone.pk).exists()
    assert RunEvent.objects.filter(run_id=gone.pk).count() == 2

    AgentRun.objects.filter(pk=waiting.pk).update(status=Status.SUCCEEDED, finished_at=OLD)
    purge(timedelta(days=30))
    assert (lo + SPAN, lo + 2 * SPAN) not in spans()
    assert not RunEvent.objects.filter(run_id=gone.pk).exists()


@pytest.mark.postgres_only
def test_drop_waits_for_the_sequence_to_pass_the_span(partitioned: int) -> None:
    run = new_run()
    write_history(run)
    AgentRun.objects.filter(pk=run.pk).delete()  # empty, but ids of its span are to come
    assert partitions.drop().dropped == []


@pytest.mark.postgres_only
def test_commands_dry_run_print_and_change_nothing(partitioned: int) -> None:
    first = new_run()
    for _ in range(partitions.target_bound(first.pk, SPAN) - SPAN - 1 - first.pk):
        new_run()
    before = spans()
    out = StringIO()
    call_command("partitions", "ensure", "--dry-run", stdout=out)
    assert f"would create {len(partitions.history_tables())} partition(s)" in out.getvalue()
    out = StringIO()
    call_command("partitions", "drop", "--dry-run", stdout=out)
    assert "would drop" in out.getvalue()
    assert spans() == before
    out = StringIO()
    call_command("partitions", "convert", "--dry-run", stdout=out)
    assert "partitioned already" in out.getvalue()


@pytest.mark.postgres_only
def test_convert_moves_existing_history_and_its_dry_run_estimates(settings: Any) -> None:
    runs = [new_run() for _ in range(3)]
    for run in runs:
        write_history(run)
    settings.AGENTRUNS = {"HISTORY_PARTITION": SPAN}
    out = StringIO()
    call_command("partitions", "convert", "--dry-run", stdout=out)
    assert "django_agentruns_runevent: 6 rows" in out.getvalue()
    assert "s locked" in out.getvalue()
    assert partitions.partitioned_tables() == set()
    call_command("partitions", "convert", stdout=StringIO())
    assert partitions.partitioned_tables() == set(partitions.history_tables())
    for run in runs:
        assert counts(run.pk) == [2, 1, 1, 1, 1]
    later = RunEvent.objects.create(run=runs[0], seq=3, event_id=uuid.uuid4(), type="z")
    assert later.pk > max(RunEvent.objects.exclude(pk=later.pk).values_list("pk", flat=True))


@pytest.mark.postgres_only
def test_the_migration_partitions_empty_tables_when_the_setting_is_on(settings: Any) -> None:
    migration = importlib.import_module(
        "django_agentruns.migrations.0018_partitioned_history")
    RunEvent.objects.create(run=new_run(), seq=1, event_id=uuid.uuid4(), type="x")
    settings.AGENTRUNS = {"HISTORY_PARTITION": SPAN}

    class Editor:
        pass

    editor = Editor()
    editor.connection = connection  # type: ignore[attr-defined]
    migration.partition_history(None, editor)
    # Events hold a row: left plain for `partitions convert`; the empty tables are done
    # (those 0018 knows: 0020 partitions the payload table, see the next test).
    assert partitions.partitioned_tables() == set(migration.HISTORY_TABLES) - {
        "django_agentruns_runevent"}


@pytest.mark.postgres_only
def test_migration_0020_partitions_the_payloads_with_the_history(settings: Any) -> None:
    """0020 on an install whose history 0018 partitioned: the payload table is partitioned
    too, with a partition for the span of an old run whose traceback moves in (DDL in the
    test's transaction, rolled back with it)."""
    old = new_run(status=Status.FAILED)
    settings.AGENTRUNS = {"HISTORY_PARTITION": SPAN}
    editor = type("Editor", (), {"connection": connection})()
    importlib.import_module("django_agentruns.migrations.0018_partitioned_history") \
        .partition_history(None, editor)
    runs, payloads = AgentRun._meta.db_table, RunPayload._meta.db_table
    with connection.cursor() as cursor:  # the column 0020 moves out, as 0019 left it
        cursor.execute(f"ALTER TABLE {runs} ADD COLUMN error_traceback text NOT NULL DEFAULT ''")
        cursor.execute(f"UPDATE {runs} SET error_traceback = 'boom', error_type = 'E' "
                       f"WHERE id = %s", [old.pk])
        cursor.execute(f"SELECT setval(pg_get_serial_sequence('{runs}', 'id'), %s)",
                       [old.pk + 5 * SPAN])  # the old run's span is not made ahead
    migration = importlib.import_module("django_agentruns.migrations.0020_payload_traceback")
    migration.partition_payloads(None, editor)
    migration.move_out(None, editor)
    assert payloads in partitions.partitioned_tables()
    assert partitions.partition_name(payloads, old.pk // SPAN * SPAN) in {
        p.name for p in partitions.partitions([payloads])}
    assert AgentRun.objects.get(pk=old.pk).error_traceback == "boom"


@pytest.mark.sqlite_only
def test_sqlite_ignores_the_setting(settings: Any) -> None:
    settings.AGENTRUNS = {"HISTORY_PARTITION": SPAN}
    assert partitions.span() is None
    assert partitions.ensure().created == []
    assert partitions.drop().dropped == []
    run = new_run()
    write_history(run)
    assert counts(run.pk) == [2, 1, 1, 1, 1]
    with pytest.raises(CommandError, match="not partitioned"):
        call_command("partitions", "ensure")
    report = purge(timedelta(days=30))
    assert report.runs == 1
    assert report.partitions is None
    assert counts(run.pk) == [0, 0, 0, 0, 0]


@pytest.mark.postgres_only
def test_erase_deletes_a_runs_partitioned_history_now(partitioned: int) -> None:
    run, other = new_run(), new_run()
    write_history(run)
    write_history(other)
    report = erase(run.pk, by="dpo")
    assert report.rows["runevent"] == 2
    assert counts(run.pk) == [0, 0, 0, 0, 0]
    assert counts(other.pk) == [2, 1, 1, 1, 1]


def fill_to_the_last_span() -> None:
    """Runs until the next id enters the last partition: `ensure` then has work."""
    first = new_run()
    for _ in range(partitions.target_bound(first.pk, SPAN) - SPAN - 1 - first.pk):
        new_run()


@pytest.mark.postgres_only
def test_a_worker_makes_the_partitions_itself(partitioned: int) -> None:
    fill_to_the_last_span()
    top = max(hi for _, hi in spans())
    worker = Worker(burst=True, reap_interval=0)
    worker.chores.ensure_partitions()
    assert max(hi for _, hi in spans()) == top + SPAN
    fill_to_the_last_span()
    worker.chores.ensure_partitions()  # looked less than ENSURE_INTERVAL ago: not again
    assert max(hi for _, hi in spans()) == top + SPAN


@pytest.mark.postgres_only
def test_ensure_skips_while_another_process_holds_its_lock(partitioned: int) -> None:
    fill_to_the_last_span()
    before = spans()
    other = psycopg.connect(helpers.database_url(connection.settings_dict), autocommit=True)
    try:
        other.execute("SELECT pg_advisory_lock(%s)", [partitions.ENSURE_LOCK])
        report = partitions.ensure()
        assert report.busy
        assert report.created == []
        assert spans() == before
        # Released here, not by closing: the server ends a closed session (and frees its
        # locks) a moment after the client returns, so the next ensure could still find
        # the lock held (seen in CI).
        other.execute("SELECT pg_advisory_unlock(%s)", [partitions.ENSURE_LOCK])
    finally:
        other.close()
    assert len(partitions.ensure().created) == len(partitions.history_tables())


@pytest.mark.postgres_only
@pytest.mark.slow
def test_a_fresh_install_is_partitioned_and_a_real_worker_writes_across_a_boundary(
        db: None) -> None:
    """Migration 0018 on a new database with the setting on, then a worker process: it
    makes the partitions the next runs need itself, and their history lands in them."""
    url = helpers.database_url(connection.settings_dict)
    server, name = url.rsplit("/", 1)[0], f"{connection.settings_dict['NAME']}_fresh_parts"
    with psycopg.connect(f"{server}/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    env = {**helpers.subprocess_env(connection.settings_dict), "DATABASE_URL": f"{server}/{name}",
           "AGENTRUNS_TEST_SETTINGS": json.dumps({"HISTORY_PARTITION": 1000})}
    try:
        done = helpers.run_manage(["migrate", "-v", "0"], env, timeout=120)
        assert done.returncode == 0, done.stderr
        with psycopg.connect(f"{server}/{name}", autocommit=True) as fresh:
            parts = fresh.execute("SELECT count(*) FROM pg_partitioned_table").fetchone()
            assert parts == (len(partitions.history_tables()),)
            keys = fresh.execute("SELECT conrelid::regclass::text FROM pg_constraint WHERE "
                                 "contype = 'f' AND confrelid = "
                                 "'django_agentruns_agentrun'::regclass").fetchall()
            assert not {t for (t,) in keys} & set(partitions.history_tables())  # 0020 left one
            # The next runs' ids straddle 2000, past the partitions migrate made ([0, 2000)).
            fresh.execute("SELECT setval(pg_get_serial_sequence('django_agentruns_agentrun', "
                          "'id'), 1995)")
        # No worker has run: the enqueues themselves make the partitions their inputs'
        # payload rows need (a run's input is a row in its span's partition).
        enq = helpers.run_manage(["shell", "-c", "from django_agentruns import enqueue; "
                                  "[enqueue('tests.steps', {'steps': 2}) for _ in range(10)]"],
                                 env)
        assert enq.returncode == 0, enq.stderr
        with psycopg.connect(f"{server}/{name}", autocommit=True) as fresh:
            # The sequence jumps past every partition made: the enqueue's INSERT finds
            # none for its input, makes them and inserts again.
            top = fresh.execute("SELECT max(substring(relname FROM '_p([0-9]+)$')::bigint) "
                                "FROM pg_class WHERE relname ~ "
                                "'^django_agentruns_runpayload_p[0-9]+$'").fetchone()
            fresh.execute("SELECT setval(pg_get_serial_sequence('django_agentruns_agentrun', "
                          "'id'), %s)", [top[0] + 1500])
        enq = helpers.run_manage(["shell", "-c", "from django_agentruns import enqueue; "
                                  "enqueue('tests.steps', {'steps': 2})"], env)
        assert enq.returncode == 0, enq.stderr
        work = helpers.run_manage(["runworker", "--burst"], env, timeout=120)
        assert work.returncode == 0, work.stderr
        with psycopg.connect(f"{server}/{name}", autocommit=True) as fresh:
            statuses = fresh.execute("SELECT status, count(*) FROM django_agentruns_agentrun "
                                     "GROUP BY status").fetchall()
            assert statuses == [("succeeded", 11)]
            rows = fresh.execute("SELECT tableoid::regclass::text, run_id FROM "
                                 "django_agentruns_runevent").fetchall()
            runs = {run_id for _, run_id in rows}
            assert (len(runs), min(runs)) == (11, 1996)
            assert len({run_id for run_id in runs if run_id < 2010}) == 10  # across 2000
            assert max(runs) > top[0] + 1500  # past every partition there was
            inputs = fresh.execute("SELECT tableoid::regclass::text, run_id FROM "
                                   "django_agentruns_runpayload WHERE kind = 'input'").fetchall()
            assert {run_id for _, run_id in inputs} == runs
            for table, run_id in inputs:
                assert table == f"django_agentruns_runpayload_p{run_id // 1000 * 1000}"
            for table, run_id in rows:
                assert table == f"django_agentruns_runevent_p{run_id // 1000 * 1000}"
            checkpoints = fresh.execute("SELECT count(DISTINCT run_id) FROM "
                                        "django_agentruns_runcheckpoint").fetchone()
            assert checkpoints == (11,)
    finally:
        with psycopg.connect(f"{server}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
