"""Enqueue: what a run starts as, bad input refused before any write, and guarantee 9."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any, TypeVar
from unittest import mock

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_agentruns import (
    AgentRunsError,
    InvalidInputError,
    RunRequest,
    UnknownAgentError,
    agent,
    enqueue,
    enqueue_many,
)
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.registry import all_agents, unregister
from django_agentruns.transitions import fair

pytestmark = pytest.mark.django_db

CUSTOM = "tests.enqueue_custom"
T = TypeVar("T")


@pytest.fixture
def custom_agent() -> Iterator[str]:
    """An agent with its own queue, priority and budget, registered for one test."""

    @agent(CUSTOM, queue="reports", priority=7, max_requeues=9)
    def custom(ctx: Any) -> None:
        return None

    yield CUSTOM
    unregister(CUSTOM)


def nothing_written() -> bool:
    return AgentRun.objects.count() == 0 and RunEvent.objects.count() == 0


# --------------------------------------------------------------------------- what is stored


def test_enqueue_returns_a_queued_run_with_the_agents_policy(custom_agent: str) -> None:
    before = timezone.now()
    run = enqueue(custom_agent, input={"ticket": 42})
    after = timezone.now()

    assert run.pk is not None
    stored = AgentRun.objects.get(pk=run.pk)
    assert stored.status == Status.QUEUED
    assert stored.agent == custom_agent
    assert stored.queue == "reports"
    assert stored.priority == 7
    assert stored.max_requeues == 9
    assert stored.input == {"ticket": 42}
    assert stored.attempt == 0
    assert stored.requeue_count == 0
    assert stored.claimed_by == ""
    assert stored.lease_expires is None
    assert stored.reason == ""
    assert before <= stored.available_at <= after
    assert stored.created_at == stored.available_at


def test_enqueue_defaults_come_from_settings() -> None:
    run = AgentRun.objects.get(pk=enqueue("tests.noop").pk)
    assert run.queue == "default"
    assert run.priority == 0
    assert run.max_requeues == 3  # Defaults.MAX_REQUEUES; tests.settings leaves it alone
    assert run.input == {}
    assert run.scope == ""
    assert run.fired_seq == 0


def test_agent_max_requeues_overrides_the_setting() -> None:
    assert AgentRun.objects.get(pk=enqueue("tests.always_fails").pk).max_requeues == 2


def test_scope_queue_priority_and_fired_seq_are_stored(custom_agent: str) -> None:
    run = enqueue(custom_agent, input=[1, "two", None], scope="ticket-42", queue="urgent",
                  priority=-3, fired_seq=17)
    stored = AgentRun.objects.get(pk=run.pk)
    assert (stored.scope, stored.queue, stored.priority, stored.fired_seq) == (
        "ticket-42", "urgent", -3, 17)
    assert stored.input == [1, "two", None]


@pytest.mark.parametrize(
    ("run_after", "expected_delay"),
    [
        (timedelta(minutes=5), timedelta(minutes=5)),
        (90, timedelta(seconds=90)),
        (2.5, timedelta(seconds=2.5)),
        (0, timedelta(0)),
    ],
    ids=["timedelta", "int-seconds", "float-seconds", "zero"],
)
def test_run_after_relative(run_after: timedelta | float, expected_delay: timedelta) -> None:
    before = timezone.now()
    run = enqueue("tests.noop", run_after=run_after)
    after = timezone.now()
    stored = AgentRun.objects.get(pk=run.pk)
    assert before + expected_delay <= stored.available_at <= after + expected_delay
    # Relative delays count from the enqueue time itself.
    assert stored.available_at - stored.created_at == expected_delay


def test_run_after_datetime_is_stored_as_given() -> None:
    when = timezone.now().replace(microsecond=0) + timedelta(days=2)
    run = enqueue("tests.noop", run_after=when)
    assert AgentRun.objects.get(pk=run.pk).available_at == when


def test_enqueue_many_stores_every_request(custom_agent: str) -> None:
    when = timezone.now() + timedelta(hours=1)
    runs = enqueue_many([
        RunRequest("tests.noop", {"n": 1}, scope="s", fired_seq=1),
        {"agent": custom_agent, "input": {"n": 2}, "priority": 3, "run_after": when},
        RunRequest("tests.once", queue="other"),
    ])
    assert len(runs) == 3
    assert all(r.pk is not None for r in runs)
    stored = {r.pk: r for r in AgentRun.objects.all()}
    assert set(stored) == {r.pk for r in runs}
    first, second, third = (stored[r.pk] for r in runs)
    assert (first.agent, first.input, first.scope, first.fired_seq, first.queue) == (
        "tests.noop", {"n": 1}, "s", 1, "default")
    assert (second.agent, second.priority, second.queue, second.available_at) == (
        custom_agent, 3, "reports", when)
    assert second.max_requeues == 9
    assert (third.agent, third.queue) == ("tests.once", "other")
    assert all(r.status == Status.QUEUED for r in stored.values())


def test_enqueue_many_keeps_the_request_order(custom_agent: str) -> None:
    """Thousands of runs in one call (far more values than SQLite takes as parameters of
    one statement), each returned run the row written for its request, ids ascending."""
    requests = [RunRequest(custom_agent if n % 2 else "tests.noop", {"n": n}, scope=f"s{n % 7}",
                           queue=None if n % 3 else f"q{n % 5}", fired_seq=n)
                for n in range(3000)]
    runs = enqueue_many(requests)
    assert [r.pk for r in runs] == sorted(r.pk for r in runs)
    stored = {r.pk: r for r in AgentRun.objects.all()}
    assert len(stored) == 3000
    for run, request in zip(runs, requests, strict=True):
        row = stored[run.pk]
        queue = request.queue or ("reports" if request.agent == custom_agent else "default")
        assert (row.agent, row.input, row.scope, row.fired_seq, row.queue) == (
            request.agent, request.input, request.scope, request.fired_seq, queue)
        assert (run.agent, run.input, run.queue, run.priority, run.status, run.created_at,
                run.available_at) == (row.agent, row.input, row.queue, row.priority,
                                      row.status, row.created_at, row.available_at)


@pytest.mark.django_db(transaction=True)
def test_enqueue_in_autocommit_is_one_statement_in_no_transaction_of_its_own() -> None:
    """One INSERT is atomic by itself: no BEGIN and COMMIT round trips around it. It
    writes the input's payload row too on PostgreSQL; SQLite needs a second INSERT for it,
    so an input other than {} opens a transaction there. (Whether fair shares are on is
    read at most every few seconds per process: read here first, as a running app has.)"""
    fair.stamping([])
    with mock.patch.object(transaction.Atomic, "__enter__", autospec=True,
                           side_effect=transaction.Atomic.__enter__) as opened, \
            CaptureQueriesContext(connection) as queries:
        run = enqueue("tests.noop", input={"n": 1})
        runs = enqueue_many([RunRequest("tests.noop"), RunRequest("tests.once")])
    if connection.vendor == "postgresql":
        assert opened.call_count == 0
        assert len(queries) == 2
    else:  # BEGIN, the two INSERTs and COMMIT; then the keyless runs' one INSERT
        assert opened.call_count == 1
        assert [q["sql"].split()[0] for q in queries.captured_queries] == [
            "BEGIN", "INSERT", "INSERT", "COMMIT", "INSERT"]
    assert AgentRun.objects.get(pk=run.pk).input == {"n": 1}
    assert _count_elsewhere(pk__in=[run.pk, *(r.pk for r in runs)]) == 3  # committed


def test_enqueue_many_of_nothing_writes_nothing() -> None:
    assert enqueue_many([]) == []
    assert nothing_written()


# --------------------------------------------------------------------------- bad input


def test_unknown_agent_names_the_agent_and_the_registered_ones() -> None:
    with pytest.raises(UnknownAgentError) as caught:
        enqueue("tests.no_such_agent", input={"a": 1})
    message = str(caught.value)
    assert "'tests.no_such_agent'" in message
    for name in ("tests.noop", "tests.once", "tests.async_steps"):
        assert name in message
    assert caught.value.name == "tests.no_such_agent"
    assert set(caught.value.registered) == set(all_agents())
    assert isinstance(caught.value, AgentRunsError)
    assert isinstance(caught.value, LookupError)
    assert nothing_written()


def test_unknown_agent_in_enqueue_many_writes_nothing() -> None:
    with pytest.raises(UnknownAgentError, match=r"tests\.missing"):
        enqueue_many([RunRequest("tests.noop"), RunRequest("tests.missing"),
                      RunRequest("tests.noop")])
    assert nothing_written()


@pytest.mark.parametrize(
    "bad_input",
    [
        object(),
        float("nan"),
        float("inf"),
        {1, 2},
        {"nested": {"deep": [1, object()]}},
        {"value": float("-inf")},
        {(1, 2): "tuple key"},
        b"bytes",
    ],
    ids=["object", "nan", "inf", "set", "nested-object", "nested-inf", "tuple-key", "bytes"],
)
def test_non_json_input_is_refused(bad_input: Any) -> None:
    with pytest.raises(InvalidInputError, match="JSON"):
        enqueue("tests.noop", input=bad_input)
    assert nothing_written()


def _naive_now() -> datetime:
    return datetime.now()  # naive on purpose


BAD_ARGUMENTS: list[tuple[str, dict[str, Any]]] = [
    ("scope-int", {"scope": 5}),
    ("scope-none", {"scope": None}),
    ("scope-too-long", {"scope": "s" * 256}),
    ("scope-nul", {"scope": "a\x00b"}),
    ("queue-int", {"queue": 7}),
    ("queue-empty", {"queue": ""}),
    ("queue-too-long", {"queue": "q" * 101}),
    ("queue-list", {"queue": ["default"]}),
    ("priority-str", {"priority": "1"}),
    ("priority-float", {"priority": 1.5}),
    ("priority-bool", {"priority": True}),
    ("priority-too-big", {"priority": 40000}),
    ("priority-too-small", {"priority": -40000}),
    ("run_after-str", {"run_after": "tomorrow"}),
    ("run_after-negative", {"run_after": -1}),
    ("run_after-nan", {"run_after": float("nan")}),
    ("run_after-inf", {"run_after": float("inf")}),
    ("run_after-bool", {"run_after": True}),
    ("run_after-naive", {"run_after": _naive_now()}),
    ("fired_seq-str", {"fired_seq": "3"}),
    ("fired_seq-float", {"fired_seq": 3.0}),
    ("fired_seq-none", {"fired_seq": None}),
    ("fired_seq-bool", {"fired_seq": False}),
    ("fired_seq-too-big", {"fired_seq": 2**63}),
]


@pytest.mark.parametrize("kwargs", [k for _, k in BAD_ARGUMENTS],
                         ids=[name for name, _ in BAD_ARGUMENTS])
def test_wrong_argument_types_are_refused(kwargs: dict[str, Any]) -> None:
    (field,) = kwargs
    with pytest.raises(InvalidInputError, match=field):
        enqueue("tests.noop", **kwargs)
    assert nothing_written()


@pytest.mark.parametrize("kwargs", [k for _, k in BAD_ARGUMENTS],
                         ids=[name for name, _ in BAD_ARGUMENTS])
def test_one_bad_request_in_enqueue_many_writes_nothing(kwargs: dict[str, Any]) -> None:
    good = RunRequest("tests.noop", {"ok": True})
    with pytest.raises(InvalidInputError):
        enqueue_many([good, good, {"agent": "tests.noop", **kwargs}, good])
    assert nothing_written()


@pytest.mark.parametrize(
    "bad_request",
    [
        {"agent": "tests.noop", "inputs": {}},  # misspelt field
        {"input": {}},  # no agent
        {"agent": "tests.noop", "input": object()},
    ],
    ids=["unknown-key", "missing-agent", "non-json"],
)
def test_malformed_request_dicts_are_refused(bad_request: dict[str, Any]) -> None:
    with pytest.raises(InvalidInputError):
        enqueue_many([RunRequest("tests.noop"), bad_request])
    assert nothing_written()


def test_a_refused_enqueue_leaves_the_callers_transaction_usable() -> None:
    """Validation happens before any SQL, so the caller's transaction is not broken."""
    with transaction.atomic():
        kept = enqueue("tests.noop", input={"n": 1})
        with pytest.raises(InvalidInputError):
            enqueue("tests.noop", input={"n": object()})
        also_kept = enqueue("tests.noop", input={"n": 2})
    assert set(AgentRun.objects.values_list("pk", flat=True)) == {kept.pk, also_kept.pk}


# --------------------------------------------------------------------------- guarantee 9


def _count_elsewhere(**filters: Any) -> int:
    """Count runs from another thread, i.e. another database connection."""
    result: list[int] = []

    def count() -> None:
        try:
            result.append(AgentRun.objects.filter(**filters).count())
        finally:
            connections.close_all()

    thread = threading.Thread(target=count)
    thread.start()
    thread.join(timeout=30)
    assert result, "the counting thread failed"
    return result[0]


class Boom(Exception):
    pass


def rolled_back(work: Callable[[], T]) -> T:
    """Run `work` in a transaction that is then rolled back by an exception; return its value."""
    result: list[T] = []
    try:
        with transaction.atomic():
            result.append(work())
            raise Boom
    except Boom:
        pass
    return result[0]


@pytest.mark.django_db(transaction=True)
def test_guarantee_9_transactional_enqueue() -> None:
    # Rolled back: the run never existed, for anybody.
    def enqueue_some() -> AgentRun:
        run = enqueue("tests.noop", input={"n": "rolled back"}, scope="g9")
        enqueue_many([RunRequest("tests.noop", scope="g9"), RunRequest("tests.once", scope="g9")])
        assert AgentRun.objects.filter(scope="g9").count() == 3  # visible inside only
        assert _count_elsewhere(scope="g9") == 0
        return run

    gone = rolled_back(enqueue_some)
    assert gone.pk is not None
    assert not AgentRun.objects.filter(pk=gone.pk).exists()
    assert AgentRun.objects.count() == 0
    assert RunEvent.objects.count() == 0

    # Committed: the run exists, and another connection sees it.
    with transaction.atomic():
        committed = enqueue("tests.noop", input={"n": "committed"}, scope="g9")
        assert _count_elsewhere(scope="g9") == 0  # not before the commit
    assert AgentRun.objects.get(pk=committed.pk).status == Status.QUEUED
    assert _count_elsewhere(pk=committed.pk) == 1


@pytest.mark.django_db(transaction=True)
def test_enqueue_rolled_back_with_the_callers_savepoint() -> None:
    with transaction.atomic():
        outer = enqueue("tests.noop", scope="outer")
        rolled_back(lambda: enqueue("tests.noop", scope="inner"))
    assert list(AgentRun.objects.values_list("pk", flat=True)) == [outer.pk]
