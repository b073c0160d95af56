"""Lifecycle signals: one per transition, sent only once the transition has committed."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from django.dispatch import Signal

from django_agentruns import cancel, enqueue, signals, transitions
from django_agentruns.models import AgentRun, Status
from django_agentruns.registry import scope_policy
from django_agentruns.runtime.reaper import reap
from django_agentruns.runtime.worker import Worker

ALL = {
    "enqueued": signals.run_enqueued, "started": signals.run_started,
    "succeeded": signals.run_succeeded, "requeued": signals.run_requeued,
    "dead_lettered": signals.run_dead_lettered, "cancelled": signals.run_cancelled,
    "reaped": signals.run_reaped, "lease_lost": signals.run_lease_lost,
}


@pytest.fixture
def received() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    log: list[tuple[str, dict[str, Any]]] = []
    receivers = []
    for name, signal in ALL.items():
        def receiver(sender: Any, name: str = name, **kwargs: Any) -> None:
            kwargs.pop("signal", None)
            log.append((name, kwargs))
        signal.connect(receiver, weak=False)
        receivers.append((signal, receiver))
    yield log
    for signal, receiver in receivers:
        signal.disconnect(receiver)


def names(log: list[tuple[str, dict[str, Any]]], run_id: int) -> list[str]:
    return [name for name, kwargs in log if kwargs["run_id"] == run_id]


def drain() -> None:
    Worker(["default"], 2, burst=True, reap_interval=0).run(install_signals=False)


@pytest.mark.django_db(transaction=True)
def test_a_run_announces_each_transition_once(received: list[Any]) -> None:
    ok = enqueue("tests.noop", {})
    flaky = enqueue("tests.flaky", {"succeed_on": 2})
    dead = enqueue("tests.not_retryable", {})
    drain()
    assert names(received, ok.pk) == ["enqueued", "started", "succeeded"]
    assert names(received, flaky.pk) == ["enqueued", "started", "requeued", "started",
                                         "succeeded"]
    assert names(received, dead.pk) == ["enqueued", "started", "dead_lettered"]
    (dead_kwargs,) = [k for n, k in received if n == "dead_lettered"]
    assert dead_kwargs == {"run_id": dead.pk, "agent": "tests.not_retryable", "attempt": 1,
                           "reason": "not_retryable",
                           "error_type": "django_agentruns.exceptions.NotRetryable"}


@pytest.mark.django_db(transaction=True)
def test_nothing_is_sent_for_a_rolled_back_enqueue(received: list[Any]) -> None:
    def enqueue_then_fail() -> None:
        with transaction.atomic():
            enqueue("tests.noop", {})
            raise RuntimeError("roll back")

    with pytest.raises(RuntimeError):
        enqueue_then_fail()
    assert received == []


@pytest.mark.django_db(transaction=True)
def test_signals_wait_for_the_commit(received: list[Any]) -> None:
    with transaction.atomic():
        run = enqueue("tests.noop", {})
        assert received == []
    assert names(received, run.pk) == ["enqueued"]


@pytest.mark.django_db(transaction=True)
def test_cancel_of_a_queued_run_announces_it(received: list[Any]) -> None:
    run = enqueue("tests.noop", {})
    cancel(run.pk, reason="not needed")
    assert names(received, run.pk) == ["enqueued", "cancelled"]
    assert received[-1][1]["reason"] == "not needed"


@pytest.mark.django_db(transaction=True)
def test_reaping_announces_the_reclaim_and_its_outcome(received: list[Any]) -> None:
    run = enqueue("tests.noop", {})
    at = transitions.now()
    transitions.claim("gone-worker", ["default"], 1, scope_policy(), {}, 1.0, at=at)
    report = reap(at + timedelta(seconds=5))
    assert report.requeued == [run.pk]
    assert names(received, run.pk) == ["enqueued", "started", "requeued", "reaped"]
    assert received[-1][1]["outcome"] == "requeued"


@pytest.mark.django_db(transaction=True)
def test_a_lost_lease_is_announced_and_nothing_is_recorded(received: list[Any]) -> None:
    run = enqueue("tests.noop", {})
    at = transitions.now()
    (claimed,) = transitions.claim("w1", ["default"], 1, scope_policy(), {}, 1.0, at=at)
    ref = transitions.AttemptRef(claimed.pk, claimed.attempt, "w1", 1.0, agent=claimed.agent)
    # Another worker takes the lapsed run; the first one's settle is fenced off.
    transitions.claim("w2", ["default"], 1, scope_policy(), {}, 1.0,
                      at=at + timedelta(seconds=5))
    from django_agentruns.outcomes import Outcome, OutcomeKind
    from django_agentruns.runtime import recording

    settlement = recording.record(None, ref, Outcome(OutcomeKind.SUCCEEDED, output={}))
    assert settlement is transitions.Settlement.LOST
    assert "lease_lost" in names(received, run.pk)
    assert AgentRun.objects.get(pk=run.pk).status == Status.RUNNING


@pytest.mark.django_db(transaction=True)
def test_a_failing_receiver_does_not_undo_the_transition() -> None:
    def broken(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    signal: Signal = signals.run_succeeded
    signal.connect(broken, weak=False)
    try:
        run = enqueue("tests.noop", {})
        drain()
    finally:
        signal.disconnect(broken)
    assert AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED
