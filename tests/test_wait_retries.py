"""An operator's retry of a run that failed because its wait timed out opens the wait
afresh: the retried attempt waits again (its timeout counted from then), and a delivery
then finishes it. It used to fail again at once with WaitTimedOut."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from django_agentruns import DeliverResult, deliver, enqueue, retry
from django_agentruns.models import AgentRun, Reason, Status
from django_agentruns.runtime.reaper import reap
from django_agentruns.runtime.worker import Worker
from tests import helpers

pytestmark = pytest.mark.django_db(transaction=True)


def burst() -> None:
    Worker(queues=["waiting"], burst=True, reap_interval=0).run(install_signals=False)


def row(run_id: int) -> AgentRun:
    return AgentRun.objects.get(pk=run_id)


def test_a_retry_after_a_wait_timed_out_waits_again() -> None:
    run = enqueue("tests.waits", {"timeout": 1})
    burst()
    deadline = row(run.pk).wait_until
    assert deadline is not None
    helpers.wait_until(lambda: timezone.now() > deadline, message="the wait's deadline")
    assert reap().wait_timeouts == [run.pk]
    burst()
    failed = row(run.pk)
    assert (failed.status, failed.reason) == (Status.FAILED, Reason.NOT_RETRYABLE)
    assert failed.error_type.endswith("WaitTimedOut")

    assert retry(run.pk, by="ops") is True
    retried_at = timezone.now()
    burst()
    waiting = row(run.pk)
    assert waiting.status == Status.WAITING, (waiting.status, waiting.error_message)
    assert waiting.wait_until is not None
    assert waiting.wait_until >= retried_at + timedelta(seconds=0.9)
    assert deliver(run.pk, "go", {"n": 1}) is DeliverResult.DELIVERED
    burst()
    done = row(run.pk)
    assert (done.status, done.output) == (Status.SUCCEEDED, {"got": {"n": 1}})
