"""Small holes, each a clear error (guarantee 10): what would otherwise be
stored altered, refused by the database as a raw error, or accepted and then unusable."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client, override_settings

from django_agentruns import (
    InvalidInputError,
    RunContext,
    RunRequest,
    agent,
    enqueue,
    enqueue_many,
    run_now,
)
from django_agentruns import checks as agentruns_checks
from django_agentruns.api import LATEST_RUN_AFTER
from django_agentruns.management.arguments import queue_list
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.ops.retention import purge
from django_agentruns.registry import unregister
from django_agentruns.runtime.worker import Worker
from django_agentruns.transitions import enqueue as enqueue_sql
from tests.test_admin import run_url
from tests.test_commands import no_worker  # noqa: F401 (a fixture)

EMIT_TYPE = "tests.bad_input.emit"
INT_KEY = "tests.bad_input.int_key"


@pytest.fixture(autouse=True, scope="module")
def emitting_agent() -> Iterator[None]:
    """Emits an event of the type its input spells in code points (input cannot hold NUL)."""

    @agent(EMIT_TYPE)
    def emit(ctx: RunContext) -> None:
        ctx.emit("".join(chr(c) for c in ctx.input["type"]))

    @agent(INT_KEY)
    def int_key(ctx: RunContext) -> dict[int, str]:
        return {1: "a", 2: "b"}

    yield
    unregister(EMIT_TYPE)
    unregister(INT_KEY)


# --------------------------------------------------------------------------- JSON keys


@pytest.mark.django_db
@pytest.mark.parametrize("value", [{1: "a", "1": "b"}, {"a": [{"b": {2.5: 1}}]},
                                   {None: 1}, [{True: "x"}], ({"ok": {0: 0}},)],
                         ids=["int-beside-str", "nested-float", "none", "bool-in-list",
                              "in-tuple"])
def test_a_non_string_key_is_refused_not_silently_merged(value: Any) -> None:
    with pytest.raises(InvalidInputError, match=r"the key .* is not a string"):
        enqueue("tests.noop", value)
    with pytest.raises(InvalidInputError, match="is not a string"):
        enqueue_many([RunRequest("tests.noop", {"fine": 1}), RunRequest("tests.noop", value)])
    assert not AgentRun.objects.exists()


@pytest.mark.django_db
def test_string_keys_that_look_like_numbers_are_kept() -> None:
    value = {"1": "b", "x": [{"2": None}], "{": "}"}
    assert AgentRun.objects.get(pk=enqueue("tests.noop", value).pk).input == value


@pytest.mark.django_db
def test_an_output_with_a_non_string_key_is_a_clear_failure() -> None:
    with pytest.raises(InvalidInputError, match=f"Output of agent '{INT_KEY}' cannot be "
                                                "stored: the key 1 is not a string"):
        run_now(INT_KEY)
    run = AgentRun.objects.get(agent=INT_KEY)
    assert (run.status, run.output) == (Status.FAILED, None)


# --------------------------------------------------------------------------- event types


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["a\x00b", "\ud800", "x" * 101, ""],
                         ids=["nul", "surrogate", "too-long", "empty"])
def test_an_event_type_the_database_cannot_store_is_a_clear_error(name: str) -> None:
    with pytest.raises(InvalidInputError, match="Event type must be a string of 1-100 "
                                                "characters with no NUL or surrogate"):
        run_now(EMIT_TYPE, {"type": [ord(c) for c in name]})
    run = AgentRun.objects.get(agent=EMIT_TYPE)
    assert (run.status, run.error_type) == (Status.FAILED,
                                            "django_agentruns.exceptions.InvalidInputError")
    assert list(RunEvent.objects.filter(run=run).values_list("type", flat=True)) == [
        "run.started", "run.dead_lettered"]


# --------------------------------------------------------------------------- queue names

QUEUE_NAMES = ["default", "q-1.a:b_c", "q" * 100, "x,y", " q ", "q ", "", "q" * 101, "a b",
               "é", "q\x00", "tab\t"]


@pytest.mark.django_db
@pytest.mark.parametrize("name", QUEUE_NAMES)
def test_enqueue_takes_exactly_the_queue_names_a_worker_can_serve(name: str) -> None:
    try:
        served = queue_list(name) == [name]
    except argparse.ArgumentTypeError:
        served = False
    refused = ""
    try:
        enqueue("tests.noop", queue=name)
    except InvalidInputError as exc:
        refused = str(exc)
    accepted = not refused
    assert accepted or "queue must be 1-100 characters of letters, digits and _ . : -" in refused
    assert accepted is served
    assert accepted is (name in ("default", "q-1.a:b_c", "q" * 100))


@pytest.mark.parametrize("name", ["x,y", " q ", "é"])
def test_agents_workers_and_the_default_queue_take_the_same_names(name: str) -> None:
    with pytest.raises(InvalidInputError, match="queue"):
        agent("tests.bad_input.queue", queue=name)
    with pytest.raises(InvalidInputError, match="a queue name is"):
        Worker([name])
    with override_settings(AGENTRUNS={"DEFAULT_QUEUE": name}):
        assert [m.id for m in agentruns_checks.check_settings()] == [
            agentruns_checks.E005_BAD_QUEUE]


def test_runworker_refuses_a_queue_name_no_run_can_have(no_worker: list[Worker]) -> None:  # noqa: F811
    with pytest.raises(CommandError, match=r"--queues: .*a queue name is"):
        call_command("runworker", "--queues", "default,é")
    assert no_worker == []


# --------------------------------------------------------------------------- commands


@pytest.mark.django_db
@pytest.mark.parametrize("older_than", ["99999999999d", "9999999999999999999999999w", "365001d"])
def test_purge_refuses_a_duration_no_clock_can_subtract(older_than: str) -> None:
    with pytest.raises(CommandError, match=r"--older-than: a duration is at most 365000d"):
        call_command("purge", "--older-than", older_than)


@pytest.mark.django_db
def test_purge_takes_the_longest_duration_and_refuses_timedelta_max() -> None:
    call_command("purge", "--older-than", "365000d")
    with pytest.raises(InvalidInputError, match="older_than reaches before the year 1"):
        purge(timedelta.max)


@pytest.mark.django_db
@pytest.mark.parametrize(("command", "args"), [
    ("reap", ["--limit", "99999999999999999999"]),
    ("reap", ["--limit", "2147483648"]),
    ("purge", ["--older-than", "1d", "--batch-size", "99999999999999999999"]),
    ("why", ["99999999999999999999"]),
])
def test_a_count_too_large_for_the_database_is_refused(command: str, args: list[str]) -> None:
    with pytest.raises(CommandError, match="must be a whole number from 1 to"):
        call_command(command, *args)


@pytest.mark.django_db
def test_the_largest_counts_are_taken() -> None:
    call_command("reap", "--limit", "2147483647")
    with pytest.raises(CommandError, match="No run with id 9223372036854775807"):
        call_command("why", "9223372036854775807")


def test_runworker_refuses_a_worker_id_no_run_can_store(no_worker: list[Worker]) -> None:  # noqa: F811
    with pytest.raises(CommandError, match="--worker-id: a worker id is 1-255 characters"):
        call_command("runworker", "--worker-id", "w" * 256)
    with pytest.raises(InvalidInputError, match="a worker id is 1-255 characters"):
        Worker(worker_id="w\x00")
    assert Worker(worker_id="w" * 255).worker_id == "w" * 255
    assert no_worker == []


# --------------------------------------------------------------------------- run_after


@pytest.mark.django_db
@pytest.mark.parametrize("run_after", [
    datetime.max.replace(tzinfo=UTC), LATEST_RUN_AFTER,
    datetime(9999, 6, 1, tzinfo=UTC), timedelta(days=(LATEST_RUN_AFTER - datetime.now(UTC)).days
                                                + 1)],
    ids=["datetime.max", "the-bound", "year-9999", "timedelta-past-the-bound"])
def test_a_run_after_near_the_end_of_time_is_refused(run_after: Any) -> None:
    with pytest.raises(InvalidInputError, match=r"run_after must be before 9999-01-01"):
        enqueue("tests.noop", run_after=run_after)
    assert not AgentRun.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("zone", ["America/New_York", "Asia/Tokyo", "Pacific/Kiritimati"])
def test_the_latest_run_after_shows_in_the_admin_in_any_time_zone(
        admin_client: Client, zone: str) -> None:
    latest = LATEST_RUN_AFTER - timedelta(microseconds=1)
    run = enqueue("tests.noop", run_after=latest)
    assert AgentRun.objects.get(pk=run.pk).available_at == latest
    with override_settings(TIME_ZONE=zone):
        assert admin_client.get(run_url(run)).status_code == 200
        assert admin_client.get(run_url(run).rsplit("/", 3)[0] + "/").status_code == 200


# --------------------------------------------------------------------------- enqueue_many


@pytest.mark.django_db
def test_enqueue_many_too_large_for_one_statement_writes_several_in_one_transaction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(enqueue_sql, "MAX_STATEMENT_BYTES", 2000)
    requests = [RunRequest("tests.noop", {"i": i, "blob": "x" * 300}) for i in range(20)]
    statements: list[str] = []

    def count(execute: Any, sql: str, *args: Any) -> Any:
        if 'INSERT INTO "django_agentruns_agentrun"' in sql:
            statements.append(sql)
        return execute(sql, *args)

    with connection.execute_wrapper(count):
        runs = enqueue_many(requests)
    assert len(statements) >= 4
    stored = {r.pk: r.input for r in AgentRun.objects.all()}
    assert [stored[r.pk] for r in runs] == [r.input for r in requests], "in request order"
    assert [r.pk for r in runs] == sorted(r.pk for r in runs)


@pytest.mark.slow
@pytest.mark.postgres_only
@pytest.mark.django_db
def test_enqueue_many_of_more_than_256_mb_of_input_is_written() -> None:
    """PostgreSQL refuses more than 255 MB of jsonb in one value: the batch that once
    failed with a raw OperationalError is now written in several statements."""
    blob = "x" * (1_048_576 - 30)
    runs = enqueue_many([RunRequest("tests.noop", {"i": i, "blob": blob}) for i in range(260)])
    assert AgentRun.objects.count() == 260
    assert AgentRun.objects.get(pk=runs[-1].pk).input["i"] == 259
