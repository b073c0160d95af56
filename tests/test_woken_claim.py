"""A worker's pass after a wake-up claims on its views as they are (issue 30's start
latency): the views of paused queues, fair shares and limits are read by the loop's chores
on a pass that starts no run, not in front of the claim of a run just enqueued. A stale
view only delays a run: the claim statement itself refuses a paused queue and keeps a
limited key's runs out of the ordinary claim."""

from __future__ import annotations

import math

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_agentruns import enqueue, pause_queue, set_limit, transitions
from django_agentruns.models import FairGroup
from django_agentruns.queues import PausedSet
from django_agentruns.registry import scope_policy
from django_agentruns.runtime.chores import Chores
from django_agentruns.transitions.fair import FairClaim
from django_agentruns.transitions.limited import LimitedClaim


def views() -> tuple[PausedSet, FairClaim, LimitedClaim]:
    """Each view read once (nothing paused, no keyed group, no limits row), then due again
    at once: `refresh=0`."""
    paused, fair, limited = PausedSet(refresh=0.0), FairClaim(refresh=0.0), LimitedClaim(0.0)
    assert (paused.active(["default"]), fair.on(), limited.in_use()) == (["default"], False,
                                                                           False)
    return paused, fair, limited


def test_a_woken_claim_reads_no_view_however_old(db: None) -> None:
    paused, fair, limited = views()
    pause_queue("default")
    FairGroup.objects.create(queue="default", key="tenant-a")
    set_limit("provider:x", max_running=1)
    with CaptureQueriesContext(connection) as queries:
        seen = (paused.active(["default"], fresh=False), fair.on(fresh=False),
                limited.in_use(fresh=False))
    assert queries.captured_queries == []
    assert seen == (["default"], False, False)  # as they were
    # A fresh pass reads each again and sees the changes.
    assert (paused.active(["default"]), fair.on(), limited.in_use()) == ([], True, True)


def test_a_stale_paused_view_lets_no_run_of_a_paused_queue_start(db: None) -> None:
    paused, _, _ = views()
    enqueue("tests.noop")
    pause_queue("default")
    queues = paused.active(["default"], fresh=False)
    assert queues == ["default"]  # the view has not seen the pause
    assert transitions.claim("w", queues, 10, scope_policy(), {}, 2.0) == []


def test_the_chores_read_the_views_and_say_when_they_are_late(db: None) -> None:
    paused, fair, limited = views()
    chores = Chores("w", 0.0, lambda reaped: None, None,
                    (paused.read_if_due, fair.on, limited.in_use))
    assert chores.late()  # never ticked: the first pass ticks first
    pause_queue("default")
    FairGroup.objects.create(queue="default", key="tenant-a")
    assert chores.tick() == 0  # no reaper (interval 0), no schedules: nothing queued
    assert not chores.late()
    # What the chores read is what the next woken claim trusts.
    assert (paused.active(["default"], fresh=False), fair.on(fresh=False)) == ([], True)
    chores._ticked = -math.inf  # as if two seconds had passed
    assert chores.late()


@pytest.mark.parametrize("fresh", [True, False])
def test_a_limited_keys_runs_wait_for_the_limited_claim_whatever_the_view(
        db: None, fresh: bool) -> None:
    _, _, limited = views()
    set_limit("provider:x", max_running=1)
    enqueue("tests.noop", limit_key="provider:x")
    if limited.in_use(fresh=fresh):
        assert len(limited.claim("w", ["default"], 10, scope_policy(), {}, 2.0, None)) == 1
    else:  # a stale view: the ordinary claim leaves the key's run for the limited one
        assert transitions.claim("w", ["default"], 10, scope_policy(), {}, 2.0) == []
