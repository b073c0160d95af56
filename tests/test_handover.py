"""A worker's successes settled and its next runs claimed together
(`transitions.settle_and_claim`): one statement on PostgreSQL, two steps elsewhere, the
same guarantees either way (each success fenced on its own, the claim's due query and
guards), and the worker's hand-over from its attempts to its claim loop."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_agentruns import enqueue, signals, transitions
from django_agentruns.models import AgentRun, PausedQueue, RunEvent, Status
from django_agentruns.runtime.worker import Worker
from django_agentruns.transitions import AttemptRef, ScopePolicy, Settlement

WORKER = "handover:1:abcd"
pytestmark = pytest.mark.django_db(transaction=True)


def ref(run: AgentRun) -> AttemptRef:
    return AttemptRef(run.pk, run.attempt, WORKER, 30.0, agent=run.agent)


def claim(limit: int, queues: tuple[str, ...] = ("default",)) -> list[AgentRun]:
    return transitions.claim(WORKER, list(queues), limit, ScopePolicy(), {}, 30.0,
                             include_lapsed=False)


def settle_and_claim(successes: list[tuple[AttemptRef, Any]], limit: int,
                     queues: tuple[str, ...] = ("default",),
                     ) -> tuple[dict[AttemptRef, Settlement], list[AgentRun]]:
    return transitions.settle_and_claim(WORKER, successes, list(queues), limit, ScopePolicy(),
                                        {}, 30.0, include_lapsed=False)


def story(run_id: int) -> list[tuple[int, str]]:
    return list(RunEvent.objects.filter(run_id=run_id).order_by("seq")
                .values_list("seq", "type"))


def test_a_success_is_settled_and_the_next_run_claimed_in_one_statement_on_postgresql(
) -> None:
    first = enqueue("tests.noop", {"n": 1})
    (running,) = claim(1)
    low = enqueue("tests.noop", {"n": 2}, priority=0)
    high = enqueue("tests.noop", {"n": 3}, priority=5)
    started: list[int] = []
    succeeded: list[int] = []

    def on_started(sender: Any, run_id: int, **kwargs: Any) -> None:
        started.append(run_id)

    def on_succeeded(sender: Any, run_id: int, **kwargs: Any) -> None:
        succeeded.append(run_id)

    signals.run_started.connect(on_started)
    signals.run_succeeded.connect(on_succeeded)
    try:
        with CaptureQueriesContext(connection) as queries:
            settled, claimed = settle_and_claim([(ref(running), {"ok": 1})], 1)
    finally:
        signals.run_started.disconnect(on_started)
        signals.run_succeeded.disconnect(on_succeeded)
    if connection.vendor == "postgresql":
        assert len(queries) == 1, [q["sql"][:80] for q in queries]
    assert settled == {ref(running): Settlement.SUCCEEDED}
    assert [r.pk for r in claimed] == [high.pk]  # priority first, as the plain claim
    (run,) = claimed
    assert (run.status, run.claimed_by, run.attempt) == (Status.RUNNING, WORKER, 1)
    assert not hasattr(run, "settled_ids")
    row = AgentRun.objects.get(pk=first.pk)
    assert (row.status, row.output, row.lease_expires) == (Status.SUCCEEDED, {"ok": 1}, None)
    assert story(first.pk) == [(1, transitions.STARTED), (2, transitions.SUCCEEDED)]
    assert story(high.pk) == [(1, transitions.STARTED)]
    assert AgentRun.objects.get(pk=low.pk).status == Status.QUEUED
    assert (started, succeeded) == ([high.pk], [first.pk])


def test_a_success_whose_lease_was_lost_is_not_written_and_the_claim_goes_on() -> None:
    kept, lost = (enqueue("tests.noop", {"n": n}) for n in (1, 2))
    runs = claim(2)
    by_pk = {r.pk: r for r in runs}
    AgentRun.objects.filter(pk=lost.pk).update(claimed_by="another-worker")
    nxt = enqueue("tests.noop", {"n": 3})
    settled, claimed = settle_and_claim(
        [(ref(by_pk[kept.pk]), 1), (ref(by_pk[lost.pk]), 2)], 2)
    assert settled == {ref(by_pk[kept.pk]): Settlement.SUCCEEDED,
                       ref(by_pk[lost.pk]): Settlement.LOST}
    assert [r.pk for r in claimed] == [nxt.pk]
    row = AgentRun.objects.get(pk=lost.pk)
    assert (row.status, row.claimed_by, row.output) == (Status.RUNNING, "another-worker", None)
    assert story(lost.pk) == [(1, transitions.STARTED)]


def test_nothing_due_or_a_paused_queue_still_settles() -> None:
    enqueue("tests.noop", {"n": 1})
    (running,) = claim(1)
    settled, claimed = settle_and_claim([(ref(running), None)], 4)
    assert (settled, claimed) == ({ref(running): Settlement.SUCCEEDED}, [])
    enqueue("tests.noop", {"n": 2})
    (second,) = claim(1)
    enqueue("tests.noop", {"n": 3})
    PausedQueue.objects.create(name="default")
    # The worker passes the queues not paused (none here) and no room: a settle alone.
    settled, claimed = settle_and_claim([(ref(second), None)], 0, queues=())
    assert (settled, claimed) == ({ref(second): Settlement.SUCCEEDED}, [])
    assert AgentRun.objects.filter(status=Status.QUEUED).count() == 1


def test_a_worker_drains_settling_each_success_with_its_next_claim() -> None:
    for n in range(12):
        enqueue("tests.noop", {"n": n})
    worker = Worker(["default"], concurrency=1, burst=True, reap_interval=0)
    stats = worker.run(install_signals=False)
    assert stats.settled == {"succeeded": 12}
    assert AgentRun.objects.filter(status=Status.SUCCEEDED).count() == 12
    for run_id in AgentRun.objects.values_list("pk", flat=True):
        assert story(run_id) == [(1, transitions.STARTED), (2, transitions.SUCCEEDED)]
    assert worker.store is not None
    if connection.vendor == "postgresql":
        # One slot: every success went with the next claim, none through the store.
        assert worker.store.writes == 0
    else:
        assert worker.store.writes == 12


def test_with_many_slots_successes_go_with_the_claim_or_through_the_store() -> None:
    """A success that comes while the claim loop's statement runs goes to the store
    (settled meanwhile), not to the next statement: each is written once either way."""
    for n in range(40):
        enqueue("tests.noop", {"n": n})
    worker = Worker(["default"], concurrency=8, burst=True, reap_interval=0)
    stats = worker.run(install_signals=False)
    assert stats.settled == {"succeeded": 40}
    for run_id in AgentRun.objects.values_list("pk", flat=True):
        assert story(run_id) == [(1, transitions.STARTED), (2, transitions.SUCCEEDED)]
    assert worker.store is not None
    assert worker.store.writes <= 40


@pytest.mark.postgres_only
def test_successes_whose_statement_failed_are_written_by_the_store(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for n in range(4):
        enqueue("tests.noop", {"n": n})
    real = transitions.settle_and_claim
    failed: list[int] = []

    def failing(worker_id: str, successes: Any, *args: Any, **kwargs: Any) -> Any:
        if successes and not failed:
            failed.append(len(successes))
            raise RuntimeError("the statement failed")
        return real(worker_id, successes, *args, **kwargs)

    monkeypatch.setattr(transitions, "settle_and_claim", failing)
    worker = Worker(["default"], concurrency=1, burst=True, reap_interval=0)
    stats = worker.run(install_signals=False)
    assert failed == [1]
    assert stats.pass_errors == 1
    assert stats.settled == {"succeeded": 4}
    assert worker.store is not None
    assert worker.store.writes == 1
    assert AgentRun.objects.filter(status=Status.SUCCEEDED).count() == 4


@pytest.mark.postgres_only
def test_a_claim_whose_start_raises_still_answers_the_successes_it_settled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The statement committed the success: its attempt, waiting for the answer, is told,
    whatever happens after the commit (here a start raising), and the worker goes on."""
    for n in range(3):
        enqueue("tests.noop", {"n": n})
    real = Worker._start
    started: list[int] = []

    def start(self: Worker, run: AgentRun, leased_at: float) -> None:
        real(self, run, leased_at)
        started.append(run.pk)
        if len(started) == 2:  # the pass that settled the first run's success
            raise RuntimeError("after the start")

    monkeypatch.setattr(Worker, "_start", start)
    worker = Worker(["default"], concurrency=1, burst=True, reap_interval=0)

    def serve() -> None:
        try:
            worker.run(install_signals=False)
        finally:
            connection.close()  # this thread's: the test database is dropped at the end

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join(30)
    hung = thread.is_alive()
    if hung:  # the first attempt waits for an answer that never comes
        worker.stop()
        thread.join(15)
    assert not hung
    assert worker.stats.pass_errors == 1
    assert worker.stats.settled == {"succeeded": 3}
    assert AgentRun.objects.filter(status=Status.SUCCEEDED).count() == 3


@pytest.mark.postgres_only
def test_a_statement_shape_seen_before_gets_the_same_parameters_without_its_text_built(
) -> None:
    from datetime import timedelta

    from django_agentruns.transitions import due, hot_sql

    at = transitions.now()
    compiled = due.compiled_due(connection.vendor, ("default",), ScopePolicy(), 2,
                                ids_only=True, agents=frozenset({"tests.noop"}))
    args = ([(7, 1, {"out": [1, 2]}, transitions.lifecycle_event_id()),
             (8, 2, None, transitions.lifecycle_event_id())], WORKER, Status.RUNNING,
            Status.SUCCEEDED, "completed", transitions.SUCCEEDED, compiled, at, Status.QUEUED,
            {"tests.slow": at + timedelta(seconds=90)}, at + timedelta(seconds=30),
            transitions.STARTED)
    hot_sql._SHAPES.clear()
    built = hot_sql.settle_and_claim(*args)
    assert hot_sql._SHAPES  # kept by shape
    again = hot_sql.settle_and_claim(*args)

    def plain(params: list[Any]) -> list[Any]:
        return [getattr(p, "obj", p) for p in params]  # psycopg's Jsonb wraps the value

    assert again[0] is built[0]
    assert plain(again[1]) == plain(built[1])
    assert built[0].count("%s") == len(built[1])


def test_with_fair_shares_a_success_and_a_fair_claim_are_one_statement_on_postgresql(
) -> None:
    """The fair claim is the ordinary claim in stamp order: the same one statement."""
    from django_agentruns import enqueue_many

    enqueue_many([{"agent": "tests.tenant", "input": {"tenant": "A"}} for _ in range(20)])
    (running,) = transitions.claim(WORKER, ["default"], 1, ScopePolicy(), {}, 30.0,
                                   include_lapsed=False, fair=True)
    late = enqueue_many([{"agent": "tests.tenant", "input": {"tenant": "B"}}
                         for _ in range(2)])
    with CaptureQueriesContext(connection) as queries:
        settled, claimed = transitions.settle_and_claim(
            WORKER, [(ref(running), {"ok": 1})], ["default"], 4, ScopePolicy(), {}, 30.0,
            include_lapsed=False, fair=True)
    if connection.vendor == "postgresql":
        # Less the empty transaction in which Django compiles this shape's FOR UPDATE, once
        # per process (no statement runs in it).
        sent = [q["sql"] for q in queries if q["sql"] not in ("BEGIN", "COMMIT")]
        assert len(sent) == 1, [q[:80] for q in sent]
    assert settled == {ref(running): Settlement.SUCCEEDED}
    assert sorted(r.fair_key for r in claimed) == ["A", "A", "B", "B"]  # B shares at once
    assert {r.pk for r in claimed} >= {r.pk for r in late}
    assert [r.fair_vstart for r in claimed] == sorted(r.fair_vstart for r in claimed)


def test_a_handed_off_success_is_answered_by_whoever_settles_it_and_nobody_waits() -> None:
    """`Handover.hand_off` (a worker's attempt does not wait for its success): the claim
    loop's statement answers it, or the store while that statement runs or once closed; a
    `then` that raises leaves none of the others taken with it unanswered."""
    from concurrent.futures import Future

    from django_agentruns.runtime.handover import Handover
    from django_agentruns.transitions import SucceedWrite

    class Store:
        """The store's `submit`, committed at once."""

        def __init__(self) -> None:
            self.written: list[SucceedWrite] = []

        def submit(self, write: SucceedWrite) -> Future[Settlement]:
            self.written.append(write)
            future: Future[Settlement] = Future()
            future.set_result(Settlement.SUCCEEDED)
            return future

    def write(run_id: int) -> SucceedWrite:
        return SucceedWrite(AttemptRef(run_id, 1, WORKER, 30.0, agent="tests.noop"), None)

    store, wake = Store(), threading.Event()
    handover = Handover(store, wake, open=True)  # type: ignore[arg-type]
    got: list[tuple[int, Any]] = []

    def then(run_id: int, raises: bool = False) -> Any:
        def answered(result: Any) -> None:
            got.append((run_id, result))
            if raises:
                raise RuntimeError("a log handler failed")
        return answered

    first, second, third = write(1), write(2), write(3)
    handover.hand_off(first, then(1, raises=True))
    handover.hand_off(second, then(2))
    assert wake.is_set()  # the claim loop's now
    assert (got, store.written) == ([], [])
    taken = handover.take()
    handover.hand_off(third, then(3))  # while the statement runs: the store's
    assert (store.written, got) == ([third], [(3, Settlement.SUCCEEDED)])
    handover.settled(taken, {first.ref: Settlement.SUCCEEDED, second.ref: Settlement.LOST})
    handover.release()
    assert got[1:] == [(1, Settlement.SUCCEEDED), (2, Settlement.LOST)]
    handover.close()
    handover.hand_off(write(4), then(4))  # closed: the store's
    assert (got[-1], len(store.written)) == ((4, Settlement.SUCCEEDED), 2)


def test_a_worker_id_with_quotes_and_percent_signs_settles_and_claims_as_any() -> None:
    """The statement's constants (the worker's id among them) are literals in its text:
    quoted, and a `%` kept from reading as a placeholder."""
    odd = "o'dd %s 100%:1"
    enqueue("tests.noop", {"n": 1})
    second = enqueue("tests.noop", {"n": 2})
    (running,) = transitions.claim(odd, ["default"], 1, ScopePolicy(), {}, 30.0,
                                   include_lapsed=False)
    mine = AttemptRef(running.pk, running.attempt, odd, 30.0, agent=running.agent)
    settled, claimed = transitions.settle_and_claim(
        odd, [(mine, {"out": "it's 100%"})], ["default"], 1, ScopePolicy(), {}, 30.0,
        include_lapsed=False)
    assert settled == {mine: Settlement.SUCCEEDED}
    assert [(r.pk, r.claimed_by) for r in claimed] == [(second.pk, odd)]
    assert AgentRun.objects.get(pk=running.pk).output == {"out": "it's 100%"}
    start = RunEvent.objects.get(run_id=second.pk, type=transitions.STARTED)
    assert start.payload == {"worker": odd}
