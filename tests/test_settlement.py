"""Guarantee 3, exactly one settlement: every run ends in one terminal state, recorded once,
however many writers try to settle it at the same moment."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import pytest
from django.db import close_old_connections, connection

from django_agentruns import CancelResult, cancel, enqueue, retry, transitions
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.rules import policy
from django_agentruns.runtime.worker import Worker
from django_agentruns.states import TERMINAL
from django_agentruns.transitions import AttemptRef, ErrorInfo, ScopePolicy, Settlement

TERMINAL_EVENTS = {
    Status.SUCCEEDED: transitions.SUCCEEDED,
    Status.FAILED: transitions.DEAD_LETTERED,
    Status.CANCELLED: transitions.CANCELLED,
}


def assert_settled_once(run_id: int) -> None:
    """One terminal event per settlement, the last one matching the row's status.

    A run settles again only after an operator retry (`run.retried`), so terminal events
    and retries alternate: terminal, retried, terminal, ...
    """
    row = AgentRun.objects.get(pk=run_id)
    assert row.status in TERMINAL
    kinds = [t for t in RunEvent.objects.filter(run_id=run_id).order_by("seq")
             .values_list("type", flat=True)
             if t in (*TERMINAL_EVENTS.values(), transitions.RETRIED)]
    retries = kinds.count(transitions.RETRIED)
    assert len(kinds) == 2 * retries + 1, kinds
    assert all(k == transitions.RETRIED for k in kinds[1::2]), kinds
    assert all(k != transitions.RETRIED for k in kinds[0::2]), kinds
    assert kinds[-1] == TERMINAL_EVENTS[Status(row.status)], (row.status, kinds)
    assert row.finished_at is not None
    assert row.lease_expires is None


@pytest.mark.django_db(transaction=True)
def test_guarantee_3_exactly_one_settlement() -> None:
    runs = {
        "noop": enqueue("tests.noop"),
        "steps": enqueue("tests.steps", {"steps": 2}),
        "flaky": enqueue("tests.flaky"),
        "always_fails": enqueue("tests.always_fails"),
        "not_retryable": enqueue("tests.not_retryable"),
        "bad_output": enqueue("tests.bad_output"),
        "async": enqueue("tests.async_steps"),
        "cancelled_queued": enqueue("tests.noop"),
    }
    assert cancel(runs["cancelled_queued"].pk) is CancelResult.CANCELLED
    Worker(burst=True, concurrency=4).run(install_signals=False)

    expected = {
        "noop": Status.SUCCEEDED, "steps": Status.SUCCEEDED, "flaky": Status.SUCCEEDED,
        "async": Status.SUCCEEDED, "always_fails": Status.FAILED,
        "not_retryable": Status.FAILED, "bad_output": Status.FAILED,
        "cancelled_queued": Status.CANCELLED,
    }
    for name, run in runs.items():
        assert AgentRun.objects.get(pk=run.pk).status == expected[name], name
        assert_settled_once(run.pk)

    # An operator retry starts a second life; it too ends in exactly one settlement.
    for name in ("always_fails", "not_retryable", "cancelled_queued"):
        assert retry(runs[name].pk, by="operator") is True
        assert retry(runs[name].pk, by="operator") is False  # queued now: nothing to retry
    Worker(burst=True).run(install_signals=False)
    for run in runs.values():
        assert_settled_once(run.pk)
    assert AgentRun.objects.get(pk=runs["cancelled_queued"].pk).status == Status.SUCCEEDED


@pytest.mark.django_db
def test_a_settled_run_settles_no_more() -> None:
    run = enqueue("tests.noop")
    [claimed] = transitions.claim("w", ["default"], 1, ScopePolicy(), {}, 2.0)
    ref = AttemptRef(run.pk, claimed.attempt, "w", 2.0)
    assert transitions.settle_succeeded(ref, {"first": True}) is Settlement.SUCCEEDED
    error = ErrorInfo("E", "late", "")
    assert transitions.settle_succeeded(ref, {"second": True}) is Settlement.LOST
    assert transitions.settle_failed(ref, policy.Failure(False), error) is Settlement.LOST
    assert transitions.settle_failed(ref, policy.Failure(True), error) is Settlement.LOST
    assert transitions.settle_cancelled(ref) is Settlement.LOST
    assert transitions.abandon(ref, "late") is Settlement.LOST
    assert cancel(run.pk) is CancelResult.NOT_CANCELLABLE
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.output, row.reason, row.error_type) == ({"first": True}, Reason.COMPLETED, "")
    assert_settled_once(run.pk)


# --------------------------------------------------------------------------- concurrency


def race(*writers: Callable[[], Settlement]) -> list[Settlement]:
    """Start the writers at the same instant, each on its own connection (thread)."""
    barrier = threading.Barrier(len(writers))
    results: list[Settlement | BaseException | None] = [None] * len(writers)

    def run(i: int, write: Callable[[], Settlement]) -> None:
        try:
            barrier.wait(timeout=10)
            results[i] = write()
        except BaseException as exc:
            results[i] = exc
        finally:
            close_old_connections()
            connection.close()

    threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [r for r in results if isinstance(r, Settlement)]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("rounds", [25])
def test_concurrent_settlements_exactly_one_wins(rounds: int) -> None:
    """settle_succeeded, settle_failed (dead letter), settle_cancelled and abandon, all with
    the same fence, at once: one of them happens, the others find the run settled."""
    error = ErrorInfo("PermissionError", "denied", "")
    runs = [enqueue("tests.noop") for _ in range(rounds)]
    when = transitions.now()
    claimed = transitions.claim("w", ["default"], rounds, ScopePolicy(), {}, 60.0, at=when)
    assert len(claimed) == rounds
    later = when + timedelta(seconds=1)
    winners: Counter[Settlement] = Counter()
    for row in claimed:
        ref = AttemptRef(row.pk, row.attempt, "w", 60.0)
        results = race(
            partial(transitions.settle_succeeded, ref, {"ok": True}, at=later),
            partial(transitions.settle_failed, ref, policy.Failure(False), error, at=later),
            partial(transitions.settle_cancelled, ref, at=later),
            partial(transitions.abandon, ref, "stopping", at=later),
        )
        won = [r for r in results if r is not Settlement.LOST]
        assert len(won) == 1, results
        winners[won[0]] += 1
        settled = AgentRun.objects.get(pk=row.pk)
        expected_status = {
            Settlement.SUCCEEDED: Status.SUCCEEDED, Settlement.DEAD_LETTERED: Status.FAILED,
            Settlement.CANCELLED: Status.CANCELLED, Settlement.REQUEUED: Status.QUEUED,
        }[won[0]]
        assert settled.status == expected_status
        kinds = list(RunEvent.objects.filter(run_id=row.pk).order_by("seq")
                     .values_list("type", flat=True))
        lifecycle = [k for k in kinds if k != transitions.STARTED]
        assert lifecycle == {
            Settlement.SUCCEEDED: [transitions.SUCCEEDED],
            Settlement.DEAD_LETTERED: [transitions.DEAD_LETTERED],
            Settlement.CANCELLED: [transitions.CANCELLED],
            Settlement.REQUEUED: [transitions.ABANDONED, transitions.RETRYING],
        }[won[0]]
    assert sum(winners.values()) == len(runs)


@pytest.mark.django_db(transaction=True)
def test_settle_racing_a_reclaim_exactly_one_wins() -> None:
    """The owner settles just as its lapsed run is reaped or claimed by another worker."""
    rounds = 20
    for r in range(rounds):
        queue = f"race-{r}"  # each round on its own queue: earlier rounds stay out of it
        start = transitions.now() - timedelta(seconds=10)  # the lease lapsed 8 s ago
        run = enqueue("tests.noop", queue=queue, run_after=start)
        [claimed] = transitions.claim("A", [queue], 1, ScopePolicy(), {}, 2.0, at=start)
        ref = AttemptRef(run.pk, claimed.attempt, "A", 2.0)
        reclaim = reclaim_by_claim if r % 2 else reclaim_by_reap
        results = race(partial(transitions.settle_succeeded, ref, {}),
                       partial(reclaim, run.pk, queue))
        won = [x for x in results if x is not Settlement.LOST]
        assert len(won) == 1, results
        kinds = list(RunEvent.objects.filter(run_id=run.pk).values_list("type", flat=True))
        if results[0] is Settlement.SUCCEEDED:
            assert AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED
            assert transitions.ABANDONED not in kinds
        else:
            assert kinds.count(transitions.ABANDONED) == 1
            assert transitions.SUCCEEDED not in kinds


def reclaim_by_claim(run_id: int, queue: str) -> Settlement:
    got = transitions.claim("B", [queue], 1, ScopePolicy(), {}, 2.0)
    return Settlement.REQUEUED if [r.pk for r in got] == [run_id] else Settlement.LOST


def reclaim_by_reap(run_id: int, queue: str) -> Settlement:
    at = transitions.now()
    rows = [row for row in transitions.find_stale(at, 1000) if row["id"] == run_id]
    return transitions.reap_one(rows[0], at) if rows else Settlement.LOST
