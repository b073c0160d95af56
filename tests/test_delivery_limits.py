"""Payloads delivered for keys a run has not waited for are bounded: past
MAX_DELIVERIES_PER_RUN unread ones `deliver` raises LimitExceeded (a delivery the run's
wait takes always goes), and their events count against MAX_EVENTS_PER_RUN."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import override_settings

from django_agentruns import DeliverResult, deliver, enqueue, transitions
from django_agentruns.exceptions import LimitExceeded
from django_agentruns.models import RunEvent, RunWait, Status
from django_agentruns.runtime.worker import Worker

pytestmark = pytest.mark.django_db(transaction=True)


def agentruns(**overrides: object) -> override_settings:
    return override_settings(AGENTRUNS={**settings.AGENTRUNS, **overrides})


def burst() -> None:
    Worker(queues=["waiting"], burst=True, reap_interval=0).run(install_signals=False)


def test_deliveries_to_keys_never_waited_for_stop_at_the_cap() -> None:
    run = enqueue("tests.waits", {"key": "go"})
    with agentruns(MAX_DELIVERIES_PER_RUN=3):
        for i in range(3):
            assert deliver(run.pk, f"junk-{i}", i) is DeliverResult.STORED
        with pytest.raises(LimitExceeded, match="MAX_DELIVERIES_PER_RUN is 3"):
            deliver(run.pk, "junk-3", 3)
        assert RunWait.objects.filter(run_id=run.pk).count() == 3
        # Delivering again to a key already stored is still ALREADY_DELIVERED, not an error.
        assert deliver(run.pk, "junk-0", 0) is DeliverResult.ALREADY_DELIVERED
        # The key the run waits for is always taken, cap or not.
        burst()
        assert RunWait.objects.get(run_id=run.pk, key="go").waited_at is not None
        assert deliver(run.pk, "go", "yes") is DeliverResult.DELIVERED
        burst()
    assert RunEvent.objects.filter(run_id=run.pk, type=transitions.waiting.DELIVERED).count() \
        == 4


def test_stored_deliveries_count_against_the_events_cap() -> None:
    run = enqueue("tests.waits")
    with agentruns(MAX_EVENTS_PER_RUN=5):
        for i in range(10):
            assert deliver(run.pk, f"k{i}", i) is DeliverResult.STORED
    assert RunEvent.objects.filter(run_id=run.pk).count() == 5
    assert RunWait.objects.filter(run_id=run.pk).count() == 10  # the payloads are kept
    assert run.status == Status.QUEUED
