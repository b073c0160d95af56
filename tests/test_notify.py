"""LISTEN/NOTIFY: PostgreSQL's triggers (migration 0002) wake workers, on commit only.

Absences are asserted without sleeping: NOTIFYs arrive in commit order, so a sentinel
sent after the transaction under test shows up after anything that transaction sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from django_agentruns import RunRequest, cancel, enqueue, enqueue_many, retry, run_now
from django_agentruns.db import CHANNEL, probe_channel
from django_agentruns.models import AgentRun, Status
from django_agentruns.runtime import wakeups as notify
from django_agentruns.runtime.wakeups import Listener
from django_agentruns.transitions import fair
from tests import helpers

pytestmark = pytest.mark.django_db(transaction=True)

T = TypeVar("T")
TRIGGERS = ["agentruns_notify_finish", "agentruns_notify_insert", "agentruns_notify_resume",
            "agentruns_notify_retry"]  # finish and resume: migration 0005 (waiting runs)


@pytest.fixture
def listener() -> Iterator[Any]:
    """A plain psycopg connection in autocommit, LISTENing on the channel."""
    import psycopg

    conn = psycopg.connect(helpers.database_url(connection.settings_dict), autocommit=True)
    conn.execute(f"LISTEN {CHANNEL}")
    yield conn
    conn.close()


def notifications_until(listener: Any, sentinel: str, timeout: float = 10) -> list[str]:
    """Payloads received up to and including `sentinel`, waiting at most `timeout` s."""
    payloads: list[str] = []
    for note in listener.notifies(timeout=timeout):
        payloads.append(note.payload)
        if note.payload == sentinel:
            return payloads
    raise AssertionError(f"no {sentinel!r} notification within {timeout} s; got {payloads}")


def sent_before_sentinel(listener: Any, sentinel: str = "sentinel") -> list[str]:
    """What was notified before now: NOTIFY `sentinel` in a commit of its own, read up to it."""
    listener.execute(f"NOTIFY {CHANNEL}, '{sentinel}'")
    return notifications_until(listener, sentinel)[:-1]


def rolled_back(work: Callable[[], T]) -> T:
    with transaction.atomic():
        result = work()
        transaction.set_rollback(True)
    return result


def triggers() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal "
                       "AND tgrelid = %s::regclass ORDER BY tgname", [AgentRun._meta.db_table])
        return [name for (name,) in cursor.fetchall()]


# --------------------------------------------------------------------------- enqueue


@pytest.mark.postgres_only
def test_enqueue_notifies_on_commit_only(listener: Any) -> None:
    with transaction.atomic():
        enqueue("tests.noop", queue="q-committed")
    assert notifications_until(listener, "q-committed") == ["q-committed"]

    rolled_back(lambda: enqueue("tests.noop", queue="q-rolled-back"))
    enqueue("tests.noop", queue="q-sentinel")
    assert notifications_until(listener, "q-sentinel") == ["q-sentinel"]


@pytest.mark.postgres_only
def test_enqueue_in_autocommit_notifies_once(listener: Any) -> None:
    assert connection.get_autocommit()
    fair.stamping([])  # read at most every few seconds per process: read here first
    with CaptureQueriesContext(connection) as queries:
        enqueue("tests.noop", queue="q-autocommit")
    assert len(queries) == 1  # the INSERT: no pg_notify() round trip
    assert sent_before_sentinel(listener) == ["q-autocommit"]


@pytest.mark.postgres_only
def test_enqueue_many_notifies_once_per_queue(listener: Any) -> None:
    with transaction.atomic():
        enqueue_many([RunRequest("tests.noop", {"n": n}, queue="qa" if n % 3 else "qb")
                      for n in range(1000)])
        enqueue_many([RunRequest("tests.once", queue="qa")] * 10)
    assert sorted(sent_before_sentinel(listener)) == ["qa", "qb"]


@pytest.mark.postgres_only
def test_a_rolled_back_enqueue_many_notifies_nobody(listener: Any) -> None:
    rolled_back(lambda: enqueue_many([RunRequest("tests.noop", queue="qa"),
                                      RunRequest("tests.noop", queue="qb")] * 500))
    assert sent_before_sentinel(listener) == []
    assert AgentRun.objects.count() == 0


@pytest.mark.postgres_only
def test_notification_not_seen_before_commit(listener: Any) -> None:
    with transaction.atomic():
        enqueue("tests.noop", queue="q-pending")
        # The listener notifies itself (autocommit). Had the INSERT's NOTIFY been sent
        # outside this transaction, it would arrive before this probe.
        listener.execute(f"NOTIFY {CHANNEL}, 'probe'")
        assert notifications_until(listener, "probe") == ["probe"]
    assert notifications_until(listener, "q-pending") == ["q-pending"]


@pytest.mark.postgres_only
def test_any_insert_of_a_queued_run_notifies(listener: Any) -> None:
    """The trigger sees every INSERT: one made without `enqueue` wakes workers too."""
    AgentRun.objects.create(agent="tests.noop", queue="q-orm")
    run_now("tests.noop")  # inserted running, not queued: nothing to wake anybody for
    assert sent_before_sentinel(listener) == ["q-orm"]


# --------------------------------------------------------------------------- back to the queue


@pytest.mark.postgres_only
def test_an_operator_retry_notifies(listener: Any) -> None:
    run = enqueue("tests.noop", queue="q-retry")
    cancel(run.pk)
    assert sent_before_sentinel(listener, "enqueued") == ["q-retry"]  # the cancel: nothing

    assert retry(run.pk) is True
    assert sent_before_sentinel(listener, "retried") == ["q-retry"]


@pytest.mark.postgres_only
def test_a_requeue_of_a_running_run_does_not_notify(listener: Any) -> None:
    """Its own worker looks again at once, and a backoff is not due: waking the others
    would only cost them an empty claim."""
    run = enqueue("tests.noop", queue="q-requeue")
    AgentRun.objects.filter(pk=run.pk).update(status=Status.RUNNING)
    AgentRun.objects.filter(pk=run.pk).update(status=Status.QUEUED)
    AgentRun.objects.filter(pk=run.pk).update(priority=5)  # status untouched
    assert sent_before_sentinel(listener) == ["q-requeue"]  # the enqueue's only


@pytest.mark.postgres_only
def test_a_workers_listener_wakes_on_enqueue() -> None:
    wake, stopping = threading.Event(), threading.Event()
    listening = Listener(["q-wake"], wake, stopping)
    listening.start()
    try:
        assert listening.connected.wait(10), "the listener did not connect"
        assert wake.wait(10), "no catch-up wake on connecting"
        wake.clear()
        enqueue("tests.noop", queue="q-wake")
        assert wake.wait(10), "the enqueue did not wake the listener"
    finally:
        stopping.set()
        listening.thread.join(10)
    assert not listening.thread.is_alive()


# --------------------------------------------------------------------------- the migration


def test_the_trigger_migration_reverses_and_reapplies() -> None:
    postgres = connection.vendor == "postgresql"
    if postgres:
        assert triggers() == TRIGGERS
    try:
        call_command("migrate", "django_agentruns", "0001", verbosity=0)
        if postgres:
            assert triggers() == []
    finally:
        call_command("migrate", "django_agentruns", verbosity=0)
    if postgres:
        assert triggers() == TRIGGERS
    assert AgentRun.objects.get(pk=enqueue("tests.noop").pk).status == Status.QUEUED


@pytest.mark.postgres_only
def test_without_the_trigger_nothing_notifies(listener: Any) -> None:
    # Migration 0002's own statements drop and recreate its triggers: migrating back to 0001
    # would also drop the columns later migrations add, which enqueue writes.
    from importlib import import_module

    triggers_op = import_module("django_agentruns.migrations.0002_notify_trigger").NotifyTriggers
    table = connection.ops.quote_name(AgentRun._meta.db_table)
    try:
        with connection.cursor() as cursor:
            for statement in triggers_op.drop(table):
                cursor.execute(statement)
        enqueue("tests.noop", queue="q-untriggered")
        assert sent_before_sentinel(listener, "reversed") == []
    finally:
        with connection.cursor() as cursor:
            for statement in triggers_op.create(table):
                cursor.execute(statement)
    enqueue("tests.noop", queue="q-triggered")
    assert sent_before_sentinel(listener, "reapplied") == ["q-triggered"]


@pytest.mark.postgres_only
def test_a_listener_checks_itself_on_a_channel_of_its_own() -> None:
    from django_agentruns.ops import metrics

    assert probe_channel("host:1:aa") != probe_channel("host:1:ab")
    wake, stopping = threading.Event(), threading.Event()
    listening = Listener(["q"], wake, stopping, worker_id="host:1:aa")
    assert listening.channel == probe_channel("host:1:aa")
    listening.start()
    try:
        assert listening.connected.wait(10), "the self-check did not pass"
        assert not listening.degraded.is_set()
        if metrics.AVAILABLE:
            assert metrics.WAKEUPS_DEGRADED._value.get() == 0
    finally:
        stopping.set()
        listening.thread.join(10)


@pytest.mark.postgres_only
def test_a_listener_checks_itself_again_whenever_it_reconnects(
        monkeypatch: pytest.MonkeyPatch) -> None:
    checks: list[bool] = []

    def counted(*args: Any, **kwargs: Any) -> bool:
        checks.append(real(*args, **kwargs))
        return checks[-1]

    real = notify.self_check
    monkeypatch.setattr(notify, "self_check", counted)
    wake, stopping = threading.Event(), threading.Event()
    listening = Listener(["q"], wake, stopping, worker_id="host:2:reconnect")
    listening.start()
    try:
        assert listening.connected.wait(10)
        assert checks == [True]
        with connection.cursor() as cursor:  # the server ends the listener's session
            cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE query = %s", [f"LISTEN {listening.channel}"])
        helpers.wait_until(lambda: checks == [True, True] and listening.connected.is_set(),
                           timeout=20, message="a second self-check after reconnecting")
    finally:
        stopping.set()
        listening.thread.join(10)


@pytest.mark.postgres_only
def test_a_failed_self_check_warns_once_polls_and_recovers(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from django_agentruns.ops import metrics

    answers = iter([False, False, True])
    monkeypatch.setattr(notify, "self_check", lambda *a, **k: next(answers, True))
    monkeypatch.setattr(notify, "PROBE_RETRY", 0.05)
    wake, stopping = threading.Event(), threading.Event()
    listening = Listener(["q"], wake, stopping, worker_id="host:3:degraded", poll_interval=7)
    caplog.set_level("INFO", logger="django_agentruns.worker")
    listening.start()
    try:
        assert listening.degraded.is_set()
        if metrics.AVAILABLE:
            assert metrics.WAKEUPS_DEGRADED._value.get() == 1
        assert listening.connected.wait(10), "the third self-check passes"
        assert not listening.degraded.is_set()
    finally:
        stopping.set()
        listening.thread.join(10)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings  # one per episode, not one per retry
    assert "LISTEN_DATABASE" in warnings[0]
    assert "every POLL_INTERVAL (7 s)" in warnings[0]
    assert any("wake-ups restored" in r.getMessage() for r in caplog.records)
