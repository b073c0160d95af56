"""The read-replica scenario, run by tests/test_read_replica.py in a subprocess whose
settings point `default` at a private primary and `replica` (READ_DATABASE) at its
streaming replica: this process's Django talks to both, as a deployment's web process does.

Each check prints one `ok <name>` line; an AssertionError fails the process (and the test,
which shows this output).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.db import connections  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.urls import reverse  # noqa: E402

from django_agentruns import api, enqueue, transitions  # noqa: E402
from django_agentruns.models import AgentRun, RunEvent, Status  # noqa: E402
from django_agentruns.ops import replica  # noqa: E402
from django_agentruns.ops.backlog import read_backlog  # noqa: E402
from django_agentruns.ops.visibility import why_not_started  # noqa: E402
from django_agentruns.outcomes import AttemptRef  # noqa: E402
from django_agentruns.registry import scope_policy  # noqa: E402
from django_agentruns.streaming.sse import read_runs  # noqa: E402
from tests import helpers  # noqa: E402

RUNS_TABLE = AgentRun._meta.db_table
CHANGELIST = reverse("admin:django_agentruns_agentrun_changelist")
OVERVIEW = reverse("admin:django_agentruns_agentrun_overview")


def ok(name: str) -> None:
    print(f"ok {name}", flush=True)


def on_replica(sql: str, params: list[Any] | None = None) -> Any:
    with connections["replica"].cursor() as cursor:
        cursor.execute(sql, params or [])
        return cursor.fetchone()


def caught_up() -> bool:
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT pg_current_wal_lsn()")
        (lsn,) = cursor.fetchone()
    return bool(on_replica("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", [str(lsn)])[0])


def wait_for_replica() -> None:
    helpers.wait_until(caught_up, timeout=60, interval=0.05,
                       message="the replica to replay the primary's writes")


@contextmanager
def replay_paused() -> Iterator[None]:
    """The replica stops applying the primary's writes: it shows the past until resumed."""
    on_replica("SELECT pg_wal_replay_pause()")
    helpers.wait_until(lambda: on_replica("SELECT pg_get_wal_replay_pause_state()")[0]
                       == "paused", timeout=30, message="the replica's replay to pause")
    try:
        yield
    finally:
        on_replica("SELECT pg_wal_replay_resume()")
        wait_for_replica()


def tables_read(alias: str, action: Callable[[], Any]) -> tuple[Any, list[str]]:
    with CaptureQueriesContext(connections[alias]) as queries:
        result = action()
    return result, [q["sql"] for q in queries.captured_queries]


def listed(client: Client, run: AgentRun) -> bool:
    page = client.get(CHANGELIST)
    assert page.status_code == 200
    return f"/{run.pk}/change/" in page.content.decode()


def claimed(run: AgentRun) -> AttemptRef:
    [got] = transitions.claim("w-replica", [run.queue], 1, scope_policy(), {}, 60.0)
    assert got.pk == run.pk
    return AttemptRef(got.pk, got.attempt, "w-replica", 60.0)


def main() -> None:
    assert replica.lag() == 0.0  # a standby, caught up
    user = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(user)
    wait_for_replica()

    # The list reads the runs from the replica, and not from the primary.
    first = enqueue("tests.noop")
    wait_for_replica()
    page, on_primary = tables_read("default", lambda: listed(client, first))
    assert page
    assert not [sql for sql in on_primary if RUNS_TABLE in sql], on_primary
    _, from_replica = tables_read("replica", lambda: listed(client, first))
    assert [sql for sql in from_replica if RUNS_TABLE in sql]
    ok("the list reads from the replica")

    # A run written to the primary shows only once the replica has replayed it: in the
    # list, the overview, `why`, the gauges and the event stream's catch-up read.
    with replay_paused():
        fresh = enqueue("tests.noop")
        assert AgentRun.objects.filter(pk=fresh.pk).exists()  # on the primary
        assert not listed(client, fresh)
        _, overview = tables_read("default", lambda: client.get(OVERVIEW))
        assert not [sql for sql in overview if RUNS_TABLE in sql], overview
        try:
            why_not_started(fresh.pk)
        except AgentRun.DoesNotExist:
            pass
        else:
            raise AssertionError("why read the primary")
        assert read_backlog().due.get("default", 0) == 1  # only `first`
        assert read_runs({fresh.pk: 0})[fresh.pk].run is None
        # The lag note: past LAG_SHOWN (0 here, so no wait is needed) the pages say so.
        replica.LAG_SHOWN = 0.0
        behind = replica.lag()
        assert behind is not None
        assert behind > 0
        assert "behind the primary" in client.get(CHANGELIST).content.decode()
        assert "behind the primary" in client.get(OVERVIEW).content.decode()
    assert listed(client, fresh)
    assert read_backlog().due.get("default", 0) == 2
    found = read_runs({fresh.pk: 0})[fresh.pk]
    assert found.run is not None
    assert found.run["status"] == Status.QUEUED
    assert "behind the primary" not in client.get(CHANGELIST).content.decode()
    replica.LAG_SHOWN = 5.0
    ok("reads follow replication")

    # An action on a run the replica still shows running, but which finished on the
    # primary: the run page's Cancel and the list's bulk cancel act on the primary's state.
    AgentRun.objects.filter(pk__in=[first.pk, fresh.pk]).update(status=Status.CANCELLED)
    run = enqueue("tests.noop")
    ref = claimed(run)
    wait_for_replica()
    with replay_paused():
        transitions.settle_succeeded(ref, {"done": True})
        assert AgentRun.objects.for_reading().get(pk=run.pk).status == Status.RUNNING
        assert AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED
        cancel = reverse("admin:django_agentruns_agentrun_cancel", args=[run.pk])
        confirm = client.get(cancel).content.decode()
        assert "there is nothing to cancel" in confirm, confirm  # the primary's state
        done = client.post(cancel, {"post": "yes"}, follow=True).content.decode()
        assert "it has already finished" in done, done
        bulk = client.post(CHANGELIST, {"action": "cancel_runs", "post": "yes",
                                        "_selected_action": [run.pk]}, follow=True)
        assert "1 skipped (already finished)" in bulk.content.decode()
        # Writes go to the primary: a write to the replica would have failed outright.
        row = AgentRun.objects.get(pk=run.pk)
        assert (row.status, row.cancel_requested_at) == (Status.SUCCEEDED, None)
    ok("an action re-reads the run on the primary")

    # And the other way round: running on the primary, queued on the replica: the cancel
    # asks the running run to stop (what the primary says), it does not cancel it outright.
    other = enqueue("tests.noop")
    wait_for_replica()
    with replay_paused():
        claimed(other)
        cancel = reverse("admin:django_agentruns_agentrun_cancel", args=[other.pk])
        done = client.post(cancel, {"post": "yes"}, follow=True).content.decode()
        assert "was asked to stop" in done, done
        row = AgentRun.objects.get(pk=other.pk)
        assert row.status == Status.RUNNING
        assert row.cancel_requested_at is not None
        assert AgentRun.objects.for_reading().get(pk=other.pk).status == Status.QUEUED
    ok("a cancel follows the primary's state")

    # Retry: cancelled on the replica, already retried (queued) on the primary by someone
    # else: the admin's Retry does not requeue it a second time.
    again = enqueue("tests.noop")
    api.cancel(again.pk)
    wait_for_replica()
    with replay_paused():
        assert api.retry(again.pk, by="someone else")
        assert AgentRun.objects.for_reading().get(pk=again.pk).status == Status.CANCELLED
        retry = reverse("admin:django_agentruns_agentrun_retry", args=[again.pk])
        done = client.post(retry, {"post": "yes"}, follow=True).content.decode()
        assert "was not retried: it is not failed or cancelled" in done, done
        assert AgentRun.objects.get(pk=again.pk).status == Status.QUEUED
        retried = RunEvent.objects.filter(run_id=again.pk, type=transitions.RETRIED)
        assert retried.count() == 1  # one retry, not two
    ok("a retry follows the primary's state")


if __name__ == "__main__":
    main()
