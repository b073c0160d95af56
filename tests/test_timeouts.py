"""Attempt timeouts: an agent's `timeout` bounds one attempt, and a timed-out attempt is a
retryable failure (`AttemptTimeout`) within the run's requeue budget.

How the stop lands depends on the agent:
- a sync agent is stopped at its next step boundary (any context call);
- an async agent is cancelled where it awaits;
- a sync agent stuck past its timeout in code that reaches no boundary cannot be stopped
  (Python cannot interrupt a thread). The limit: its worker stops renewing the lease a
  third of a TTL after the deadline, so the lease lapses and the reaper (or a claim)
  takes the run back as an abandoned attempt while the stuck thread still runs; when that
  thread returns, its result is discarded (its fence no longer matches).
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections

from django_agentruns import enqueue, transitions
from django_agentruns.exceptions import AttemptTimeout
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.registry import get_agent
from django_agentruns.rules.policy import classify
from django_agentruns.runtime import reaper
from django_agentruns.runtime.worker import Worker
from tests import helpers
from tests.testapp.models import SideEffect

TIMEOUT_ERROR = "django_agentruns.exceptions.AttemptTimeout"





def run(run_id: int) -> AgentRun:
    return AgentRun.objects.get(pk=run_id)


def events(run_id: int) -> list[RunEvent]:
    return list(RunEvent.objects.filter(run_id=run_id).order_by("seq"))


def notes(run_id: int) -> list[tuple[int, str]]:
    return list(SideEffect.objects.filter(run_id=run_id).order_by("id")
                .values_list("attempt", "note"))


def burst() -> float:
    """Run everything due in an in-process worker, in this thread; return the seconds taken."""
    began = time.monotonic()
    Worker(burst=True, reap_interval=0).run(install_signals=False)
    return time.monotonic() - began


def test_attempt_timeout_is_a_retryable_failure() -> None:
    assert classify(AttemptTimeout("attempt exceeded its timeout of 1s")).retryable


@pytest.mark.django_db(transaction=True)
def test_sync_agent_is_stopped_at_its_next_boundary_and_retried() -> None:
    spec = get_agent("tests.timeout")  # heartbeats forever; timeout 0.3 s, max_requeues 1
    assert spec.timeout is not None
    looping = enqueue("tests.timeout")
    took = burst()
    # Two attempts of 0.3 s each, each stopped at the heartbeat after its deadline.
    assert took < 2 * spec.timeout + 2.0, f"took {took:.2f}s: the timeout did not stop it"

    row = run(looping.pk)
    assert (row.status, row.reason) == (Status.FAILED, Reason.RETRIES_EXHAUSTED)
    assert (row.attempt, row.requeue_count) == (2, 1)
    assert row.error_type == TIMEOUT_ERROR
    assert "timeout of 0.3s" in row.error_message
    types = [e.type for e in events(looping.pk)]
    assert types == ["run.started", "run.retrying", "run.started", "run.dead_lettered"]
    retrying = next(e for e in events(looping.pk) if e.type == "run.retrying")
    assert retrying.payload["error_type"] == TIMEOUT_ERROR
    assert retrying.attempt == 1
    assert notes(looping.pk) == [(1, ""), (2, "")]


@pytest.mark.django_db(transaction=True)
def test_async_agent_is_cancelled_by_its_timeout() -> None:
    spec = get_agent("tests.async_sleeper")  # awaits asyncio.sleep; timeout 0.5 s, no requeue
    assert spec.is_async
    assert spec.timeout is not None
    sleeping = enqueue("tests.async_sleeper", {"seconds": 20})
    took = burst()
    assert took < spec.timeout + 2.0, f"took {took:.2f}s: the await was not cancelled"

    row = run(sleeping.pk)
    assert (row.status, row.reason) == (Status.FAILED, Reason.RETRIES_EXHAUSTED)
    assert row.error_type == TIMEOUT_ERROR
    assert row.started_at is not None
    assert row.finished_at is not None
    assert (row.finished_at - row.started_at).total_seconds() < spec.timeout + 1.0
    assert [e.type for e in events(sleeping.pk)] == ["run.started", "run.dead_lettered"]


@pytest.mark.django_db(transaction=True)
def test_sync_agent_stuck_past_its_timeout_loses_its_lease_and_is_reclaimed() -> None:
    spec = get_agent("tests.stuck")  # attempt 1 sleeps with no boundary; timeout 0.3, TTL 1
    assert spec.timeout is not None
    assert spec.lease_ttl is not None
    stuck = enqueue("tests.stuck")
    worker = Worker(concurrency=1, burst=True, reap_interval=0)

    def serve() -> None:
        try:
            worker.run(install_signals=False)
        finally:
            connections.close_all()

    thread = threading.Thread(target=serve, name="test-worker")
    thread.start()
    try:
        helpers.wait_until(lambda: notes(stuck.pk) == [(1, "start")], message="attempt 1 stuck")

        # The keeper renews until a third of a TTL past the deadline, then lets the lease
        # lapse although the worker process is alive and the thread still in the agent.
        def lapsed() -> bool:
            row = run(stuck.pk)
            return row.status == Status.RUNNING and row.lease_expires is not None and \
                row.lease_expires < transitions.now()

        helpers.wait_until(lapsed, timeout=spec.timeout + 2 * spec.lease_ttl + 5,
                           message="the stuck attempt's lease to lapse")
        assert notes(stuck.pk) == [(1, "start")]  # still inside the agent

        report = reaper.reap()
        assert report.requeued == [stuck.pk]
        row = run(stuck.pk)
        assert (row.status, row.requeue_count, row.claimed_by, row.lease_expires) == (
            Status.QUEUED, 1, "", None)
        abandoned = [e for e in events(stuck.pk) if e.type == "run.abandoned"]
        assert [(e.attempt, e.payload["why"]) for e in abandoned] == [(1, "lease lapsed")]

        # Let the stuck thread return: its output is discarded (its fence is gone), and the
        # run goes on with attempt 2 on the freed slot.
        SideEffect.objects.create(run_id=stuck.pk, note="open")
        thread.join(timeout=20)
        assert not thread.is_alive()
    finally:
        worker.stop()
        thread.join(timeout=20)

    row = run(stuck.pk)
    assert (row.status, row.attempt, row.output) == (Status.SUCCEEDED, 2, {"attempt": 2})
    assert notes(stuck.pk) == [(1, "start"), (0, "open"), (1, "end"), (2, "start")]
    assert [e.type for e in events(stuck.pk)] == [
        "run.started", "run.abandoned", "run.retrying", "run.started", "run.succeeded"]
    assert worker.stats.settled == {"lost": 1, "succeeded": 1}
