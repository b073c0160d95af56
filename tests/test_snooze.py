"""Snoozes and interruptions are not failures.

`raise Snooze(delay)`, or a 429/503 with Retry-After, puts the run back after the delay
without spending its requeue budget, up to MAX_SNOOZES; a graceful stop (SIGTERM) is an
interruption, requeued free, while a lapsed lease (SIGKILL) still spends the budget.
"""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest
from django.test import override_settings

from django_agentruns import InvalidInputError, Snooze, cancel, enqueue, transitions
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.outcomes import AttemptRef, ErrorInfo, Settlement
from django_agentruns.rules.policy import Failure
from django_agentruns.runtime.worker import Worker
from tests import helpers

SETTINGS = {"LEASE_TTL": 2.0, "POLL_INTERVAL": 0.05, "REAP_INTERVAL": 0.5,
            "BACKOFF_BASE": 0.0, "BACKOFF_CAP": 0.0}


def burst() -> None:
    Worker(burst=True, reap_interval=0, max_contention_wait=10).run(install_signals=False)


def events(run_id: int, type_: str | None = None) -> list[RunEvent]:
    qs = RunEvent.objects.filter(run_id=run_id).order_by("seq")
    return list(qs if type_ is None else qs.filter(type=type_))


def run(run_id: int) -> AgentRun:
    return AgentRun.objects.get(pk=run_id)


@pytest.mark.slow
def test_a_429_snoozed_five_times_still_succeeds_with_its_budget_whole(
    worker_env: dict[str, str],
) -> None:
    limited = enqueue("tests.rate_limited", {"limited": 5, "retry_after": "1"})
    with helpers.start_manage(["runworker"], worker_env):
        helpers.wait_until(lambda: run(limited.pk).status == Status.SUCCEEDED, timeout=60,
                           message="the run to succeed after five snoozes")
    done = run(limited.pk)
    assert (done.requeue_count, done.snooze_count, done.attempt) == (0, 5, 6)
    snoozes = events(limited.pk, transitions.SNOOZED)
    assert len(snoozes) == 5
    assert all(e.payload["delay"] == 1.0 and e.payload["cause"] == "HTTP 429 Retry-After"
               for e in snoozes)
    assert [e.payload["snoozes"] for e in snoozes] == [1, 2, 3, 4, 5]
    # Each snooze waited its Retry-After before the next attempt started.
    starts = events(limited.pk, transitions.STARTED)
    for snoozed, started in zip(snoozes, starts[1:], strict=True):
        assert (started.created_at - snoozed.created_at).total_seconds() >= 0.99
    assert not events(limited.pk, transitions.RETRYING)


@pytest.mark.django_db(transaction=True)
def test_past_max_snoozes_a_snooze_spends_the_budget(settings: Any) -> None:
    settings.AGENTRUNS = {**SETTINGS, "MAX_SNOOZES": 2}
    limited = enqueue("tests.rate_limited", {"retry_after": "0"})  # always 429
    burst()
    row = run(limited.pk)
    # Two free snoozes, then three retries (max_requeues=3), then the dead letter.
    assert (row.status, row.reason) == (Status.FAILED, Reason.RETRIES_EXHAUSTED)
    assert (row.snooze_count, row.requeue_count, row.attempt) == (2, 3, 6)
    assert [e.type for e in events(limited.pk) if e.type != transitions.STARTED] == [
        "run.snoozed", "run.snoozed", "run.retrying", "run.retrying", "run.retrying",
        "run.dead_lettered"]
    assert row.error_type == "tests.testapp.flow_agents.RateLimitError"


@pytest.mark.django_db(transaction=True)
def test_raise_snooze_requeues_after_its_delay() -> None:
    snoozed = enqueue("tests.snoozer", {"times": 3, "delay": 0})
    burst()
    row = run(snoozed.pk)
    assert (row.status, row.requeue_count, row.snooze_count) == (Status.SUCCEEDED, 0, 3)
    assert events(snoozed.pk, transitions.SNOOZED)[0].payload["cause"].startswith("Snooze")

    later = enqueue("tests.snoozer", {"times": 1, "delay": 3600})
    burst()  # snoozed for an hour: not due, so the burst worker leaves it
    row = run(later.pk)
    assert (row.status, row.snooze_count, row.requeue_count) == (Status.QUEUED, 1, 0)
    assert 3590 < (row.available_at - events(later.pk)[-1].created_at).total_seconds() <= 3600


@pytest.mark.parametrize("delay", [-1, float("nan"), float("inf"), "5", True, 10**9])
def test_a_bad_snooze_delay_is_a_clear_error(delay: Any) -> None:
    with pytest.raises(InvalidInputError, match="Snooze"):
        Snooze(delay)


@pytest.mark.django_db(transaction=True)
def test_a_bad_snooze_dead_letters_the_run_as_not_retryable() -> None:
    bad = enqueue("tests.snoozer", {"delay": -5})
    burst()
    row = run(bad.pk)
    assert (row.status, row.reason, row.snooze_count) == (Status.FAILED, Reason.NOT_RETRYABLE, 0)


@pytest.mark.django_db(transaction=True)
def test_a_requested_cancel_wins_over_a_snooze() -> None:
    queued = enqueue("tests.noop")
    (claimed,) = transitions.claim("w", ["default"], 1, transitions.ScopePolicy(), {}, 60.0)
    cancel(queued.pk)
    ref = AttemptRef(queued.pk, claimed.attempt, "w", 60.0)
    failure = Failure(retryable=True, delay=5.0, snooze=True, cause="test")
    assert transitions.snooze(ref, failure, ErrorInfo("E", "m", "")) is Settlement.CANCELLED
    assert run(queued.pk).status == Status.CANCELLED
    # And a snooze by a writer that lost the run writes nothing.
    assert transitions.snooze(ref, failure, ErrorInfo("E", "m", "")) is Settlement.LOST


# --------------------------------------------------------------------------- interruptions


def _attempt_running(run_id: int, attempt: int) -> bool:
    row = run(run_id)
    return row.status == Status.RUNNING and row.attempt == attempt \
        and RunEvent.objects.filter(run_id=run_id, type="run.started", attempt=attempt).exists()


@pytest.mark.slow
def test_five_sigterms_leave_the_budget_whole_five_sigkills_dead_letter_it(
    worker_env: dict[str, str],
) -> None:
    env = {**worker_env, "AGENTRUNS_TEST_SETTINGS": json.dumps({"REAP_INTERVAL": 0.2})}
    stopped = enqueue("tests.gate", {"seconds": 120})
    for attempt in range(1, 6):
        with helpers.start_manage(["runworker", "--grace", "0"], env) as worker:
            helpers.wait_until(lambda a=attempt: _attempt_running(stopped.pk, a), timeout=60,
                               message=f"attempt {attempt} running")
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=60) == 0, worker.output()
        row = run(stopped.pk)
        assert (row.status, row.requeue_count) == (Status.QUEUED, 0)
    assert len(events(stopped.pk, transitions.INTERRUPTED)) == 5
    assert not events(stopped.pk, transitions.ABANDONED)

    killed = enqueue("tests.gate", {"seconds": 120})
    cancel(stopped.pk)  # out of the way
    for attempt in range(1, 6):
        if run(killed.pk).status == Status.FAILED:
            break
        with helpers.start_manage(["runworker", "--grace", "0"], env) as worker:
            helpers.wait_until(
                lambda a=attempt: _attempt_running(killed.pk, a)
                or run(killed.pk).status == Status.FAILED,
                timeout=30, message=f"attempt {attempt} running (or the dead letter)")
            worker.kill()
            worker.wait(timeout=60)
        if run(killed.pk).status == Status.RUNNING:
            # The next worker reclaims the lapsed lease (spending the budget) as it starts.
            pass
    with helpers.start_manage(["runworker"], env):
        helpers.wait_until(lambda: run(killed.pk).status == Status.FAILED, timeout=60,
                           message="the killed run to be dead-lettered")
    row = run(killed.pk)
    assert (row.reason, row.requeue_count) == (Reason.RETRIES_EXHAUSTED, 3)
    assert len(events(killed.pk, transitions.ABANDONED)) == 4
    assert not events(killed.pk, transitions.INTERRUPTED)


@pytest.mark.django_db(transaction=True)
def test_settings_override_for_snoozes_is_read_lazily() -> None:
    with override_settings(AGENTRUNS={**SETTINGS, "MAX_SNOOZES": 0}):
        limited = enqueue("tests.snoozer", {"times": 1, "delay": 0})
        burst()
    row = run(limited.pk)
    assert (row.status, row.snooze_count, row.requeue_count) == (Status.SUCCEEDED, 0, 1)
