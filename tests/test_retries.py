"""Guarantee 4, bounded retries: failures are classified; retryable ones are requeued with
backoff while the budget lasts, and failure retries and stale reclaims share that budget."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_agentruns import enqueue, transitions
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.registry import agent, unregister
from django_agentruns.runtime.worker import Worker, WorkerStats
from django_agentruns.transitions import ScopePolicy
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True)


def work() -> WorkerStats:
    """Run everything due in this process, then return."""
    return Worker(burst=True).run(install_signals=False)


def events(run_id: int) -> list[RunEvent]:
    return list(RunEvent.objects.filter(run_id=run_id).order_by("seq"))


def types(run_id: int) -> list[str]:
    return [e.type for e in events(run_id)]


def executions(run_id: int) -> list[int]:
    """The attempt number of each real execution of the agent's code."""
    return list(SideEffect.objects.filter(run_id=run_id).order_by("id")
                .values_list("attempt", flat=True))


def agentruns(**overrides: Any) -> override_settings:
    return override_settings(AGENTRUNS={**settings.AGENTRUNS, **overrides})


# --------------------------------------------------------------------------- the budget


def test_guarantee_4_bounded_retries() -> None:
    """`tests.always_fails` raises ConnectionError (retryable) with max_requeues=2."""
    run = enqueue("tests.always_fails")
    stats = work()
    assert stats.settled == {"requeued": 2, "dead_lettered": 1}

    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.reason) == (Status.FAILED, Reason.RETRIES_EXHAUSTED)
    assert row.is_dead_letter
    assert (row.attempt, row.requeue_count, row.max_requeues) == (3, 2, 2)
    assert executions(run.pk) == [1, 2, 3]
    assert row.error_type == "ConnectionError"
    assert row.error_message == "upstream unreachable"
    assert "Traceback (most recent call last)" in row.error_traceback
    assert 'raise ConnectionError("upstream unreachable")' in row.error_traceback
    assert row.finished_at is not None
    assert row.lease_expires is None

    assert types(run.pk) == [
        transitions.STARTED, transitions.RETRYING,
        transitions.STARTED, transitions.RETRYING,
        transitions.STARTED, transitions.DEAD_LETTERED,
    ]
    retrying = [e for e in events(run.pk) if e.type == transitions.RETRYING]
    assert [(e.attempt, e.payload["requeue"]) for e in retrying] == [(1, 1), (2, 2)]
    assert all(e.payload["error_type"] == "ConnectionError" for e in retrying)
    dead = events(run.pk)[-1]
    assert dead.attempt == 3
    assert dead.payload == {"reason": "retries_exhausted", "error_type": "ConnectionError",
                            "message": "upstream unreachable"}

    # Nothing is left to run: the budget really is spent.
    assert work().claimed == 0


def test_not_retryable_is_dead_lettered_after_one_attempt() -> None:
    run = enqueue("tests.not_retryable")
    assert work().settled == {"dead_lettered": 1}
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.reason) == (Status.FAILED, Reason.NOT_RETRYABLE)
    assert (row.attempt, row.requeue_count) == (1, 0)
    assert executions(run.pk) == [1]
    assert row.error_type == "django_agentruns.exceptions.NotRetryable"
    assert row.error_message == "bad credentials"
    assert types(run.pk) == [transitions.STARTED, transitions.DEAD_LETTERED]
    assert events(run.pk)[-1].payload["reason"] == "not_retryable"


def test_flaky_succeeds_on_its_second_attempt() -> None:
    run = enqueue("tests.flaky")
    assert work().settled == {"requeued": 1, "succeeded": 1}
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.reason, row.output) == \
        (Status.SUCCEEDED, Reason.COMPLETED, {"attempt": 2})
    assert (row.attempt, row.requeue_count) == (2, 1)
    assert executions(run.pk) == [1, 2]
    assert types(run.pk) == [transitions.STARTED, transitions.RETRYING,
                             transitions.STARTED, transitions.SUCCEEDED]


def test_zero_budget_dead_letters_the_first_retryable_failure() -> None:
    run = enqueue("tests.flaky")
    AgentRun.objects.filter(pk=run.pk).update(max_requeues=0)
    work()
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.reason, row.attempt) == (Status.FAILED, Reason.RETRIES_EXHAUSTED, 1)


def test_non_json_output_is_not_retryable() -> None:
    run = enqueue("tests.bad_output")
    work()
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.reason, row.attempt) == (Reason.NOT_RETRYABLE, 1)
    assert row.error_type == "django_agentruns.exceptions.InvalidInputError"


UNKNOWN = "tests.retries_unknown_error"


@pytest.fixture
def unknown_error_agent() -> Iterator[str]:
    """An agent raising an error nothing in the policy recognises."""

    @agent(UNKNOWN, max_requeues=1)
    def fails_oddly(ctx: Any) -> None:
        raise KeyError("no such model")

    yield UNKNOWN
    unregister(UNKNOWN)


def permanent_key_errors(exc: BaseException) -> bool | None:
    """A project's CLASSIFIER hook."""
    return False if isinstance(exc, KeyError) else None


@pytest.mark.usefixtures("unknown_error_agent")
@pytest.mark.parametrize(("overrides", "reason", "attempts"), [
    ({}, Reason.RETRIES_EXHAUSTED, 2),  # UNKNOWN_ERRORS_RETRYABLE defaults to True
    ({"UNKNOWN_ERRORS_RETRYABLE": False}, Reason.NOT_RETRYABLE, 1),
    ({"CLASSIFIER": "tests.test_retries.permanent_key_errors"}, Reason.NOT_RETRYABLE, 1),
])
def test_unknown_errors_follow_the_settings(
    overrides: dict[str, Any], reason: str, attempts: int
) -> None:
    run = enqueue(UNKNOWN)
    with agentruns(**overrides):
        work()
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.reason, row.attempt) == (Status.FAILED, reason, attempts)
    assert row.error_type == "KeyError"


# --------------------------------------------------------------------------- backoff


def test_backoff_makes_the_run_due_later() -> None:
    run = enqueue("tests.flaky")
    with agentruns(BACKOFF_BASE=30.0, BACKOFF_CAP=300.0, BACKOFF_JITTER=0.0):
        stats = work()
    # The burst worker saw nothing due after the failure, and stopped.
    assert stats.settled == {"requeued": 1}
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.attempt, row.requeue_count) == (Status.QUEUED, 1, 1)
    retrying = RunEvent.objects.get(run_id=run.pk, type=transitions.RETRYING)
    assert retrying.payload["delay"] == 30.0
    assert row.available_at == retrying.created_at + timedelta(seconds=30)

    def claim(seconds_after: float) -> list[AgentRun]:
        return transitions.claim("w", ["default"], 10, ScopePolicy(), {}, 2.0,
                                 at=row.available_at + timedelta(seconds=seconds_after))

    assert claim(-0.001) == []
    assert [r.pk for r in claim(0)] == [run.pk]


def test_backoff_grows_and_keeps_its_jitter_in_bounds() -> None:
    run = enqueue("tests.always_fails")
    delays: list[float] = []
    with agentruns(BACKOFF_BASE=10.0, BACKOFF_CAP=15.0, BACKOFF_JITTER=0.5):
        for _ in range(3):
            # Make the run due now, as if its backoff had passed.
            AgentRun.objects.filter(pk=run.pk).update(available_at=transitions.now())
            work()
            retrying = [e for e in events(run.pk) if e.type == transitions.RETRYING]
            if len(retrying) > len(delays):
                delays.append(retrying[-1].payload["delay"])
    assert len(delays) == 2
    assert 5.0 <= delays[0] <= 10.0  # base 10, half of it may be taken off
    assert 7.5 <= delays[1] <= 15.0  # 20 capped to 15
    assert AgentRun.objects.get(pk=run.pk).reason == Reason.RETRIES_EXHAUSTED


# --------------------------------------------------------------------------- shared budget


def test_stale_reclaims_and_failure_retries_share_one_budget() -> None:
    """A lost attempt counts: abandoned once, then two retryable failures exhaust 2 requeues."""
    run = enqueue("tests.always_fails")  # max_requeues=2
    past = transitions.now() - timedelta(minutes=5)
    AgentRun.objects.filter(pk=run.pk).update(available_at=past)
    [claimed] = transitions.claim("dead-worker", ["default"], 1, ScopePolicy(), {}, 2.0, at=past)
    assert claimed.pk == run.pk  # its worker "died" five minutes ago: the lease lapsed

    stats = work()
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.reason) == (Status.FAILED, Reason.RETRIES_EXHAUSTED)
    assert (row.attempt, row.requeue_count) == (3, 2)
    assert executions(run.pk) == [2, 3]  # attempt 1 never got to run its code here
    assert stats.settled == {"requeued": 1, "dead_lettered": 1}
    kinds = types(run.pk)
    assert kinds.count(transitions.ABANDONED) == 1
    assert kinds.count(transitions.RETRYING) == 2
    assert kinds.count(transitions.DEAD_LETTERED) == 1


def test_a_crashing_run_cannot_loop_forever() -> None:
    """Lost every time (its worker dies): the reclaims alone exhaust the budget."""
    run = enqueue("tests.noop")
    start = transitions.now() - timedelta(hours=1)
    AgentRun.objects.filter(pk=run.pk).update(available_at=start)
    max_requeues = AgentRun.objects.get(pk=run.pk).max_requeues
    for n in range(max_requeues + 5):
        claimed = transitions.claim("doomed", ["default"], 1, ScopePolicy(), {}, 2.0,
                                    at=start + timedelta(minutes=n))
        if not claimed:
            break
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.reason) == (Status.FAILED, Reason.RETRIES_EXHAUSTED)
    assert row.attempt == max_requeues + 1
    assert types(run.pk).count(transitions.ABANDONED) == max_requeues + 1
