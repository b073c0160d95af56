"""A retry's delay, whoever asks for it (`Retryable(delay=)`, a Retry-After header), is
capped at MAX_DELAY_SECONDS: an infinite or huge one cannot crash the settle (which left
the run to be reaped as abandoned, its budget spent); a NaN one is ignored."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_agentruns import enqueue, transitions
from django_agentruns.exceptions import MAX_DELAY_SECONDS, Retryable
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.rules.policy import Failure, bounded_delay, classify, decide
from django_agentruns.runtime.worker import Worker

pytestmark = pytest.mark.django_db(transaction=True)


def burst() -> None:
    Worker(burst=True, reap_interval=0).run(install_signals=False)


@pytest.mark.parametrize("asked", [
    {"delay": "inf"}, {"delay": "1e300"}, {"retry_after": "inf"}, {"retry_after": "1e300"},
    {"retry_after": "99999999999999999999"},
])
def test_an_unbounded_delay_requeues_the_run_a_week_later(asked: dict[str, Any]) -> None:
    before = timezone.now()
    run = enqueue("tests.asks_a_delay", asked)
    burst()
    row = AgentRun.objects.get(pk=run.pk)
    assert row.status == Status.QUEUED, (row.status, row.error_type, row.error_message)
    assert not RunEvent.objects.filter(run_id=run.pk, type=transitions.ABANDONED).exists()
    due_in = row.available_at - before
    assert timedelta(seconds=MAX_DELAY_SECONDS) <= due_in \
        <= timedelta(seconds=MAX_DELAY_SECONDS + 60)


def test_a_nan_delay_is_ignored_and_the_backoff_decides() -> None:
    run = enqueue("tests.asks_a_delay", {"delay": "nan"})
    burst()
    row = AgentRun.objects.get(pk=run.pk)  # the tests' backoff is 0: retried at once
    assert (row.status, row.reason, row.requeue_count) == (Status.FAILED, "retries_exhausted", 2)
    assert RunEvent.objects.filter(run_id=run.pk, type=transitions.RETRYING).count() == 2


@pytest.mark.parametrize(("value", "bounded"), [
    (float("inf"), MAX_DELAY_SECONDS), (1e300, MAX_DELAY_SECONDS), (-5, 0.0),
    (float("-inf"), 0.0), (float("nan"), None), ("10", None), (True, None), (2.5, 2.5),
])
def test_bounded_delay(value: Any, bounded: float | None) -> None:
    assert bounded_delay(value) == bounded


def test_decide_never_returns_an_unbounded_delay() -> None:
    decision = decide(Failure(retryable=True, delay=float("inf")), requeue_count=0,
                      max_requeues=3, cancel_requested=False, backoff_delay=lambda n: 1.0)
    assert decision.delay == MAX_DELAY_SECONDS
    assert classify(Retryable(delay=float("inf"))).delay == MAX_DELAY_SECONDS
