"""Guarantee 5: firing order per scope, and a scope's backlog takes one place in a claim.

The due query (`transitions.due_queued`) returns only runs that can start: for an ordered
agent, a run whose scope has no earlier holder (queued, running, or dead-lettered where the
agent says dead letters block). The claim re-checks the order under lock and stays the
authority. A running run whose lease lapsed is due wherever it stands.
"""

from __future__ import annotations

import random
from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_agentruns import RunRequest, enqueue, enqueue_many, transitions
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.registry import scope_policy
from django_agentruns.rules import policy
from django_agentruns.runtime.worker import Worker
from django_agentruns.transitions import AttemptRef, claiming, due, due_queued
from tests import helpers
from tests.testapp.models import SideEffect

ORDERED = "tests.ordered"
BLOCKING = "tests.ordered_blocking"
QUEUES = ["default"]


def claim(limit: int = 10, at: datetime | None = None, worker: str = "w-test",
          ttl: float = 2.0) -> list[AgentRun]:
    return transitions.claim(worker, QUEUES, limit, scope_policy(), {}, ttl, at=at)


def claimed_ids(limit: int = 10, at: datetime | None = None) -> list[int]:
    return [r.pk for r in claim(limit, at)]


def succeed(run: AgentRun, worker: str = "w-test") -> None:
    ref = AttemptRef(run.pk, run.attempt, worker, 2.0)
    assert transitions.settle_succeeded(ref, {"ok": True}) is transitions.Settlement.SUCCEEDED


def due_ids() -> list[int]:
    return [r.pk for r in due_queued(QUEUES, timezone.now(), scope_policy())]


def firing_order(runs: list[AgentRun]) -> list[int]:
    return [r.pk for r in sorted(runs, key=lambda r: (r.fired_seq, r.pk))]


def execution_order(scope: str) -> list[int]:
    """Runs of a scope in the order their agent code ran (SideEffect ids are monotonic)."""
    return list(SideEffect.objects.filter(note=scope).order_by("id")
                .values_list("run_id", flat=True))


# --------------------------------------------------------------------------- the guarantee


def test_guarantee_5_firing_order_per_scope(worker_env: dict[str, str]) -> None:
    """Two worker processes, three slots each: every scope runs strictly in firing order.

    Runs are inserted in a shuffled order with shuffled (and tied) fired_seq values, and
    due times that fall as fired_seq rises, so neither id order nor due order is firing order.
    """
    rng = random.Random(5)
    now = timezone.now()
    # available_at falls as fired_seq rises: claim order without the ordering rule
    # (priority, available_at, ...) would be the reverse of firing order.
    requests = [RunRequest(ORDERED, {"n": i}, scope=f"s{s}", fired_seq=seq,
                           run_after=now - timedelta(seconds=seq))
                for s in range(4) for i, seq in enumerate(rng.randint(0, 5) for _ in range(8))]
    rng.shuffle(requests)
    runs = enqueue_many(requests)

    workers = [helpers.start_manage(["runworker", "--burst", "--concurrency", "3"], worker_env)
               for _ in range(2)]
    for w in workers:
        assert w.wait(60) == 0, w.output()

    assert set(AgentRun.objects.values_list("status", flat=True)) == {Status.SUCCEEDED}
    by_scope: dict[str, list[AgentRun]] = defaultdict(list)
    for run in runs:
        by_scope[run.scope].append(run)
    for scope, scope_runs in by_scope.items():
        assert execution_order(scope) == firing_order(scope_runs), scope


def test_claims_follow_firing_order_then_id(db: None) -> None:
    """Step by step: each claim yields exactly the scope's next run by (fired_seq, id)."""
    runs = [enqueue(ORDERED, {"n": i}, scope="s", fired_seq=seq)
            for i, seq in enumerate([5, 1, 3, 1, 0])]
    expected = firing_order(runs)
    seen = []
    while batch := claim():
        assert len(batch) == 1
        seen.append(batch[0].pk)
        succeed(batch[0])
    assert seen == expected


def test_other_scopes_run_in_parallel(transactional_db: None) -> None:
    """The first run of each of three scopes must all be running at once to succeed."""
    scopes = ["a", "b", "c"]
    runs = enqueue_many(
        [RunRequest("tests.ordered_barrier", {"n": 0, "expect": 3, "wait": 10}, scope=s)
         for s in scopes]
        + [RunRequest("tests.ordered_barrier", {"n": 1}, scope=s, fired_seq=1) for s in scopes])

    Worker(concurrency=3, burst=True, reap_interval=0).run(install_signals=False)

    statuses = dict(AgentRun.objects.values_list("id", "status"))
    assert set(statuses.values()) == {Status.SUCCEEDED}, statuses
    starts = {r.pk: r for r in runs}
    for scope in scopes:
        order = [starts[i].input["n"] for i in SideEffect.objects.filter(
            run_id__in=[r.pk for r in runs if r.scope == scope]).order_by("id")
            .values_list("run_id", flat=True)]
        assert order == [0, 1], scope


# --------------------------------------------------------------------------- what holds a scope


def test_a_queued_run_backing_off_still_holds_its_scope(db: None) -> None:
    later = enqueue(ORDERED, scope="s", fired_seq=2)
    backing_off = enqueue(ORDERED, scope="s", fired_seq=1, run_after=60)
    other = enqueue(ORDERED, scope="t")

    assert due_ids() == [other.pk]
    [claimed] = claim()
    assert claimed.pk == other.pk
    succeed(claimed)
    assert claim() == []
    assert AgentRun.objects.get(pk=later.pk).status == Status.QUEUED

    # Once its backoff is over, the earlier run goes first, then the later one.
    at = timezone.now() + timedelta(seconds=61)
    assert claimed_ids(at=at) == [backing_off.pk]


def test_a_running_run_holds_its_scope(db: None) -> None:
    first = enqueue(ORDERED, scope="s", fired_seq=1)
    second = enqueue(ORDERED, scope="s", fired_seq=2)

    [running] = claim()
    assert running.pk == first.pk
    assert due_ids() == []
    assert claim() == []

    succeed(running)
    assert claimed_ids() == [second.pk]


def dead_letter(agent: str, scope: str) -> AgentRun:
    """A run of `agent` in `scope`, dead-lettered through a real attempt."""
    run = enqueue(agent, scope=scope, fired_seq=1)
    [claimed] = claim()
    assert claimed.pk == run.pk
    ref = AttemptRef(run.pk, claimed.attempt, "w-test", 2.0)
    failure = policy.Failure(retryable=False)
    error = transitions.ErrorInfo("NotRetryable", "told to fail", "")
    assert transitions.settle_failed(ref, failure, error) is transitions.Settlement.DEAD_LETTERED
    return AgentRun.objects.get(pk=run.pk)


def test_a_dead_letter_blocks_its_scope_only_where_the_agent_says(db: None) -> None:
    blocked_dead = dead_letter(BLOCKING, "s")
    assert blocked_dead.is_dead_letter
    blocked = enqueue(BLOCKING, scope="s", fired_seq=2)
    assert due_ids() == []
    assert claim() == []
    assert AgentRun.objects.get(pk=blocked.pk).status == Status.QUEUED

    dead = dead_letter(ORDERED, "t")
    assert dead.reason == Reason.NOT_RETRYABLE
    free = enqueue(ORDERED, scope="t", fired_seq=2)
    assert due_ids() == [free.pk]
    assert claimed_ids() == [free.pk]

    # An operator's retry puts the dead letter back in line, ahead of the run it blocked.
    transitions.operator_retry(blocked_dead.pk)
    assert claimed_ids() == [blocked_dead.pk]


def test_finished_runs_do_not_hold_a_scope(db: None) -> None:
    done = enqueue(BLOCKING, scope="s", fired_seq=1)
    cancelled = enqueue(BLOCKING, scope="s", fired_seq=2)
    last = enqueue(BLOCKING, scope="s", fired_seq=3)
    [run] = claim()
    assert run.pk == done.pk
    succeed(run)
    transitions.cancel(cancelled.pk)
    assert claimed_ids() == [last.pk]


def test_unordered_agents_ignore_firing_order(db: None) -> None:
    runs = [enqueue("tests.noop", scope="s", fired_seq=n) for n in (3, 2, 1)]
    assert sorted(claimed_ids()) == sorted(r.pk for r in runs)


def test_a_lapsed_running_run_is_due_wherever_it_stands(db: None) -> None:
    """Its claim records the abandoned attempt without checking the order."""
    lapsed = enqueue(ORDERED, scope="s", fired_seq=2)
    [running] = claim(ttl=1.0)
    assert running.pk == lapsed.pk
    # An earlier run of the scope appears behind it (an operator's retry, say), still
    # backing off: it holds the scope for queued runs, not for the lapsed one.
    earlier = enqueue(ORDERED, scope="s", fired_seq=1, run_after=60)

    at = timezone.now() + timedelta(seconds=5)
    [reclaimed] = claim(at=at, worker="w-other")
    assert reclaimed.pk == lapsed.pk
    assert reclaimed.attempt == 2
    assert reclaimed.claimed_by == "w-other"
    assert RunEvent.objects.filter(run_id=lapsed.pk, type=transitions.ABANDONED).count() == 1
    assert AgentRun.objects.get(pk=earlier.pk).status == Status.QUEUED


# --------------------------------------------------------------------------- no starvation


def test_a_scopes_backlog_does_not_starve_other_scopes(db: None) -> None:
    """150 runs waiting in one scope, one run fired last in another: the first claim takes it."""
    backlog = enqueue_many([RunRequest(ORDERED, {"n": i}, scope="big", fired_seq=i)
                            for i in range(150)])
    starved = enqueue(ORDERED, scope="small", fired_seq=1000)

    first = claimed_ids(limit=10)
    assert sorted(first) == sorted([backlog[0].pk, starved.pk])


def test_a_scopes_backlog_takes_one_place_in_a_claim(db: None) -> None:
    heads = []
    for s in range(5):
        runs = enqueue_many([RunRequest(ORDERED, scope=f"s{s}", fired_seq=i) for i in range(20)])
        heads.append(runs[0].pk)
    assert sorted(due_ids()) == sorted(heads)

    batch = claim(limit=3)
    assert len({r.scope for r in batch}) == 3
    assert {r.pk for r in batch} <= set(heads)
    rest = claimed_ids(limit=10)
    assert sorted([r.pk for r in batch] + rest) == sorted(heads)


def test_the_claim_rechecks_order_when_handed_a_run_that_is_held(db: None) -> None:
    """A stale candidate list (another worker's snapshot) cannot start a held run."""
    first = enqueue(ORDERED, scope="s", fired_seq=1)
    second = enqueue(ORDERED, scope="s", fired_seq=2)
    rows = list(AgentRun.objects.filter(pk__in=[first.pk, second.pk]).order_by("fired_seq")
                .values(*due.CLAIM_FIELDS))
    kept = due.recheck_order(rows, scope_policy())
    assert [r["id"] for r in kept] == [first.pk]
    kept = due.recheck_order(rows[1:], scope_policy())
    assert kept == []


@pytest.mark.postgres_only  # SQLite's claim holds the write lock: no retry lands inside it
def test_a_run_a_stale_snapshot_started_out_of_order_is_put_back(
    db: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PostgreSQL: the claim's one statement ran on a snapshot in which the scope's earlier
    run was not holding it (cancelled); before the claim's re-check, an operator retry put
    that run back in the queue. The later run must not start: it goes back as it was."""
    earlier = enqueue(ORDERED, scope="s", fired_seq=1)
    later = enqueue(ORDERED, scope="s", fired_seq=2)
    # A previous attempt of the later run, so there is a start time to restore.
    before = timezone.now() - timedelta(minutes=5)
    AgentRun.objects.filter(pk=later.pk).update(attempt=1, requeue_count=1, started_at=before)
    assert transitions.cancel(earlier.pk) is transitions.CancelResult.CANCELLED
    real_due = claiming._claim_due_returning

    def due_then_retried(*args: Any, **kwargs: Any) -> list[AgentRun]:
        started = real_due(*args, **kwargs)
        assert transitions.operator_retry(earlier.pk, by="ops") is True
        return started

    monkeypatch.setattr(claiming, "_claim_due_returning", due_then_retried)

    assert claim(at=timezone.now() + timedelta(seconds=1)) == []
    row = AgentRun.objects.get(pk=later.pk)
    assert (row.status, row.attempt, row.claimed_by, row.lease_expires, row.started_at) == (
        Status.QUEUED, 1, "", None, before)
    assert not RunEvent.objects.filter(run_id=later.pk, type=transitions.STARTED).exists()
    # The retried earlier run is next, then the later one.
    monkeypatch.undo()
    assert claimed_ids(at=timezone.now() + timedelta(seconds=2)) == [earlier.pk]
