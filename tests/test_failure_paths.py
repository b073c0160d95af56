"""Failures that used to vanish: whatever an agent raises (SystemExit, KeyboardInterrupt,
an error whose `__str__` raises) its attempt is recorded as what it was; and a database
out of reach during a context call is the engine's failure, never charged to the agent."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
from django.db import OperationalError

from django_agentruns import cancel, enqueue, retry, run_now, transitions
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.runtime.worker import Worker
from django_agentruns.transitions import (
    AttemptRef,
    CheckpointWrite,
    Result,
    ScopePolicy,
    Settlement,
    Write,
    batched,
)
from django_agentruns.transitions.settling import FREE_INTERRUPTIONS
from tests import helpers
from tests.testapp.failure_agents import UnprintableError


def events(run_id: int) -> list[str]:
    return list(RunEvent.objects.filter(run_id=run_id).order_by("seq")
                .values_list("type", flat=True))


def finished(run_id: int) -> AgentRun | None:
    row = AgentRun.objects.get(pk=run_id)
    return row if row.status in (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED) else None


# --------------------------------------------------------------------------- run_now


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_run_now_records_a_base_exception_and_raises_it(error: type[BaseException]) -> None:
    """The run ends failed, not running for good: its scope is free and it can be retried."""
    with pytest.raises(error, match="raised by the agent"):
        run_now("tests.ordered_interrupted", {"raise": error.__name__}, scope="s-1")
    row = AgentRun.objects.get(agent="tests.ordered_interrupted")
    assert (row.status, row.reason, row.error_type) == (Status.FAILED, Reason.ERROR,
                                                        error.__name__)
    assert row.error_message == "raised by the agent"
    assert events(row.pk) == ["run.started", "run.dead_lettered"]

    later = enqueue("tests.ordered_interrupted", {}, scope="s-1")
    Worker(burst=True, reap_interval=0).run(install_signals=False)
    assert AgentRun.objects.get(pk=later.pk).status == Status.SUCCEEDED  # scope not blocked
    assert retry(row.pk) is True


@pytest.mark.django_db(transaction=True)
def test_run_now_records_an_error_whose_str_raises() -> None:
    with pytest.raises(UnprintableError):
        run_now("tests.unprintable")
    row = AgentRun.objects.get(agent="tests.unprintable")
    assert (row.status, row.reason) == (Status.FAILED, Reason.ERROR)
    assert row.error_type == "tests.testapp.failure_agents.UnprintableError"
    assert row.error_message == "<UnprintableError: str() raised RuntimeError>"


@pytest.mark.django_db(transaction=True)
def test_run_now_records_an_async_agents_system_exit() -> None:
    with pytest.raises(SystemExit):
        run_now("tests.async_raises_base", {"raise": "SystemExit"})
    row = AgentRun.objects.get(agent="tests.async_raises_base")
    assert (row.status, row.error_type) == (Status.FAILED, "SystemExit")


# --------------------------------------------------------------------------- worker


@pytest.mark.slow
def test_worker_records_base_exceptions_and_unprintable_errors(
    worker_env: dict[str, str],
) -> None:
    """Recorded at once as failed with the real class (not abandoned when the lease lapses),
    logged, and an async agent's SystemExit leaves the worker's event loop serving."""
    base = {name: enqueue("tests.raises_base", {"raise": name}).pk
            for name in ("SystemExit", "KeyboardInterrupt")}
    async_exit = enqueue("tests.async_raises_base", {"raise": "SystemExit"}).pk
    bad_str = enqueue("tests.unprintable").pk
    env = {**worker_env, "AGENTRUNS_TEST_SETTINGS": '{"LEASE_TTL": 30}'}  # no lapse in time
    with helpers.start_manage(["runworker", "--concurrency", "4"], env) as worker:
        runs = [*base.values(), async_exit, bad_str]
        helpers.wait_until(lambda: all(finished(r) for r in runs), timeout=60,
                           message="every failing run to be recorded")
        after = enqueue("tests.async_raises_base", {}).pk  # the event loop still serves
        helpers.wait_until(lambda: finished(after), timeout=60, message="a later async run")
        assert AgentRun.objects.get(pk=after).status == Status.SUCCEEDED
        log = worker.stderr
        assert worker.stop() == 0, worker.output()

    for name, run_id in [*base.items(), ("SystemExit", async_exit)]:
        row = AgentRun.objects.get(pk=run_id)
        assert (row.status, row.reason, row.attempt, row.error_type) == (
            Status.FAILED, Reason.RETRIES_EXHAUSTED, 1, name), log
        assert f"run {run_id} tests." in log
        # The dead letter names why it will not be retried, as written on the run.
        assert f"dead_lettered ({Reason.RETRIES_EXHAUSTED.value}): {name}: raised by the agent" \
            in log
        assert "run.abandoned" not in events(run_id)
    row = AgentRun.objects.get(pk=bad_str)
    assert (row.status, row.reason, row.attempt) == (Status.FAILED, Reason.NOT_RETRYABLE, 1)
    assert row.error_message == "<UnprintableError: str() raised RuntimeError>"
    assert "could not record" not in log, log


@pytest.mark.slow
def test_a_context_call_on_a_dead_connection_is_retried_and_charges_nothing(
    worker_env: dict[str, str],
) -> None:
    """The connections the agent's writes go through (the worker's attempt store writers')
    are closed under Django between two steps (a restart would do the same): the writers
    reconnect, and the run succeeds on attempt 1."""
    run_id = enqueue("tests.drops_connection").pk
    # One writer: the one whose connection the agent closes writes the next step too.
    env = {**worker_env, "AGENTRUNS_TEST_SETTINGS": '{"WRITER_CONNECTIONS": 1}'}
    with helpers.start_manage(["runworker"], env) as worker:
        helpers.wait_until(lambda: finished(run_id), timeout=60, message="the run to finish")
        log = worker.stderr
        assert worker.stop() == 0, worker.output()
    row = AgentRun.objects.get(pk=run_id)
    assert (row.status, row.attempt, row.requeue_count, row.output) == (
        Status.SUCCEEDED, 1, 0, {"attempt": 1}), log
    assert "writer lost its connection" in log, log
    assert events(run_id) == ["run.started", "run.checkpoint", "after", "run.checkpoint",
                              "run.succeeded"]


def checkpoints_locked_on_attempt_1(writes: Sequence[Write]) -> list[Result]:
    """The worker's attempt store writes: a first attempt's checkpoint meets a lock that
    never goes (the database out of reach for it), everything else goes through."""
    if any(isinstance(w, CheckpointWrite) and w.ref.attempt == 1 for w in writes):
        raise OperationalError("database is locked")
    return real_apply_writes(writes)


real_apply_writes = batched.apply_writes


@pytest.mark.django_db(transaction=True)
def test_a_database_out_of_reach_past_half_the_lease_interrupts_without_charge(
    monkeypatch: pytest.MonkeyPatch, settings: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    settings.AGENTRUNS = {**settings.AGENTRUNS, "LEASE_TTL": 0.6}
    monkeypatch.setattr(batched, "apply_writes", checkpoints_locked_on_attempt_1)
    run_id = enqueue("tests.healthy", {"steps": 2, "sleep": 0}).pk
    with caplog.at_level(logging.INFO, logger="django_agentruns.worker"):
        Worker(burst=True, reap_interval=0).run(install_signals=False)
    row = AgentRun.objects.get(pk=run_id)
    assert (row.status, row.attempt, row.requeue_count) == (Status.SUCCEEDED, 2, 0)
    assert events(run_id)[:3] == ["run.started", "step", "run.interrupted"]
    assert "run.retrying" not in events(run_id)
    assert any("requeued (interrupted)" in r.getMessage() for r in caplog.records)


@pytest.mark.django_db(transaction=True)
def test_an_interruption_the_agent_wraps_in_its_own_error_is_still_an_interruption(
    monkeypatch: pytest.MonkeyPatch, settings: Any,
) -> None:
    settings.AGENTRUNS = {**settings.AGENTRUNS, "LEASE_TTL": 0.4}
    monkeypatch.setattr(batched, "apply_writes", checkpoints_locked_on_attempt_1)
    run_id = enqueue("tests.converts_stop").pk  # max_requeues=0: a charge dead-letters it
    Worker(burst=True, reap_interval=0).run(install_signals=False)
    row = AgentRun.objects.get(pk=run_id)
    assert (row.status, row.attempt, row.requeue_count) == (Status.SUCCEEDED, 2, 0)
    assert "run.interrupted" in events(run_id)


# --------------------------------------------------------------------------- the transition


def claim(agent: str) -> AttemptRef:
    queued = enqueue(agent)
    [run] = transitions.claim("w1", [queued.queue], 1, ScopePolicy(), {}, 2.0)
    return AttemptRef(run.pk, run.attempt, "w1", 2.0, agent=agent)


@pytest.mark.django_db(transaction=True)
def test_interrupt_requeues_at_once_without_spending_the_budget() -> None:
    ref = claim("tests.healthy")
    assert transitions.interrupt(ref, "the database was out of reach") is Settlement.REQUEUED
    row = AgentRun.objects.get(pk=ref.run_id)
    assert (row.status, row.requeue_count, row.claimed_by, row.lease_expires) == (
        Status.QUEUED, 0, "", None)
    event = RunEvent.objects.get(run_id=ref.run_id, type="run.interrupted")
    assert event.payload == {"why": "the database was out of reach", "worker": "w1"}
    assert transitions.interrupt(ref, "again") is Settlement.LOST  # the guard is spent


@pytest.mark.django_db(transaction=True)
def test_a_cancel_requested_wins_over_an_interruption() -> None:
    ref = claim("tests.healthy")
    cancel(ref.run_id)
    assert transitions.interrupt(ref, "x") is Settlement.CANCELLED
    assert AgentRun.objects.get(pk=ref.run_id).status == Status.CANCELLED


@pytest.mark.django_db(transaction=True)
def test_interruptions_past_the_free_ones_spend_the_budget() -> None:
    """A run whose writes break the connection every time cannot loop for ever."""
    ref = claim("tests.healthy")
    for _ in range(FREE_INTERRUPTIONS):
        assert transitions.interrupt(ref, "x") is Settlement.REQUEUED
        [run] = transitions.claim("w1", ["default"], 1, ScopePolicy(), {}, 2.0)
        ref = AttemptRef(run.pk, run.attempt, "w1", 2.0, agent=ref.agent)
    assert transitions.interrupt(ref, "x") is Settlement.REQUEUED
    row = AgentRun.objects.get(pk=ref.run_id)
    assert row.requeue_count == 1
    assert events(ref.run_id)[-2:] == ["run.abandoned", "run.retrying"]


@pytest.mark.django_db(transaction=True)
def test_a_replayed_checkpoint_only_renews() -> None:
    """A checkpoint retried after its commit's answer was lost adds no second event."""
    ref = claim("tests.healthy")
    assert transitions.checkpoint(ref, {"step": 1}, 1) is transitions.Renewal.OK
    assert transitions.checkpoint(ref, {"step": 1}, 1) is transitions.Renewal.OK
    assert events(ref.run_id).count("run.checkpoint") == 1
