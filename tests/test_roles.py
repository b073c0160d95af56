"""The worker's roles, each on its own: the live set, the lease keeper, the executor.

No worker runs here: each role is built alone and driven directly, against the
database where it writes.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from django.db import connection

from django_agentruns import cancel, transitions
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.outcomes import AttemptRef, OutcomeKind, Settlement, StopReason
from django_agentruns.registry import get_agent
from django_agentruns.runtime.attempt_store import AttemptStore
from django_agentruns.runtime.control import AttemptControl
from django_agentruns.runtime.executor import Executor
from django_agentruns.runtime.lease_keeper import LeaseKeeper
from django_agentruns.runtime.running import Live, LiveAttempts
from tests.test_lease import claim_one, lease, steal


def live_of(run: AgentRun, ref: AttemptRef, *, timeout: float | None = None,
            renewed: float | None = None) -> Live:
    control = AttemptControl(ref, timeout, run.checkpoint_count)
    return Live(run, get_agent(run.agent), control,
                time.monotonic() if renewed is None else renewed)


# --------------------------------------------------------------------------- LiveAttempts


def test_live_attempts_add_discard_and_snapshot() -> None:
    runs = [AgentRun(pk=n, agent="tests.noop") for n in (1, 2)]
    lives = [live_of(r, AttemptRef(r.pk, 1, "w", 2.0)) for r in runs]
    live = LiveAttempts()
    for lv in lives:
        live.add(lv)
    assert len(live) == 2
    snapshot = live.snapshot()
    live.discard(lives[0])
    assert len(live) == 1
    assert len(snapshot) == 2
    # A newer attempt of the same run is not removed by the old one's discard.
    newer = live_of(runs[1], AttemptRef(2, 2, "w", 2.0))
    live.add(newer)
    live.discard(lives[1])
    assert live.snapshot() == [newer]


def test_live_attempts_are_safe_across_threads() -> None:
    live = LiveAttempts()
    lives = [live_of(AgentRun(pk=n, agent="tests.noop"), AttemptRef(n, 1, "w", 2.0))
             for n in range(400)]

    def churn(part: list[Live]) -> None:
        for lv in part:
            live.add(lv)
            live.snapshot()
        for lv in part:
            live.discard(lv)

    threads = [threading.Thread(target=churn, args=(lives[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(live) == 0


# --------------------------------------------------------------------------- LeaseKeeper


@pytest.mark.django_db(transaction=True)
def test_keeper_renews_a_third_spent_lease_and_no_fresh_one() -> None:
    run, ref = claim_one("tests.noop", at=transitions.now())
    keeper = LeaseKeeper("w1", LiveAttempts())
    before = lease(run.pk)
    fresh = live_of(run, ref)
    keeper.tick([fresh])
    assert lease(run.pk) == before  # not a third of its TTL spent yet
    spent = time.monotonic() - ref.lease_ttl  # type: ignore[operator]
    stale = live_of(run, ref, renewed=spent)
    now = time.monotonic()
    keeper.tick([stale], now=now)
    assert lease(run.pk) > before  # type: ignore[operator]
    assert stale.last_renewed == now
    assert stale.control.stop_reason is None


def test_a_start_wakes_the_keeper_only_if_its_lease_falls_due_before_the_next_pass() -> None:
    """An idle keeper looks every half second: a new attempt with a short lease, or one
    whose claim was slow, must not wait that out for its first renewal."""
    run = AgentRun(pk=1, agent="tests.noop", attempt=1)
    keeper = LeaseKeeper("w1", LiveAttempts())
    keeper._next_pass = time.monotonic() + 0.5  # as an idle keeper's wait sets it
    keeper.started(live_of(run, AttemptRef(1, 1, "w1", 60.0)))
    keeper.started(live_of(run, AttemptRef(1, 1, "w1", None)))  # interactive: no lease
    assert not keeper._wake.is_set()
    keeper.started(live_of(run, AttemptRef(1, 1, "w1", 1.0)))  # due in a third of a second
    assert keeper._wake.is_set()
    keeper._wake.clear()
    keeper.started(live_of(run, AttemptRef(1, 1, "w1", 6.0), renewed=time.monotonic() - 1.9))
    assert keeper._wake.is_set()  # a long lease, but its claim took most of a third of it


@pytest.mark.django_db(transaction=True)
def test_keeper_turns_a_lost_lease_and_a_cancel_into_stops() -> None:
    lost_run, lost_ref = claim_one("tests.noop", at=transitions.now())
    gone = live_of(lost_run, lost_ref, renewed=0.0)
    steal(lost_run.pk)
    cancelled_run, cancelled_ref = claim_one("tests.noop", at=transitions.now())
    asked = live_of(cancelled_run, cancelled_ref, renewed=0.0)
    cancel(cancelled_run.pk)
    LeaseKeeper("w1", LiveAttempts()).tick([gone, asked])
    assert gone.control.stop_reason is StopReason.LEASE_LOST
    assert asked.control.stop_reason is StopReason.CANCELLED
    assert AgentRun.objects.get(pk=lost_run.pk).claimed_by == "thief"  # untouched


@pytest.mark.django_db(transaction=True)
def test_keeper_stops_a_timed_out_attempt_and_lets_a_stuck_one_lapse() -> None:
    run, ref = claim_one("tests.noop", at=transitions.now())
    lv = live_of(run, ref, timeout=0.01, renewed=0.0)
    time.sleep(0.02)  # past its deadline (a deadline, not a wait for another thread)
    keeper = LeaseKeeper("w1", LiveAttempts())
    before = lease(run.pk)
    keeper.tick([lv], now=lv.control.deadline + 0.001)  # type: ignore[operator]
    assert lv.control.stop_reason is StopReason.TIMEOUT
    assert lease(run.pk) > before  # type: ignore[operator]  # still renewed: it may yet stop
    renewed = lease(run.pk)
    # A third of the TTL past the deadline and still running: no more renewals.
    keeper.tick([lv], now=lv.control.deadline + ref.lease_ttl)  # type: ignore[operator]
    assert lease(run.pk) == renewed


@pytest.mark.django_db(transaction=True)
def test_keeper_thread_renews_what_the_live_set_holds_until_stopped() -> None:
    run, ref = claim_one("tests.sleeper", at=transitions.now())  # TTL 1 s
    live = LiveAttempts()
    live.add(live_of(run, ref, renewed=0.0))
    keeper = LeaseKeeper("w1", live)
    before = lease(run.pk)
    keeper.start()
    try:
        from tests import helpers

        helpers.wait_until(lambda: lease(run.pk) != before, message="the keeper renewed")
    finally:
        keeper.stop()
    assert not keeper._thread.is_alive()  # type: ignore[union-attr]


# --------------------------------------------------------------------------- Executor


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("agent", ["tests.steps", "tests.async_steps"])
def test_executor_runs_one_attempt_and_records_it(agent: str) -> None:
    run, ref = claim_one(agent, at=transitions.now())
    executor = Executor("w1")
    try:
        settlement = executor.run(run, get_agent(agent), AttemptControl(ref, None, 0))
    finally:
        executor.close()
    assert settlement is Settlement.SUCCEEDED
    assert AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("agent", ["tests.steps", "tests.async_steps"])
def test_executor_writes_every_write_of_an_attempt_through_its_store(agent: str) -> None:
    """Events, checkpoints and the settle all go through the store: the attempt's own
    thread (or coroutine) opens no connection."""
    run, ref = claim_one(agent, at=transitions.now())
    store = AttemptStore(1)
    executor = Executor("w1", store=store)
    opened: list[bool] = []

    def attempt() -> None:
        control = executor.control(ref, None, 0)
        if get_agent(agent).is_async:
            loop = executor.ensure_loop()
            asyncio.run_coroutine_threadsafe(
                executor.arun(run, get_agent(agent), control), loop).result(30)
        else:
            executor.run(run, get_agent(agent), control)
        opened.append(connection.connection is not None)

    try:
        thread = threading.Thread(target=attempt)
        thread.start()
        thread.join(30)
    finally:
        executor.close()
        store.close()
    assert opened == [False]
    # Each step's emit and checkpoint, then the success.
    written = RunEvent.objects.filter(run_id=run.pk).exclude(
        type__in=[transitions.STARTED, transitions.SUCCEEDED]).count()
    assert written >= 2
    assert store.writes == written + 1
    assert AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_executor_fails_a_run_of_an_agent_it_does_not_know() -> None:
    run, ref = claim_one("tests.noop", at=transitions.now())
    executor = Executor("w1", known=["tests.other"])
    outcome = executor.outcome(run, None, AttemptControl(ref, None, 0))
    assert outcome.kind is OutcomeKind.FAILED
    assert "tests.other" in str(outcome.error)


@pytest.mark.django_db(transaction=True)
def test_executor_records_a_stop_requested_before_the_call() -> None:
    run, ref = claim_one("tests.steps", at=transitions.now())
    control = AttemptControl(ref, None, 0)
    control.request_stop(StopReason.CANCELLED)
    settlement = Executor("w1").run(run, get_agent("tests.steps"), control)
    assert settlement is Settlement.CANCELLED
    assert AgentRun.objects.get(pk=run.pk).status == Status.CANCELLED


@pytest.mark.django_db(transaction=True)
def test_executor_returns_none_when_the_outcome_cannot_be_written() -> None:
    run, ref = claim_one("tests.noop", at=transitions.now())
    store = AttemptStore(1)
    store.close()  # refuses every write

    assert Executor("w1", store=store).run(
        run, get_agent("tests.noop"), AttemptControl(ref, None, 0, store)) is None
    assert AgentRun.objects.get(pk=run.pk).status == Status.RUNNING  # left to lapse


@pytest.mark.django_db(transaction=True)
def test_a_worker_closes_the_connection_an_agent_opened_when_its_attempt_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent's own query opens its thread's connection: the worker does not keep it to
    the thread's next attempt, even with persistent connections (with Django's pool,
    closing returns it to the pool)."""
    from django.db import connections

    from django_agentruns import enqueue
    from django_agentruns.runtime.worker import Worker
    from tests.testapp.writer_agents import QUERIED_ON

    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", None)
    QUERIED_ON.clear()
    for _ in range(3):
        enqueue("tests.queries")
    Worker(concurrency=1, burst=True, reap_interval=0).run(install_signals=False)
    assert len(QUERIED_ON) == 3
    assert all(wrapper.connection is None for wrapper in QUERIED_ON)
    assert AgentRun.objects.filter(status=Status.SUCCEEDED).count() == 3


@pytest.mark.django_db(transaction=True)
def test_an_async_agents_off_loop_calls_keep_no_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`receive`, `spawn` and `wait_for_runs` of an async agent run on the loop's executor
    threads (never blocking the loop): those threads keep no connection after the call,
    even with persistent connections, so the worker's count of its connections holds."""
    from django.db import connections

    from django_agentruns import enqueue
    from django_agentruns.runtime.worker import Worker
    from tests.testapp.writer_agents import QUERIED_ON

    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", None)
    QUERIED_ON.clear()
    for _ in range(3):
        enqueue("tests.async_queries")
    Worker(concurrency=2, burst=True, reap_interval=0).run(install_signals=False)
    assert len(QUERIED_ON) == 3
    assert all(wrapper.connection is None for wrapper in QUERIED_ON)
    assert AgentRun.objects.filter(status=Status.SUCCEEDED).count() == 3
