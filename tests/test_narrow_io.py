"""Issue #29's narrow hot row, its last part: a run's input and output are not columns of
the run row but `RunPayload` rows (kinds input and output), which `AgentRun.input` and
`.output` read through. Enqueue writes the input with the run (on PostgreSQL in the same
INSERT statement), the claim statement returns each claimed run's input, a success's
statement writes its output; the default input ({}) and a None output are no row.
Migration 0021 moves existing values out, and back."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_agentruns import enqueue, enqueue_many, fork, transitions
from django_agentruns.api import RunRequest
from django_agentruns.models import AgentRun, RunPayload, Status
from django_agentruns.outcomes import AttemptRef, Settlement
from django_agentruns.registry import scope_policy

pytestmark = pytest.mark.usefixtures("history_layout")
RUNS = AgentRun._meta.db_table
PAYLOADS = RunPayload._meta.db_table


def payloads(run_id: int, kind: str) -> list[Any]:
    return list(RunPayload.objects.filter(run_id=run_id, kind=kind).order_by("id")
                .values_list("value", flat=True))


def claim(limit: int = 1, worker: str = "w-io", later: float = 0) -> list[AgentRun]:
    return transitions.claim(worker, ["default"], limit, scope_policy(), {}, 30.0,
                             timezone.now() + timedelta(seconds=later), include_lapsed=False)


def test_the_run_table_has_no_input_or_output_column(db: None) -> None:
    with connection.cursor() as cursor:
        columns = {c.name for c in connection.introspection.get_table_description(cursor, RUNS)}
    assert {"status", "lease_expires", "attempt", "dedupe_key"} <= columns
    assert not {"input", "output"} & columns


def test_enqueue_writes_the_input_as_a_payload_and_the_default_as_none(
        db: None, django_assert_num_queries: Any) -> None:
    given = {"question": "why?", "n": [1, 2.5, None], "é": "ü"}
    enqueue("tests.noop")  # a process reads the partitions' top once (partitioned history)
    with CaptureQueriesContext(connection) as queries:
        run = enqueue("tests.noop", given)
    if connection.vendor == "postgresql":  # the run and its input: one statement
        assert len(queries.captured_queries) == 1, queries.captured_queries
    assert payloads(run.pk, "input") == [given]
    with django_assert_num_queries(0):
        assert run.input == given  # the returned run knows it
    fresh = AgentRun.objects.get(pk=run.pk)
    with django_assert_num_queries(1):
        assert fresh.input == given
        assert fresh.input == given  # kept on the instance
    with CaptureQueriesContext(connection) as queries:
        empty = enqueue("tests.noop")
    if connection.vendor == "postgresql":  # no input to write: the INSERT alone
        assert len(queries.captured_queries) == 1, queries.captured_queries
        assert "runpayload" not in queries.captured_queries[0]["sql"]
    assert payloads(empty.pk, "input") == []
    assert AgentRun.objects.get(pk=empty.pk).input == {}


def test_a_deduplicated_enqueue_writes_no_input(db: None) -> None:
    first = enqueue("tests.noop", {"n": 1}, dedupe_key="k")
    again = enqueue("tests.noop", {"n": 2}, dedupe_key="k")
    assert again.deduplicated
    assert again.pk == first.pk
    assert payloads(first.pk, "input") == [{"n": 1}]
    assert again.input == {"n": 1}
    runs = enqueue_many([RunRequest("tests.noop", {"i": i}) for i in range(5)]
                        + [RunRequest("tests.noop", {"n": 3}, dedupe_key="k")])
    assert [AgentRun.objects.get(pk=r.pk).input for r in runs] == \
        [{"i": i} for i in range(5)] + [{"n": 1}]
    assert RunPayload.objects.filter(kind="input").count() == 6


def test_the_claim_returns_each_runs_input(db: None, django_assert_num_queries: Any) -> None:
    runs = enqueue_many([RunRequest("tests.noop", {"i": i}) for i in range(3)]
                        + [RunRequest("tests.noop")])
    claimed = claim(4)
    assert len(claimed) == 4
    if connection.vendor == "postgresql":  # in the claim statement: nothing more to read
        with django_assert_num_queries(0):
            assert [r.input for r in claimed] == [{"i": 0}, {"i": 1}, {"i": 2}, {}]
    else:
        from django_agentruns.payloads import load_inputs

        with django_assert_num_queries(1):  # the worker's one read for the claim
            load_inputs(claimed)
            assert [r.input for r in claimed] == [{"i": 0}, {"i": 1}, {"i": 2}, {}]
    assert [r.pk for r in claimed] == [r.pk for r in runs]


def test_a_success_writes_its_output_in_its_statement(db: None) -> None:
    enqueue_many([RunRequest("tests.noop", {"i": i}) for i in range(3)])
    claimed = claim(3)
    refs = [AttemptRef(r.pk, r.attempt, "w-io", 30.0) for r in claimed]
    outputs = [{"answer": "x" * 3000}, None, [1, "two"]]
    with CaptureQueriesContext(connection) as queries:
        settled = transitions.settle_succeeded_many("w-io", list(zip(refs, outputs,
                                                                    strict=True)))
    assert set(settled.values()) == {Settlement.SUCCEEDED}
    sets = [q["sql"].split(" SET ", 1)[1].split(" FROM ", 1)[0]
            for q in queries.captured_queries if f'UPDATE "{RUNS}" SET' in q["sql"]]
    assert sets
    assert not any("output" in columns for columns in sets), sets
    for ref, output in zip(refs, outputs, strict=True):
        assert payloads(ref.run_id, "output") == ([] if output is None else [output])
        assert AgentRun.objects.get(pk=ref.run_id).output == output


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_outside_a_transaction_a_success_and_its_output_are_one_statement() -> None:
    enqueue_many([RunRequest("tests.noop", {"i": i}) for i in range(2)])
    refs = [AttemptRef(r.pk, r.attempt, "w-io", 30.0) for r in claim(2)]
    with CaptureQueriesContext(connection) as queries:
        transitions.settle_succeeded_many("w-io", [(refs[0], {"o": 0}), (refs[1], None)])
    assert len(queries.captured_queries) == 1, queries.captured_queries
    assert [AgentRun.objects.get(pk=ref.run_id).output for ref in refs] == [{"o": 0}, None]
    assert payloads(refs[1].run_id, "output") == []


def test_an_unfinished_run_reads_no_output(db: None, django_assert_num_queries: Any) -> None:
    run = enqueue("tests.noop", {"a": 1})
    fresh = AgentRun.objects.get(pk=run.pk)
    with django_assert_num_queries(0):
        assert fresh.output is None


def test_settle_and_claim_writes_outputs_and_returns_inputs(db: None) -> None:
    enqueue_many([RunRequest("tests.noop", {"i": i}) for i in range(4)])
    first = claim(2)
    refs = [AttemptRef(r.pk, r.attempt, "w-io", 30.0, agent=r.agent) for r in first]
    settled, claimed = transitions.settle_and_claim(
        "w-io", [(refs[0], {"done": 0}), (refs[1], None)], ["default"], 2, scope_policy(),
        {}, 30.0, include_lapsed=False)
    assert set(settled.values()) == {Settlement.SUCCEEDED}
    assert [r.input for r in claimed] == [{"i": 2}, {"i": 3}]
    assert AgentRun.objects.get(pk=refs[0].run_id).output == {"done": 0}
    assert payloads(refs[1].run_id, "output") == []


def test_debounce_appends_the_newer_input(db: None) -> None:
    first = enqueue("tests.noop", {"v": 1}, dedupe_key="d", debounce=60)
    second = enqueue("tests.noop", {}, dedupe_key="d", debounce=60)
    assert second.debounced
    assert second.pk == first.pk
    assert second.input == {}
    assert payloads(first.pk, "input") == [{"v": 1}, {}]
    assert AgentRun.objects.get(pk=first.pk).input == {}  # the latest row wins
    [run] = claim(later=120)
    assert run.input == {}


def test_a_fork_keeps_or_replaces_the_input(db: None) -> None:
    origin = enqueue("tests.noop", {"v": 1})
    same = fork(origin.pk)
    other = fork(origin.pk, input={"v": 2})
    assert AgentRun.objects.get(pk=same.pk).input == {"v": 1}
    assert AgentRun.objects.get(pk=other.pk).input == {"v": 2}
    assert payloads(origin.pk, "input") == [{"v": 1}]


def test_an_input_set_on_an_instance_is_saved_with_it(db: None) -> None:
    run = AgentRun(agent="tests.noop", queue="default")
    run.input = {"set": True}
    run.save()
    assert payloads(run.pk, "input") == [{"set": True}]
    run.input = {"set": False}
    run.status, run.output = Status.SUCCEEDED, {"out": 1}
    run.save()
    fresh = AgentRun.objects.get(pk=run.pk)
    assert (fresh.input, fresh.output) == ({"set": False}, {"out": 1})
    made = AgentRun.objects.create(agent="tests.noop", queue="default", input={"c": 1})
    assert AgentRun.objects.get(pk=made.pk).input == {"c": 1}
    run.refresh_from_db()
    assert run.input == {"set": False}


def test_run_now_runs_with_its_input_and_keeps_its_output(db: None) -> None:
    run = enqueue("tests.noop", {"hello": "world"})
    from django_agentruns import run_now

    assert run_now("tests.noop", {"x": 1}) == {"ok": True, "input": {"x": 1}}
    done = AgentRun.objects.exclude(pk=run.pk).get()
    assert (done.input, done.output) == ({"x": 1}, {"ok": True, "input": {"x": 1}})


# --------------------------------------------------------------------------- migration 0021


def insert_run(cursor: Any, input_json: str, output_json: str | None) -> int:
    """A run row as migration 0020 left the table (input and output still columns)."""
    at = timezone.now()
    cursor.execute(
        f"INSERT INTO {RUNS} (agent, queue, priority, scope, fired_seq, input, output, status,"
        " reason, attempt, requeue_count, max_requeues, claimed_by, available_at, limit_key,"
        " fair_key, snooze_count, input_tokens, output_tokens, cost, checkpoint_count,"
        " agent_version, cancel_reason, error_type, error_message, created_at, finished_at,"
        " wait_key, spawn_key, dedupe_key, steps_copied, release_dedupe_at_start) VALUES"
        " ('tests.noop', 'default', 0, '', 0, %s, %s, 'succeeded', '', 1, 0, 3, '', %s, '',"
        " '', 0, 0, 0, 0.0, 0, 1, '', '', '', %s, %s, '', '', '', %s, %s)",
        [input_json, output_json, at, at, at, False, False])
    cursor.execute(f"SELECT max(id) FROM {RUNS}")
    return int(cursor.fetchone()[0])


@pytest.mark.django_db(transaction=True)
def test_migration_0021_moves_inputs_and_outputs_out_and_back(history_layout: str) -> None:
    call_command("migrate", "django_agentruns", "0020", verbosity=0)
    try:
        with connection.cursor() as cursor:
            plain = insert_run(cursor, "{}", None)
            given = insert_run(cursor, '{"q": "it\'s \\"quoted\\" \\u00e9"}', '{"a": [1, 2]}')
            null_out = insert_run(cursor, '[1, 2]', "null")
            scalar = insert_run(cursor, '"text"', '"answer"')
    finally:
        call_command("migrate", "django_agentruns", verbosity=0)
    runs = {r.pk: (r.input, r.output) for r in AgentRun.objects.all()}
    assert runs == {plain: ({}, None), given: ({"q": "it's \"quoted\" é"}, {"a": [1, 2]}),
                    null_out: ([1, 2], None), scalar: ("text", "answer")}
    assert sorted(RunPayload.objects.values_list("run_id", "kind")) == sorted([
        (given, "input"), (given, "output"), (null_out, "input"), (scalar, "input"),
        (scalar, "output")])
    call_command("migrate", "django_agentruns", "0020", verbosity=0)
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT id, input, output FROM {RUNS} ORDER BY id")
            back = [(pk, *(v if v is None or not isinstance(v, str) else json.loads(v)
                           for v in values)) for pk, *values in cursor.fetchall()]
            cursor.execute(f"SELECT count(*) FROM {PAYLOADS}")
            left = cursor.fetchone()[0]
    finally:
        call_command("migrate", "django_agentruns", verbosity=0)
    assert back == [(plain, {}, None), (given, {"q": "it's \"quoted\" é"}, {"a": [1, 2]}),
                    (null_out, [1, 2], None), (scalar, "text", "answer")]
    assert left == 0
    assert {r.pk: (r.input, r.output) for r in AgentRun.objects.all()} == runs


@pytest.mark.postgres_only
@pytest.mark.parametrize("history_layout", ["plain"], indirect=True)  # builds its own
def test_migration_0021_moves_values_into_a_partitioned_payload_table(
        db: None, history_layout: str, settings: Any) -> None:
    """0021 on an install whose history 0018 and 0020 partitioned: an old run's values
    move into a partition made for its span (DDL in the test's transaction, rolled back
    with it). From the plain layout only: it partitions the tables itself."""
    import importlib

    from django_agentruns.ops import partitions

    span = 10
    old = enqueue("tests.noop")
    settings.AGENTRUNS = {"HISTORY_PARTITION": span}
    editor = type("Editor", (), {"connection": connection})()
    importlib.import_module("django_agentruns.migrations.0018_partitioned_history") \
        .partition_history(None, editor)
    with connection.cursor() as cursor:  # 0020 reads the column it moved out
        cursor.execute(f"ALTER TABLE {RUNS} ADD COLUMN error_traceback text NOT NULL "
                       f"DEFAULT ''")
    importlib.import_module("django_agentruns.migrations.0020_payload_traceback") \
        .partition_payloads(None, editor)
    with connection.cursor() as cursor:  # the columns 0021 moves out, as 0020 left them
        cursor.execute(f"ALTER TABLE {RUNS} DROP COLUMN error_traceback")
        cursor.execute(f"ALTER TABLE {RUNS} ADD COLUMN input jsonb NOT NULL DEFAULT '{{}}', "
                       f"ADD COLUMN output jsonb NULL")
        cursor.execute(f"UPDATE {RUNS} SET input = '{{\"q\": 1}}', output = '[2]', "
                       f"status = 'succeeded' WHERE id = %s", [old.pk])
        cursor.execute(f"SELECT setval(pg_get_serial_sequence('{RUNS}', 'id'), %s)",
                       [old.pk + 5 * span])  # the old run's span is not made ahead
        cursor.execute(f"DROP TABLE IF EXISTS "
                       f"{partitions.partition_name(PAYLOADS, old.pk // span * span)}")
    migration = importlib.import_module("django_agentruns.migrations.0021_narrow_input_output")
    migration.partition_spans(None, editor)
    migration.move_out(None, editor)
    assert PAYLOADS in partitions.partitioned_tables()
    assert partitions.partition_name(PAYLOADS, old.pk // span * span) in {
        p.name for p in partitions.partitions([PAYLOADS])}
    run = AgentRun.objects.get(pk=old.pk)
    assert (run.input, run.output) == ({"q": 1}, [2])
