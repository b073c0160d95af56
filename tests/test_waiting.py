"""Runs that wait (guarantee 12): `ctx.receive`, `deliver`, wait timeouts, cancel.

A waiting run holds no lease and no worker slot, is never reaped, and is resumed exactly
once per delivery; a delivery is never lost, whether it comes before, during or after the
wait. Real worker processes throughout.
"""

from __future__ import annotations

import signal
import threading
from collections import Counter

import pytest
from django.utils import timezone

from django_agentruns import (
    CancelResult,
    DeliverResult,
    InvalidInputError,
    LimitExceeded,
    RunRequest,
    cancel,
    deliver,
    enqueue,
    enqueue_many,
    run_now,
)
from django_agentruns.models import AgentRun, Reason, RunEvent, RunWait, Status
from django_agentruns.outcomes import AttemptRef
from django_agentruns.queries import holding_statuses
from django_agentruns.runtime.context import RunContext
from django_agentruns.runtime.control import AttemptControl
from django_agentruns.runtime.reaper import reap
from tests import helpers
from tests.testapp.models import SideEffect

WORKER = ["runworker", "--queues", "waiting,default", "--concurrency", "1"]

# Each test runs on plain history tables and on partitioned ones (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("history_layout")


def status(run_id: int) -> str:
    return AgentRun.objects.values_list("status", flat=True).get(pk=run_id)


def events(run_id: int) -> list[str]:
    return list(RunEvent.objects.filter(run_id=run_id).order_by("seq")
                .values_list("type", flat=True))


def notes(run_id: int) -> list[str]:
    return list(SideEffect.objects.filter(run_id=run_id).order_by("id")
                .values_list("note", flat=True))


def until_status(run_id: int, wanted: str, timeout: float = 30) -> None:
    helpers.wait_until(lambda: status(run_id) == wanted, timeout=timeout,
                       message=f"run {run_id} {wanted}")


def worker(env: dict[str, str], *extra: str) -> helpers.ManageProcess:
    process = helpers.start_manage([*WORKER, *extra], env)
    helpers.wait_until(lambda: "serving queues" in process.stderr, timeout=60)
    return process


def test_guarantee_12_waiting_costs_nothing(
        worker_env: dict[str, str]) -> None:
    """A waiting run frees its slot (a concurrency-1 worker runs another run meanwhile),
    holds no lease, and is resumed once by its delivery, from its checkpoint."""
    with worker(worker_env) as w:
        waiting = enqueue("tests.waits", {"prompt": {"question": "go?"}})
        until_status(waiting.pk, Status.WAITING)
        row = AgentRun.objects.get(pk=waiting.pk)
        assert (row.claimed_by, row.lease_expires, row.wait_key) == ("", None, "go")
        assert RunWait.objects.get(run=waiting).prompt == {"question": "go?"}
        # The only slot of the worker is free: another run starts and finishes meanwhile.
        other = enqueue("tests.noop")
        until_status(other.pk, Status.SUCCEEDED)
        assert status(waiting.pk) == Status.WAITING

        assert deliver(waiting.pk, "go", {"answer": 42}, by="webhook") \
            is DeliverResult.DELIVERED
        until_status(waiting.pk, Status.SUCCEEDED)
        assert w.stop() == 0, w.output()
    row = AgentRun.objects.get(pk=waiting.pk)
    assert row.output == {"got": {"answer": 42}}
    # Resumed from its checkpoint, without spending the requeue budget.
    assert (row.attempt, row.requeue_count) == (2, 0)
    assert notes(waiting.pk) == ["before", "after"]
    story = events(waiting.pk)
    assert story.count("run.waiting") == 1
    assert story.count("run.resumed") == 1
    delivered = RunEvent.objects.get(run=waiting, type="run.delivered")
    assert delivered.payload == {"key": "go", "by": "webhook"}


def test_a_delivery_before_the_wait_is_found_without_waiting(
        worker_env: dict[str, str]) -> None:
    run = enqueue("tests.waits")
    assert deliver(run.pk, "go", [1, 2]) is DeliverResult.STORED
    with worker(worker_env) as w:
        until_status(run.pk, Status.SUCCEEDED)
        assert w.stop() == 0, w.output()
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.output, row.attempt) == ({"got": [1, 2]}, 1)
    assert "run.waiting" not in events(run.pk)


def test_a_second_delivery_leaves_the_first_standing(worker_env: dict[str, str]) -> None:
    run = enqueue("tests.waits")
    with worker(worker_env) as w:
        until_status(run.pk, Status.WAITING)
        assert deliver(run.pk, "go", "first") is DeliverResult.DELIVERED
        assert deliver(run.pk, "go", "second") is DeliverResult.ALREADY_DELIVERED
        until_status(run.pk, Status.SUCCEEDED)
        assert deliver(run.pk, "go", "third") is DeliverResult.ALREADY_DELIVERED
        assert deliver(run.pk, "other", "late") is DeliverResult.FINISHED
        assert w.stop() == 0, w.output()
    assert AgentRun.objects.get(pk=run.pk).output == {"got": "first"}
    assert events(run.pk).count("run.delivered") == 1
    assert events(run.pk).count("run.resumed") == 1


def test_deliveries_racing_the_waits_from_another_process_are_never_lost(
        worker_env: dict[str, str]) -> None:
    """Each payload is delivered while its run starts, waits or resumes: none may be lost,
    and no run may wait for a payload already delivered."""
    runs = enqueue_many([RunRequest("tests.waits", {"key": f"k{i}"}) for i in range(24)])
    with worker(worker_env, "--concurrency", "4") as w:
        results: list[DeliverResult] = []

        def deliver_all() -> None:
            from django.db import connection

            try:
                for i, run in enumerate(runs):
                    results.append(deliver(run.pk, f"k{i}", {"i": i}, by="racer"))
            finally:
                connection.close()

        racer = threading.Thread(target=deliver_all)
        racer.start()
        racer.join(timeout=60)
        helpers.wait_until(lambda: AgentRun.objects.filter(
            status=Status.SUCCEEDED).count() == len(runs), timeout=90)
        assert w.stop() == 0, w.output()
    assert set(results) <= {DeliverResult.DELIVERED, DeliverResult.STORED}
    for i, run in enumerate(runs):
        assert AgentRun.objects.get(pk=run.pk).output == {"got": {"i": i}}
    resumed = Counter(RunEvent.objects.filter(type="run.resumed").values_list("run_id",
                                                                               flat=True))
    assert all(n == 1 for n in resumed.values())
    assert sum(r is DeliverResult.DELIVERED for r in results) == len(resumed)


def test_a_wait_past_its_deadline_fails_the_run_unless_caught(
        worker_env: dict[str, str]) -> None:
    uncaught = enqueue("tests.waits", {"timeout": 0.5})
    caught = enqueue("tests.waits", {"timeout": 0.5, "catch_timeout": True, "key": "k"})
    with worker(worker_env) as w:  # its reaping pass (every 0.5 s) enforces deadlines
        until_status(uncaught.pk, Status.FAILED)
        until_status(caught.pk, Status.SUCCEEDED)
        assert w.stop() == 0, w.output()
    row = AgentRun.objects.get(pk=uncaught.pk)
    assert (row.reason, row.requeue_count) == (Reason.NOT_RETRYABLE, 0)
    assert row.error_type == "django_agentruns.exceptions.WaitTimedOut"
    assert "run.wait_timed_out" in events(uncaught.pk)
    assert AgentRun.objects.get(pk=caught.pk).output == {"timed_out": True}
    # Too late: the run is finished, nothing is stored.
    assert deliver(uncaught.pk, "go", 1) is DeliverResult.FINISHED


def test_manage_py_reap_enforces_wait_deadlines(worker_env: dict[str, str]) -> None:
    run = enqueue("tests.waits", {"timeout": 4})
    with worker(worker_env) as w:
        until_status(run.pk, Status.WAITING)
        assert w.stop() == 0, w.output()
    # No worker now: only `reap` can enforce the deadline. Before it, reap changes nothing.
    deadline = AgentRun.objects.get(pk=run.pk).wait_until
    assert deadline is not None
    first = helpers.run_manage(["reap"], worker_env)
    assert first.returncode == 0, first.stderr
    if timezone.now() < deadline:  # it surely ran before the deadline: it changed nothing
        assert status(run.pk) == Status.WAITING
        assert "waits timed out" not in first.stdout
    helpers.wait_until(lambda: timezone.now() > deadline, timeout=60)
    second = helpers.run_manage(["reap"], worker_env)
    assert second.returncode == 0, second.stderr
    # On a loaded machine the first reap may already run past the deadline: exactly one of
    # the two enforces it.
    assert ["waits timed out 1" in done.stdout for done in (first, second)].count(True) == 1
    assert status(run.pk) == Status.QUEUED
    assert events(run.pk)[-2:] == ["run.wait_timed_out", "run.resumed"]


def test_cancelling_a_waiting_run_is_immediate(worker_env: dict[str, str]) -> None:
    run = enqueue("tests.waits")
    with worker(worker_env) as w:
        until_status(run.pk, Status.WAITING)
        assert cancel(run.pk, "no longer needed") is CancelResult.CANCELLED
        assert status(run.pk) == Status.CANCELLED
        assert deliver(run.pk, "go", 1) is DeliverResult.FINISHED
        assert w.stop() == 0, w.output()
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.reason, row.wait_key, row.wait_until) == (Reason.CANCELLED, "", None)
    assert notes(run.pk) == ["before"]


def test_a_worker_killed_after_the_wait_leaves_nothing_to_reap(
        worker_env: dict[str, str]) -> None:
    run = enqueue("tests.waits")
    w = worker(worker_env)
    until_status(run.pk, Status.WAITING)
    w.send_signal(signal.SIGKILL)
    w.wait()
    w.close()
    report = reap(at=AgentRun.objects.get(pk=run.pk).created_at.replace(year=2100))
    assert report.stale == []
    assert report.wait_timeouts == []
    assert status(run.pk) == Status.WAITING
    assert deliver(run.pk, "go", "after the crash") is DeliverResult.DELIVERED
    with worker(worker_env) as w2:
        until_status(run.pk, Status.SUCCEEDED)
        assert w2.stop() == 0, w2.output()
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.output, row.requeue_count) == ({"got": "after the crash"}, 0)


def test_an_async_agent_waits_too(worker_env: dict[str, str]) -> None:
    run = enqueue("tests.async_waits")
    with worker(worker_env) as w:
        until_status(run.pk, Status.WAITING)
        deliver(run.pk, "go", {"async": True})
        until_status(run.pk, Status.SUCCEEDED)
        assert w.stop() == 0, w.output()
    assert AgentRun.objects.get(pk=run.pk).output == {"got": {"async": True}}


@pytest.mark.django_db(transaction=True)
def test_bad_deliveries_get_a_clear_error_and_write_nothing() -> None:
    run = enqueue("tests.waits")
    for bad in [{"run_id": "x", "key": "go"}, {"run_id": run.pk, "key": ""},
                {"run_id": run.pk, "key": "k" * 201}, {"run_id": run.pk, "key": "~runs:x"},
                {"run_id": run.pk, "key": 7}, {"run_id": run.pk, "key": "go", "payload": {1, 2}},
                {"run_id": run.pk, "key": "go", "payload": float("nan")},
                {"run_id": run.pk, "key": "go", "by": 3}]:
        with pytest.raises(InvalidInputError):
            deliver(**bad)  # type: ignore[arg-type]
    with pytest.raises(LimitExceeded):
        deliver(run.pk, "go", "x" * 2_000_000)
    assert RunWait.objects.count() == 0
    assert events(run.pk) == []
    assert deliver(run.pk + 1000, "go", 1) is DeliverResult.NOT_FOUND


@pytest.mark.django_db(transaction=True)
def test_receive_needs_a_running_attempt_with_a_lease() -> None:
    # run_now holds no lease and no worker would resume it: it cannot wait.
    with pytest.raises(InvalidInputError, match="run_now cannot wait"):
        run_now("tests.waits")
    control = AttemptControl(AttemptRef(1, 1, "w", 2.0), None, 0)
    control.done.set()
    ctx = RunContext(run_id=1, agent="tests.waits", input={}, attempt=1, state=None,
                     scope="", control=control)
    with pytest.raises(InvalidInputError, match="has ended"):
        ctx.receive("go")


def test_a_waiting_run_holds_its_ordered_scope() -> None:
    assert Status.WAITING in holding_statuses(False)
    assert Status.WAITING in holding_statuses(True)




@pytest.mark.django_db(transaction=True)
def test_deliver_writes_in_the_callers_transaction() -> None:
    from django.db import transaction

    run = enqueue("tests.waits")
    with transaction.atomic():
        assert deliver(run.pk, "go", {"n": 1}, by="view") is DeliverResult.STORED
        transaction.set_rollback(True)
    assert not RunWait.objects.exists()
    assert events(run.pk) == []
    assert deliver(run.pk, "go", {"n": 2}) is DeliverResult.STORED
    assert RunWait.objects.get(run=run).payload == {"n": 2}
