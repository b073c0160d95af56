"""Cancellation (guarantee 7) and the operator's retry.

A queued run is cancelled at once. A running run gets a cancel *request*: its attempt sees
it at its next step boundary (every context call) or, if it makes none, through the
worker's lease keeper within a third of the lease TTL, and settles `cancelled`.
A requested cancel wins over a retry. An operator's `retry` requeues a failed or cancelled
run with a fresh budget.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections

from django_agentruns import CancelResult, cancel, enqueue, retry, transitions
from django_agentruns.conf import app_settings
from django_agentruns.exceptions import InvalidInputError, RunNotFoundError
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.rules.policy import Failure
from django_agentruns.runtime.worker import Worker
from django_agentruns.transitions import AttemptRef, ErrorInfo, ScopePolicy, Settlement
from tests import helpers
from tests.testapp.models import SideEffect

TTL = float(app_settings.LEASE_TTL)  # tests/settings.py: 2 s
STOP_BOUND = TTL / 3 + 1.0  # guarantee 7's bound, with a second of slack for polling



def run(run_id: int) -> AgentRun:
    return AgentRun.objects.get(pk=run_id)


def status(run_id: int) -> str:
    return AgentRun.objects.values_list("status", flat=True).get(pk=run_id)


def event_types(run_id: int) -> list[str]:
    return list(RunEvent.objects.filter(run_id=run_id).order_by("seq")
                .values_list("type", flat=True))


def notes(run_id: int) -> list[str]:
    return list(SideEffect.objects.filter(run_id=run_id).order_by("id")
                .values_list("note", flat=True))


def open_gate(run_id: int) -> None:
    SideEffect.objects.create(run_id=run_id, note="open")


def snapshot(run_id: int) -> tuple[dict[str, Any], list[tuple[Any, ...]]]:
    """Everything stored about a run: its row and its events."""
    row = AgentRun.objects.filter(pk=run_id).values().get()
    events = list(RunEvent.objects.filter(run_id=run_id).order_by("seq").values_list())
    return row, events


def seconds_until_status(run_id: int, wanted: str, since: float, timeout: float) -> float:
    """Wait on the run's status (not on a sleep) and return the seconds since `since`."""
    helpers.wait_until(lambda: status(run_id) == wanted, timeout=timeout, interval=0.01,
                       message=f"run {run_id} {wanted}")
    return time.monotonic() - since


def claim_one(agent: str, worker: str = "w1") -> AttemptRef:
    queued = enqueue(agent)
    [claimed] = transitions.claim(worker, [queued.queue], 1, ScopePolicy(), {}, TTL)
    assert claimed.pk == queued.pk
    return AttemptRef(claimed.pk, claimed.attempt, worker, TTL)


def burst() -> None:
    """Run everything due with an in-process worker, in this thread, until nothing is due."""
    Worker(burst=True, reap_interval=0).run(install_signals=False)


@contextmanager
def background_worker(concurrency: int = 2) -> Iterator[Worker]:
    """An in-process worker serving in a thread until the block ends."""
    worker = Worker(concurrency=concurrency, reap_interval=0)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            worker.run(install_signals=False)
        except BaseException as exc:  # surfaced in the test thread below
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=serve, name="test-worker")
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the worker did not stop"
    assert not errors, errors


# --------------------------------------------------------------------------- guarantee 7


@pytest.mark.slow
def test_guarantee_7_cancellation_stops_work(worker_env: dict[str, str]) -> None:
    # A queued run: cancelled at once, and no worker ever starts it.
    queued = enqueue("tests.noop")
    assert cancel(queued.pk, reason="not needed") is CancelResult.CANCELLED
    row = run(queued.pk)
    assert (row.status, row.reason, row.cancel_reason) == (Status.CANCELLED, Reason.CANCELLED,
                                                           "not needed")
    assert row.finished_at is not None
    assert row.cancel_requested_at is not None
    assert event_types(queued.pk) == ["run.cancelled"]
    assert RunEvent.objects.get(run_id=queued.pk).payload == {"reason": "not needed"}

    # Running runs, in a real worker process: a sync agent that heartbeats, and an async
    # agent that awaits with no context call (stopped by the lease keeper cancelling it).
    with helpers.start_manage(["runworker", "--concurrency", "2"], worker_env) as worker:
        sync_run = enqueue("tests.heartbeats", {"seconds": 30})
        async_run = enqueue("tests.async_wait", {"seconds": 30})
        helpers.wait_until(lambda: "start" in notes(sync_run.pk) and "start" in notes(
            async_run.pk), message="both agents running")
        for running in (sync_run, async_run):
            asked = time.monotonic()
            assert cancel(running.pk, reason="user asked") is CancelResult.REQUESTED
            took = seconds_until_status(running.pk, Status.CANCELLED, asked, STOP_BOUND + 10)
            assert took <= STOP_BOUND, f"{running.agent} took {took:.2f}s to stop"
        for stopped in (sync_run, async_run):
            row = run(stopped.pk)
            assert row.reason == Reason.CANCELLED
            assert row.cancel_reason == "user asked"
            assert row.lease_expires is None
            assert row.output is None
            assert (row.attempt, row.requeue_count) == (1, 0)
            assert event_types(stopped.pk) == ["run.started", "run.cancel_requested",
                                               "run.cancelled"]
            assert notes(stopped.pk) == ["start"]  # the agent stopped: no "end"
        assert cancel(sync_run.pk) is CancelResult.NOT_CANCELLABLE
        assert worker.stop() == 0, worker.output()
    assert status(queued.pk) == Status.CANCELLED
    assert run(queued.pk).attempt == 0


@pytest.mark.slow
def test_cancel_reaches_an_agent_that_never_calls_its_context(worker_env: dict[str, str]) -> None:
    """What we observe for a sync agent stuck in `time.sleep` (no step boundary):

    The lease keeper sees the cancel request within TTL/3 and raises the attempt's stop
    flag (`ctx.stop_requested`), and keeps the lease alive: the worker still owns the run.
    Python cannot interrupt the thread, so the run settles only when the agent comes back:
    `cancelled` at its next step boundary, and `cancelled` too if it returns without
    reaching one: the operator's request wins over the late output.
    """
    with helpers.start_manage(["runworker", "--concurrency", "2"], worker_env) as worker:
        returns = enqueue("tests.busy_sleep")
        reaches_boundary = enqueue("tests.busy_sleep", {"boundary": True})
        both = (returns.pk, reaches_boundary.pk)
        helpers.wait_until(lambda: all("start" in notes(pk) for pk in both),
                           message="both agents running")
        asked, asked_at = time.monotonic(), transitions.now()
        for pk in both:
            assert cancel(pk) is CancelResult.REQUESTED
        helpers.wait_until(lambda: all("stop seen" in notes(pk) for pk in both),
                           timeout=STOP_BOUND + 10, interval=0.01, message="the keeper's stop")
        took = time.monotonic() - asked
        assert took <= STOP_BOUND, f"the keeper took {took:.2f}s to see the cancel"

        def renewed_since_cancel() -> bool:
            leases = AgentRun.objects.filter(pk__in=both).values_list("lease_expires", flat=True)
            return all(lease is not None and lease > asked_at + timedelta(seconds=TTL)
                       for lease in leases)

        helpers.wait_until(renewed_since_cancel, message="the keeper renewing after the cancel")
        assert {status(pk) for pk in both} == {Status.RUNNING}

        for pk in both:
            open_gate(pk)
        helpers.wait_until(lambda: {status(pk) for pk in both} <= {Status.SUCCEEDED,
                                                                   Status.CANCELLED})
        assert worker.stop() == 0, worker.output()

    done = run(returns.pk)
    assert (done.status, done.reason, done.output) == (Status.CANCELLED, Reason.CANCELLED, None)
    assert notes(returns.pk) == ["start", "stop seen", "open", "end"]
    assert event_types(returns.pk) == ["run.started", "run.cancel_requested", "run.cancelled"]

    stopped = run(reaches_boundary.pk)
    assert (stopped.status, stopped.reason) == (Status.CANCELLED, Reason.CANCELLED)
    assert notes(reaches_boundary.pk) == ["start", "stop seen", "open"]  # no "end"
    assert event_types(reaches_boundary.pk) == ["run.started", "run.cancel_requested",
                                                "run.cancelled"]


# --------------------------------------------------------------------------- cancel vs retry


@pytest.mark.django_db
def test_a_requested_cancel_wins_over_a_retryable_failure_in_storage() -> None:
    ref = claim_one("tests.noop")
    assert cancel(ref.run_id, "stop") is CancelResult.REQUESTED
    assert cancel(ref.run_id, "again") is CancelResult.ALREADY_REQUESTED
    error = ErrorInfo("ConnectionError", "upstream down", "")
    assert transitions.settle_failed(ref, Failure(retryable=True), error) is \
        Settlement.CANCELLED
    row = run(ref.run_id)
    assert (row.status, row.reason, row.requeue_count) == (Status.CANCELLED, Reason.CANCELLED, 0)
    assert row.cancel_reason == "stop"
    assert row.error_type == "ConnectionError"
    assert event_types(ref.run_id) == ["run.started", "run.cancel_requested", "run.cancelled"]


@pytest.mark.django_db(transaction=True)
def test_a_run_that_fails_retryably_after_a_cancel_request_is_cancelled_not_requeued() -> None:
    with background_worker() as worker:
        failing = enqueue("tests.fails_when_cancelled")
        helpers.wait_until(lambda: "start" in notes(failing.pk), message="agent running")
        assert cancel(failing.pk) is CancelResult.REQUESTED
        helpers.wait_until(lambda: status(failing.pk) != Status.RUNNING)
        helpers.wait_until(lambda: worker.busy == 0, message="the attempt settled")
    row = run(failing.pk)
    assert (row.status, row.reason) == (Status.CANCELLED, Reason.CANCELLED)
    assert (row.attempt, row.requeue_count) == (1, 0)
    assert "run.retrying" not in event_types(failing.pk)
    assert notes(failing.pk) == ["start"]  # never ran again


# --------------------------------------------------------------------------- bad cancels


@pytest.mark.django_db
def test_cancelling_a_finished_run_is_not_cancellable_and_writes_nothing() -> None:
    succeeded = claim_one("tests.noop")
    assert transitions.settle_succeeded(succeeded, {"ok": True}) is Settlement.SUCCEEDED
    failed = claim_one("tests.noop")
    error = ErrorInfo("NotRetryable", "no", "")
    assert transitions.settle_failed(failed, Failure(retryable=False), error) is \
        Settlement.DEAD_LETTERED
    cancelled = enqueue("tests.noop")
    assert cancel(cancelled.pk) is CancelResult.CANCELLED

    for run_id in (succeeded.run_id, failed.run_id, cancelled.pk):
        before = snapshot(run_id)
        assert cancel(run_id, reason="too late") is CancelResult.NOT_CANCELLABLE
        assert snapshot(run_id) == before


@pytest.mark.django_db
def test_cancel_and_retry_of_an_unknown_run_raise_run_not_found() -> None:
    missing = (AgentRun.objects.order_by("-pk").values_list("pk", flat=True).first() or 0) + 1000
    with pytest.raises(RunNotFoundError, match=str(missing)):
        cancel(missing)
    with pytest.raises(RunNotFoundError, match=str(missing)):
        retry(missing)


@pytest.mark.django_db
@pytest.mark.parametrize("bad", ["abc", "", None, True, [1], {"id": 1}, 1.5, "1.5"])
def test_cancel_and_retry_of_a_non_integer_id_raise_invalid_input(bad: Any) -> None:
    existing = enqueue("tests.noop")
    if isinstance(bad, float):
        bad = existing.pk + 0.5  # must not be truncated to an existing run's id
    before = snapshot(existing.pk)
    with pytest.raises(InvalidInputError, match="Run id must be an integer"):
        cancel(bad)
    with pytest.raises(InvalidInputError, match="Run id must be an integer"):
        retry(bad)
    assert snapshot(existing.pk) == before


# --------------------------------------------------------------------------- operator retry


@pytest.mark.django_db(transaction=True)
def test_retry_requeues_a_dead_letter_with_a_fresh_budget() -> None:
    failed = enqueue("tests.always_fails")  # max_requeues=2
    burst()
    row = run(failed.pk)
    assert (row.status, row.reason, row.attempt, row.requeue_count) == (
        Status.FAILED, Reason.RETRIES_EXHAUSTED, 3, 2)

    assert retry(failed.pk, by="alice") is True
    row = run(failed.pk)
    assert (row.status, row.reason, row.requeue_count) == (Status.QUEUED, Reason.NONE, 0)
    assert (row.claimed_by, row.lease_expires, row.finished_at) == ("", None, None)
    assert row.available_at <= transitions.now()
    last = RunEvent.objects.filter(run_id=failed.pk).order_by("-seq").first()
    assert last is not None
    assert last.type == "run.retried"
    assert last.payload == {"by": "alice", "previous": "retries_exhausted"}

    burst()  # the fresh budget: three more attempts, then dead-lettered again
    row = run(failed.pk)
    assert (row.status, row.reason, row.attempt, row.requeue_count) == (
        Status.FAILED, Reason.RETRIES_EXHAUSTED, 6, 2)
    assert SideEffect.objects.filter(run_id=failed.pk).count() == 6


@pytest.mark.django_db(transaction=True)
def test_retry_requeues_a_cancelled_run_which_then_runs() -> None:
    cancelled = enqueue("tests.noop", {"n": 1})
    assert cancel(cancelled.pk, reason="oops") is CancelResult.CANCELLED
    assert retry(cancelled.pk, by="bob") is True
    row = run(cancelled.pk)
    assert (row.status, row.requeue_count, row.cancel_requested_at, row.cancel_reason) == (
        Status.QUEUED, 0, None, "")
    assert RunEvent.objects.filter(run_id=cancelled.pk, type="run.retried").get().payload == {
        "by": "bob", "previous": "cancelled"}
    burst()
    row = run(cancelled.pk)
    assert (row.status, row.attempt) == (Status.SUCCEEDED, 1)
    assert row.output == {"ok": True, "input": {"n": 1}}


@pytest.mark.django_db
def test_retry_of_a_succeeded_queued_or_running_run_is_false_and_writes_nothing() -> None:
    succeeded = claim_one("tests.noop")
    transitions.settle_succeeded(succeeded, None)
    running = claim_one("tests.noop")
    queued = enqueue("tests.noop")
    for run_id in (succeeded.run_id, running.run_id, queued.pk):
        before = snapshot(run_id)
        assert retry(run_id, by="alice") is False
        assert snapshot(run_id) == before
