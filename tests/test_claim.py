"""The claim: which due runs a worker takes, in what order, and what taking one writes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from django_agentruns import RunRequest, enqueue, enqueue_many, transitions
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.registry import scope_policy
from django_agentruns.transitions import AttemptRef, Settlement, claiming
from tests import helpers

pytestmark = pytest.mark.django_db

WORKER = "claim-test:1:abcd"
TTL = 2.0


def claim(
    limit: int = 10,
    at: datetime | None = None,
    *,
    worker: str = WORKER,
    queues: Sequence[str] = ("default",),
    ttls: dict[str, float] | None = None,
) -> list[AgentRun]:
    return transitions.claim(worker, list(queues), limit, scope_policy(), ttls or {}, TTL, at)


def ids(runs: Sequence[AgentRun]) -> list[int]:
    return [r.pk for r in runs]


# --------------------------------------------------------------------------- order


@pytest.fixture
def mixed_backlog() -> tuple[datetime, list[int]]:
    """Eight due runs, enqueued out of claim order; yields (now, ids in claim order)."""
    t = timezone.now()

    def req(name: str, priority: int, age: float, seq: int) -> RunRequest:
        return RunRequest("tests.noop", {"name": name}, priority=priority,
                          run_after=t - timedelta(seconds=age), fired_seq=seq)

    spec = {
        "r1": req("r1", 0, 10, 0),
        "r8": req("r8", -1, 100, 0),  # oldest, but lowest priority: last
        "r4": req("r4", 0, 20, 2),
        "r3": req("r3", 0, 30, 9),  # earlier due time beats a lower fired_seq
        "r6": req("r6", 0, 20, 2),  # ties with r4 on everything but id
        "r2": req("r2", 5, 1, 99),  # highest priority first, though newest
        "r7": req("r7", 0, 20, 2),
        "r5": req("r5", 0, 20, 1),  # lower fired_seq beats r4/r6/r7 at the same due time
    }
    runs = dict(zip(spec, enqueue_many(list(spec.values())), strict=True))
    assert runs["r4"].pk < runs["r6"].pk < runs["r7"].pk
    return t, [runs[n].pk for n in ("r2", "r3", "r5", "r4", "r6", "r7", "r1", "r8")]


def test_claim_order_in_one_claim(mixed_backlog: tuple[datetime, list[int]]) -> None:
    at, expected = mixed_backlog
    assert expected != sorted(expected)  # enqueue order is not claim order
    assert ids(claim(limit=20, at=at)) == expected


def test_claim_order_one_at_a_time(mixed_backlog: tuple[datetime, list[int]]) -> None:
    at, expected = mixed_backlog
    taken = [ids(claim(limit=1, at=at)) for _ in expected]
    assert taken == [[pk] for pk in expected]
    assert claim(limit=1, at=at) == []


def test_future_runs_are_not_claimed() -> None:
    t = timezone.now()
    later = enqueue("tests.noop", run_after=60)
    due_exactly = enqueue("tests.noop", queue="other", run_after=t + timedelta(seconds=5))
    assert claim(at=t, queues=["default", "other"]) == []
    assert claim(at=t + timedelta(seconds=4), queues=["default", "other"]) == []
    assert ids(claim(at=t + timedelta(seconds=5), queues=["other"])) == [due_exactly.pk]
    assert claim(at=t + timedelta(seconds=59)) == []
    assert ids(claim(at=later.available_at)) == [later.pk]
    assert AgentRun.objects.get(pk=later.pk).status == Status.RUNNING


def test_only_the_named_queues_are_claimed() -> None:
    at = timezone.now()
    default = enqueue("tests.noop")
    other = enqueue("tests.noop", queue="other")
    third = enqueue("tests.noop", queue="third")
    assert ids(claim(at=at + timedelta(seconds=1), queues=["other"])) == [other.pk]
    assert sorted(ids(claim(at=at + timedelta(seconds=1), queues=["default", "third"]))) == \
        sorted([default.pk, third.pk])


def test_runs_that_are_not_queued_are_not_claimed() -> None:
    run = enqueue("tests.noop")
    at = timezone.now()
    assert transitions.cancel(run.pk) is not None
    assert claim(at=at) == []
    assert AgentRun.objects.get(pk=run.pk).status == Status.CANCELLED


# --------------------------------------------------------------------------- what a claim writes


def test_claim_marks_the_run_running_with_a_lease_and_a_started_event() -> None:
    run = enqueue("tests.noop", input={"x": 1})
    at = timezone.now() + timedelta(seconds=1)
    (claimed,) = claim(at=at)

    stored = AgentRun.objects.get(pk=run.pk)
    for row in (claimed, stored):
        assert row.pk == run.pk
        assert row.status == Status.RUNNING
        assert row.claimed_by == WORKER
        assert row.attempt == 1
        assert row.lease_expires == at + timedelta(seconds=TTL)
        assert row.started_at == at
        assert row.requeue_count == 0
    assert claimed.input == {"x": 1}

    (event,) = RunEvent.objects.filter(run_id=run.pk)
    assert (event.seq, event.type, event.attempt, event.payload, event.created_at) == (
        1, "run.started", 1, {"worker": WORKER}, at)


def test_lease_is_now_plus_ttl_when_no_time_is_given() -> None:
    enqueue("tests.noop")
    before = timezone.now()
    (claimed,) = claim()
    after = timezone.now()
    assert claimed.lease_expires is not None
    assert before + timedelta(seconds=TTL) <= claimed.lease_expires <= \
        after + timedelta(seconds=TTL)


def test_agent_lease_ttl_applies_per_run() -> None:
    short = enqueue("tests.sleeper")
    plain = enqueue("tests.noop")
    at = timezone.now() + timedelta(seconds=1)
    claimed = {r.pk: r for r in claim(at=at, ttls={"tests.sleeper": 0.5})}
    assert claimed[short.pk].lease_expires == at + timedelta(seconds=0.5)
    assert claimed[plain.pk].lease_expires == at + timedelta(seconds=TTL)


def test_each_claim_increments_the_attempt() -> None:
    run = enqueue("tests.noop")
    t0 = timezone.now() + timedelta(seconds=1)
    (first,) = claim(at=t0)
    ref = AttemptRef(run.pk, first.attempt, WORKER, TTL)
    # BACKOFF_BASE is 0 in the test settings: the abandoned run is due again at once.
    assert transitions.abandon(ref, "test", at=t0 + timedelta(seconds=1)) is Settlement.REQUEUED
    (second,) = claim(at=t0 + timedelta(seconds=2), worker="other-worker")
    assert second.attempt == 2
    assert second.claimed_by == "other-worker"
    assert second.lease_expires == t0 + timedelta(seconds=2 + TTL)
    started = list(RunEvent.objects.filter(run_id=run.pk, type="run.started")
                   .values_list("attempt", "payload"))
    assert started == [(1, {"worker": WORKER}), (2, {"worker": "other-worker"})]


def test_claim_and_its_events_are_one_transaction(monkeypatch: pytest.MonkeyPatch) -> None:
    run = enqueue("tests.noop")

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("event insert failed")

    monkeypatch.setattr(claiming, "append_events", broken)
    with pytest.raises(RuntimeError, match="event insert failed"):
        claim(at=timezone.now() + timedelta(seconds=1))
    stored = AgentRun.objects.get(pk=run.pk)
    assert (stored.status, stored.attempt, stored.claimed_by, stored.lease_expires) == (
        Status.QUEUED, 0, "", None)
    assert not RunEvent.objects.exists()


def test_claim_limit_is_respected() -> None:
    runs = enqueue_many([RunRequest("tests.noop", fired_seq=i) for i in range(5)])
    at = timezone.now() + timedelta(seconds=1)
    assert claim(limit=0, at=at) == []
    first = claim(limit=3, at=at)
    assert ids(first) == ids(runs[:3])
    second = claim(limit=3, at=at)
    assert ids(second) == ids(runs[3:])
    assert claim(limit=3, at=at) == []
    assert AgentRun.objects.filter(status=Status.RUNNING).count() == 5


def test_several_runs_per_claim_each_get_their_event() -> None:
    runs = enqueue_many([RunRequest("tests.noop", fired_seq=i) for i in range(6)])
    at = timezone.now() + timedelta(seconds=1)
    claimed = claim(limit=10, at=at)
    assert ids(claimed) == ids(runs)
    assert {r.status for r in claimed} == {Status.RUNNING}
    assert {r.lease_expires for r in claimed} == {at + timedelta(seconds=TTL)}
    started = RunEvent.objects.filter(type="run.started", seq=1, attempt=1)
    assert sorted(started.values_list("run_id", flat=True)) == sorted(ids(runs))


def test_a_lapsed_run_is_taken_back_by_a_claim_as_an_abandoned_attempt() -> None:
    run = enqueue("tests.noop")
    t0 = timezone.now() + timedelta(seconds=1)
    claim(at=t0, worker="dead-worker")
    (again,) = claim(at=t0 + timedelta(seconds=TTL + 1), worker="live-worker")
    assert (again.pk, again.attempt, again.claimed_by, again.requeue_count) == (
        run.pk, 2, "live-worker", 1)
    types = list(RunEvent.objects.filter(run_id=run.pk).values_list("type", flat=True))
    assert types == ["run.started", "run.abandoned", "run.retrying", "run.started"]


# --------------------------------------------------------------------------- row locks


def _table() -> str:
    return AgentRun._meta.db_table


class SecondConnection:
    """A real second PostgreSQL session, holding row locks in an open transaction."""

    def __init__(self) -> None:
        import psycopg

        self.conn = psycopg.connect(helpers.database_url(connection.settings_dict))

    def lock(self, run_id: int) -> None:
        row = self.conn.execute(f"SELECT id FROM {_table()} WHERE id = %s FOR UPDATE",
                                [run_id]).fetchone()
        assert row == (run_id,)

    def release(self) -> None:
        self.conn.rollback()

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def second_connection(transactional_db: None) -> Iterator[SecondConnection]:
    other = SecondConnection()
    with connection.cursor() as cursor:
        # Were SKIP LOCKED lost, the claim would wait on the lock: fail instead of hanging.
        cursor.execute("SET lock_timeout = '3s'")
    try:
        yield other
    finally:
        other.close()
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")


@pytest.mark.postgres_only
def test_claim_skips_a_run_locked_by_another_connection(
    second_connection: SecondConnection,
) -> None:
    first = enqueue("tests.noop", priority=9)
    second = enqueue("tests.noop", priority=0)
    at = timezone.now() + timedelta(seconds=1)

    second_connection.lock(first.pk)
    assert ids(claim(limit=1, at=at)) == [second.pk]
    assert claim(limit=1, at=at) == []  # the only due run left is locked
    assert AgentRun.objects.get(pk=first.pk).status == Status.QUEUED

    second_connection.release()
    assert ids(claim(limit=1, at=at)) == [first.pk]


@pytest.mark.postgres_only
def test_claim_skips_a_locked_lapsed_run(second_connection: SecondConnection) -> None:
    lapsed = enqueue("tests.noop")
    t0 = timezone.now() + timedelta(seconds=1)
    claim(at=t0, worker="dead-worker")
    queued = enqueue("tests.noop")
    later = t0 + timedelta(seconds=TTL + 1)

    second_connection.lock(lapsed.pk)  # e.g. a reaper in the middle of reclaiming it
    assert ids(claim(limit=1, at=later)) == [queued.pk]
    assert AgentRun.objects.get(pk=lapsed.pk).claimed_by == "dead-worker"

    second_connection.release()
    (taken,) = claim(limit=1, at=later)
    assert (taken.pk, taken.attempt) == (lapsed.pk, 2)
