"""Guarantee 1, one live owner: every write an attempt makes is fenced by
`status='running' AND claimed_by=me AND attempt=n`; a writer that lost the run writes nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection

from django_agentruns import enqueue, transitions
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.registry import agent, unregister
from django_agentruns.rules import policy
from django_agentruns.runtime import reaper
from django_agentruns.runtime.worker import Worker
from django_agentruns.transitions import (
    AttemptRef,
    ErrorInfo,
    Renewal,
    ScopePolicy,
    Settlement,
)

T0 = datetime(2030, 1, 1, 12, 0, tzinfo=transitions.now().tzinfo)
TTL = 2.0  # tests/settings.py LEASE_TTL


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def claim(worker: str, when: datetime) -> list[AgentRun]:
    return transitions.claim(worker, ["default"], 10, ScopePolicy(), {}, TTL, at=when)


def snapshot(run_id: int) -> tuple[dict[str, Any], list[tuple[Any, ...]]]:
    """Everything stored about a run: its row and its events."""
    row = dict(AgentRun.objects.values().get(pk=run_id))
    events: list[tuple[Any, ...]] = list(
        RunEvent.objects.filter(run_id=run_id).order_by("seq")
        .values_list("seq", "event_id", "type", "payload", "attempt"))
    return row, events


def on_other_connection(func: Callable[[], object]) -> None:
    """Run `func` on a second database connection (a thread has its own), and wait."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            func()
        except BaseException as exc:  # re-raised in the caller
            failure.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    if failure:
        raise failure[0]


# --------------------------------------------------------------------------- guarantee 1


@pytest.mark.django_db
@pytest.mark.parametrize("takeover", ["claim", "reap_then_claim"])
def test_guarantee_1_one_live_owner(takeover: str) -> None:
    run = enqueue("tests.steps", {"steps": 2}, run_after=T0)
    [claimed_a] = claim("A", T0)
    a = AttemptRef(run.pk, claimed_a.attempt, "A", TTL)
    assert a.attempt == 1

    # A works, then stops renewing (a GC pause, a partition): its lease lapses at T0+3.
    assert transitions.emit(a, transitions.emitted_event_id(run.pk, 0, 0), "step", {"n": 0},
                            at=at(0.5)) is Renewal.OK
    assert transitions.checkpoint(a, {"step": 1}, 1, at=at(1)) is Renewal.OK

    # B takes the run once the lease has lapsed.
    if takeover == "reap_then_claim":
        report = reaper.reap(at(3.5))
        assert report.requeued == [run.pk]
    [claimed_b] = claim("B", at(3.6))
    assert claimed_b.pk == run.pk
    b = AttemptRef(run.pk, claimed_b.attempt, "B", TTL)
    assert (claimed_b.attempt, claimed_b.requeue_count, claimed_b.claimed_by) == (2, 1, "B")
    assert claimed_b.checkpoint_state == {"step": 1}  # B resumes where A checkpointed

    # A wakes up and carries on as if it still owned the run: every write is refused.
    before = snapshot(run.pk)
    late = at(3.7)
    assert transitions.emit(a, transitions.emitted_event_id(run.pk, 1, 0), "step", {"n": 1},
                            at=late) is Renewal.LOST
    assert transitions.checkpoint(a, {"step": 2}, 2, at=late) is Renewal.LOST
    assert transitions.renew(a, at=late) is Renewal.LOST
    assert transitions.renew_many("A", [a], at=late) == {a: Renewal.LOST}
    assert transitions.settle_succeeded(a, {"by": "A"}, at=late) is Settlement.LOST
    error = ErrorInfo("RuntimeError", "A failed", "")
    for retryable in (True, False):
        assert transitions.settle_failed(a, policy.Failure(retryable), error, at=late) \
            is Settlement.LOST
    assert transitions.settle_cancelled(a, at=late) is Settlement.LOST
    assert transitions.abandon(a, "A stopped", at=late) is Settlement.LOST
    assert snapshot(run.pk) == before

    # B runs to the end on the same stream, then settles normally.
    assert transitions.emit(b, transitions.emitted_event_id(run.pk, 1, 0), "step", {"n": 1},
                            at=at(4)) is Renewal.OK
    assert transitions.checkpoint(b, {"step": 2}, 2, at=at(4.5)) is Renewal.OK
    assert transitions.settle_succeeded(b, {"by": "B"}, at=at(5)) is Settlement.SUCCEEDED

    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.output, row.attempt, row.checkpoint_state) == \
        (Status.SUCCEEDED, {"by": "B"}, 2, {"step": 2})
    events = list(RunEvent.objects.filter(run_id=run.pk).order_by("seq"))
    assert [e.seq for e in events] == list(range(1, len(events) + 1))  # no collision, no gap
    assert len({e.event_id for e in events}) == len(events)
    assert [(e.type, e.attempt) for e in events] == [
        (transitions.STARTED, 1), ("step", 1), (transitions.CHECKPOINT, 1),
        (transitions.ABANDONED, 1), (transitions.RETRYING, 1),
        (transitions.STARTED, 2), ("step", 2), (transitions.CHECKPOINT, 2),
        (transitions.SUCCEEDED, 2),
    ]
    assert events[3].payload["worker"] == "A"
    assert events[5].payload["worker"] == "B"
    # After settling, neither attempt can write again.
    assert transitions.renew(b, at=at(6)) is Renewal.LOST
    assert transitions.settle_failed(b, policy.Failure(False), error, at=at(6)) \
        is Settlement.LOST


@pytest.mark.django_db
def test_the_fence_includes_the_attempt_number() -> None:
    """A worker that claims the same run twice (attempt 1, then 2) cannot write as attempt 1."""
    run = enqueue("tests.noop", run_after=T0)
    claim("A", T0)
    [again] = claim("A", at(3))  # A's first lease lapsed; A itself takes the run back
    assert again.attempt == 2
    old = AttemptRef(run.pk, 1, "A", TTL)
    before = snapshot(run.pk)
    assert transitions.renew(old, at=at(3.1)) is Renewal.LOST
    assert transitions.settle_succeeded(old, {}, at=at(3.1)) is Settlement.LOST
    assert snapshot(run.pk) == before
    assert transitions.settle_succeeded(AttemptRef(run.pk, 2, "A", TTL), {}, at=at(3.2)) \
        is Settlement.SUCCEEDED


@pytest.mark.django_db
def test_a_live_owner_is_not_taken_over() -> None:
    """Before the lease lapses, no claim and no reap touches the run."""
    run = enqueue("tests.noop", run_after=T0)
    claim("A", T0)
    before = snapshot(run.pk)
    assert claim("B", at(1.9)) == []
    assert reaper.reap(at(1.9)).stale == []
    assert snapshot(run.pk) == before


# --------------------------------------------------------------------------- mid-run theft

VICTIM = "tests.fencing_victim"
log: list[str] = []


def _steal(run_id: int) -> None:
    """On another connection, as another worker's reclaim would."""
    def take() -> None:
        assert AgentRun.objects.filter(pk=run_id, status=Status.RUNNING).update(
            claimed_by="thief", lease_expires=transitions.now() + timedelta(minutes=10))

    on_other_connection(take)


@pytest.fixture
def victim() -> Iterator[None]:
    """An agent whose lease is stolen mid-run; `input["then"]` says what it does next."""

    @agent(VICTIM)
    def run_victim(ctx: Any) -> Any:
        ctx.emit("before", {})
        _steal(ctx.run_id)
        log.append("stolen")
        then = ctx.input["then"]
        try:
            if then == "emit":
                ctx.emit("after", {})
            elif then == "checkpoint":
                ctx.checkpoint({"after": True})
            elif then == "heartbeat":
                ctx.heartbeat()
            elif then == "raise":
                raise ConnectionError("retryable, but not ours to retry any more")
            elif then == "fail_hard":
                raise PermissionError("not retryable, but not ours to dead-letter")
        except BaseException as exc:
            log.append(type(exc).__name__)
            raise
        log.append("returned")
        return {"after": True}

    log.clear()
    yield
    unregister(VICTIM)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("victim")
@pytest.mark.parametrize("then", ["emit", "checkpoint", "heartbeat", "return", "raise",
                                  "fail_hard"])
def test_stolen_lease_mid_run_writes_nothing_more(then: str) -> None:
    run = enqueue(VICTIM, {"then": then})
    worker = Worker(burst=True)
    stats = worker.run(install_signals=False)

    assert stats.claimed == 1
    assert stats.settled == {"lost": 1}
    if then in ("emit", "checkpoint", "heartbeat"):
        assert log == ["stolen", "AttemptStopped"]  # the agent's next ctx call raised
    elif then == "return":
        assert log == ["stolen", "returned"]
    else:
        assert log == ["stolen", "ConnectionError" if then == "raise" else "PermissionError"]
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.claimed_by, row.attempt) == (Status.RUNNING, "thief", 1)
    assert (row.output, row.checkpoint_state, row.checkpoint_count) == (None, None, 0)
    assert (row.requeue_count, row.error_type, row.finished_at) == (0, "", None)
    assert list(RunEvent.objects.filter(run_id=run.pk).values_list("type", flat=True)) == \
        [transitions.STARTED, "before"]
