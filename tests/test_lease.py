"""Leases: a claim sets one, step boundaries and the lease keeper renew it, and a renewal
that matches no row means the attempt has lost its run (guarantee 1's heartbeat side)."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from django_agentruns import CancelResult, cancel, enqueue, transitions
from django_agentruns.exceptions import AttemptStopped
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.outcomes import Outcome, OutcomeKind, StopReason
from django_agentruns.registry import get_agent
from django_agentruns.runtime import reaper, recording
from django_agentruns.runtime.context import RunContext
from django_agentruns.runtime.control import AttemptControl
from django_agentruns.runtime.executor import make_context
from django_agentruns.runtime.worker import Worker
from django_agentruns.transitions import AttemptRef, Renewal, ScopePolicy
from tests import helpers
from tests.testapp.models import SideEffect

T0 = datetime(2030, 1, 1, 12, 0, tzinfo=transitions.now().tzinfo)


def ttls() -> dict[str, float]:
    """Per-agent lease TTLs as a worker computes them."""
    return {name: get_agent(name).effective_lease_ttl() for name in ("tests.sleeper",)}


def claim(worker: str, at: datetime, limit: int = 10) -> list[AgentRun]:
    from django_agentruns.conf import app_settings

    return transitions.claim(worker, ["default"], limit, ScopePolicy(), ttls(),
                             float(app_settings.LEASE_TTL), at=at)


def claim_one(agent: str, worker: str = "w1", at: datetime = T0,
              input: dict[str, object] | None = None) -> tuple[AgentRun, AttemptRef]:
    run = enqueue(agent, input or {}, run_after=at)  # due at `at`, even a past one
    [claimed] = claim(worker, at)
    assert claimed.pk == run.pk
    ref = AttemptRef(run.pk, claimed.attempt, worker, get_agent(agent).effective_lease_ttl())
    return claimed, ref


def lease(run_id: int) -> datetime | None:
    return AgentRun.objects.values_list("lease_expires", flat=True).get(pk=run_id)


def steal(run_id: int, thief: str = "thief") -> None:
    """Another owner takes the run, as a reclaim on another machine would, with a lease long
    enough that no reaper takes it back from the thief during the test."""
    assert AgentRun.objects.filter(pk=run_id, status=Status.RUNNING).update(
        claimed_by=thief, lease_expires=transitions.now() + timedelta(minutes=10))


# --------------------------------------------------------------------------- claim


@pytest.mark.django_db
def test_claim_sets_a_lease_of_the_agents_ttl() -> None:
    default = enqueue("tests.noop")
    own = enqueue("tests.sleeper")  # lease_ttl=1.0 on the agent
    claimed = {r.pk: r for r in claim("w1", T0)}
    assert set(claimed) == {default.pk, own.pk}
    assert claimed[default.pk].lease_expires == T0 + timedelta(seconds=2)  # tests LEASE_TTL
    assert claimed[own.pk].lease_expires == T0 + timedelta(seconds=1)
    for run in claimed.values():
        assert run.status == Status.RUNNING
        assert run.claimed_by == "w1"
        assert run.attempt == 1
        assert run.started_at == T0


@pytest.mark.django_db
def test_lease_ttl_setting_is_the_default() -> None:
    with override_settings(AGENTRUNS={**settings.AGENTRUNS, "LEASE_TTL": 45.0}):
        run = enqueue("tests.noop")
        [claimed] = claim("w1", T0)
    assert claimed.pk == run.pk
    assert claimed.lease_expires == T0 + timedelta(seconds=45)


@pytest.mark.django_db(transaction=True)
def test_worker_claims_with_the_agents_ttl() -> None:
    """A real worker's claim and keeper hold a `tests.sleeper` lease to 1 s, not LEASE_TTL."""
    run = enqueue("tests.sleeper", {"seconds": 0.8})
    worker = Worker(burst=True)
    seen: list[float] = []

    def watch() -> None:
        while not done.is_set():
            row = AgentRun.objects.filter(pk=run.pk).values("status", "lease_expires").first()
            if row and row["status"] == Status.RUNNING and row["lease_expires"]:
                seen.append((row["lease_expires"] - transitions.now()).total_seconds())
            done.wait(0.02)
        connection.close()

    done = threading.Event()
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        worker.run(install_signals=False)
    finally:
        done.set()
        watcher.join()
    assert AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED
    assert seen, "the watcher never saw the run running"
    assert max(seen) <= 1.0 + 0.05  # never a 2 s lease


@pytest.mark.django_db(transaction=True)
def test_a_claimed_attempts_lease_counts_from_before_its_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The keeper renews a lease a third into its TTL from when the claim set it, not from
    when the attempt started: a slow claim (a loaded database, the inputs' reads) must not
    push its first renewal past the lease's end."""
    run = enqueue("tests.noop")
    worker = Worker(burst=True)
    entered: list[float] = []
    counted_from: list[float] = []
    real = transitions.settle_and_claim

    def timed_claim(*args: object, **kwargs: object) -> object:
        entered.append(time.monotonic())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(transitions, "settle_and_claim", timed_claim)
    monkeypatch.setattr(worker.keeper, "started",
                        lambda live: counted_from.append(live.last_renewed))
    worker.run(install_signals=False)
    assert AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED
    assert len(counted_from) == 1
    assert counted_from[0] <= entered[0]


# --------------------------------------------------------------------------- step boundaries


@pytest.mark.django_db
def test_renew_extends_the_lease_from_the_time_of_renewal() -> None:
    run, ref = claim_one("tests.noop")
    assert lease(run.pk) == T0 + timedelta(seconds=2)
    assert transitions.renew(ref, at=T0 + timedelta(seconds=1.5)) is Renewal.OK
    assert lease(run.pk) == T0 + timedelta(seconds=3.5)
    # A renewal after the lease lapsed, before anyone took the run: the owner keeps it.
    assert transitions.renew(ref, at=T0 + timedelta(seconds=10)) is Renewal.OK
    assert lease(run.pk) == T0 + timedelta(seconds=12)


@pytest.mark.django_db
def test_emit_and_checkpoint_renew_too() -> None:
    run, ref = claim_one("tests.noop")
    event_id = transitions.emitted_event_id(run.pk, 0, 0)
    assert transitions.emit(ref, event_id, "step", {}, at=T0 + timedelta(seconds=1)) \
        is Renewal.OK
    assert lease(run.pk) == T0 + timedelta(seconds=3)
    assert transitions.checkpoint(ref, {"s": 1}, 1, at=T0 + timedelta(seconds=2)) is Renewal.OK
    assert lease(run.pk) == T0 + timedelta(seconds=4)


def _context(run: AgentRun, ref: AttemptRef) -> tuple[RunContext, AttemptControl]:
    control = AttemptControl(ref, None, run.checkpoint_count)
    return make_context(run, control), control


@pytest.mark.django_db
@pytest.mark.parametrize("call", ["heartbeat", "emit", "checkpoint"])
def test_context_calls_are_heartbeats(call: str) -> None:
    """Each ctx call at a step boundary renews the lease to now + TTL."""
    # Claimed 1.5 s ago: 0.5 s of lease left.
    run, ref = claim_one("tests.noop", at=transitions.now() - timedelta(seconds=1.5))
    before = lease(run.pk)
    ctx, _ = _context(run, ref)
    start = transitions.now()
    if call == "heartbeat":
        ctx.heartbeat()
    elif call == "emit":
        ctx.emit("step", {"n": 1})
    else:
        ctx.checkpoint({"n": 1})
    end = transitions.now()
    after = lease(run.pk)
    assert before is not None
    assert after is not None
    assert after > before
    assert start + timedelta(seconds=2) <= after <= end + timedelta(seconds=2)


# --------------------------------------------------------------------------- lost renewals


@pytest.mark.django_db
def test_renewal_matching_no_row_is_lost_and_writes_nothing() -> None:
    run, ref = claim_one("tests.noop")
    steal(run.pk)
    before = AgentRun.objects.values().get(pk=run.pk)
    later = T0 + timedelta(seconds=1)
    assert transitions.renew(ref, at=later) is Renewal.LOST
    assert transitions.renew_many(ref.worker_id, [ref], at=later) == {ref: Renewal.LOST}
    assert AgentRun.objects.values().get(pk=run.pk) == before


@pytest.mark.django_db
def test_renewal_of_another_attempt_or_a_finished_run_is_lost() -> None:
    run, ref = claim_one("tests.noop")
    stale = AttemptRef(run.pk, ref.attempt - 1, ref.worker_id, ref.lease_ttl)
    assert transitions.renew(stale, at=T0) is Renewal.LOST
    assert transitions.settle_succeeded(ref, {"ok": 1}, at=T0) is transitions.Settlement.SUCCEEDED
    assert transitions.renew(ref, at=T0 + timedelta(seconds=1)) is Renewal.LOST
    assert lease(run.pk) is None


@pytest.mark.django_db
def test_renew_many_reports_each_lease() -> None:
    runs = [enqueue("tests.noop") for _ in range(3)]
    claimed = claim("w1", T0)
    refs = [AttemptRef(r.pk, r.attempt, "w1", 2.0) for r in claimed]
    assert [r.pk for r in claimed] == [r.pk for r in runs]
    steal(runs[1].pk)
    thiefs_lease = lease(runs[1].pk)
    assert cancel(runs[2].pk) is CancelResult.REQUESTED
    result = transitions.renew_many("w1", refs, at=T0 + timedelta(seconds=1))
    assert result == {refs[0]: Renewal.OK, refs[1]: Renewal.LOST,
                      refs[2]: Renewal.CANCEL_REQUESTED}
    assert lease(runs[0].pk) == T0 + timedelta(seconds=3)
    assert lease(runs[1].pk) == thiefs_lease  # untouched


@pytest.mark.django_db
def test_heartbeat_after_a_cancel_request_stops_the_attempt() -> None:
    run, ref = claim_one("tests.noop", at=transitions.now())
    cancel(run.pk)
    ctx, control = _context(run, ref)
    with pytest.raises(AttemptStopped):
        ctx.heartbeat()
    assert control.stop_reason == StopReason.CANCELLED


@pytest.mark.django_db
def test_lost_heartbeat_stops_the_attempt_and_it_does_not_settle() -> None:
    run, ref = claim_one("tests.noop", at=transitions.now())
    ctx, control = _context(run, ref)
    steal(run.pk)
    with pytest.raises(AttemptStopped):
        ctx.heartbeat()
    assert control.stop_reason == StopReason.LEASE_LOST
    # Every later call raises at once, before touching storage.
    with pytest.raises(AttemptStopped):
        ctx.emit("late", {})
    outcome = Outcome(OutcomeKind.STOPPED, stop_reason=control.stop_reason)
    before = AgentRun.objects.values().get(pk=run.pk)
    events = list(RunEvent.objects.filter(run_id=run.pk).values_list("type", flat=True))
    assert recording.record(get_agent("tests.noop"), ref, outcome) \
        is transitions.Settlement.LOST
    assert AgentRun.objects.values().get(pk=run.pk) == before
    assert list(RunEvent.objects.filter(run_id=run.pk).values_list("type", flat=True)) == events
    assert events == [transitions.STARTED]


@pytest.mark.django_db(transaction=True)
def test_keeper_finds_the_lease_lost_and_the_attempt_stops_without_settling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`tests.sleeper` never calls its context: only the lease keeper can notice the loss."""
    run = enqueue("tests.sleeper", {"seconds": 1.5})
    worker = Worker(burst=True)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    caplog.set_level(logging.INFO, logger="django_agentruns")
    thread.start()
    try:
        helpers.wait_until(lambda: SideEffect.objects.filter(run_id=run.pk, note="start").exists(),
                           message="the sleeper to start")
        steal(run.pk)
    finally:
        thread.join(timeout=20)
    assert not thread.is_alive()
    assert worker.stats.settled == {"lost": 1}
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.claimed_by, row.attempt) == (Status.RUNNING, "thief", 1)
    assert list(RunEvent.objects.filter(run_id=run.pk).values_list("type", flat=True)) == \
        [transitions.STARTED]
    # The keeper stopped it (a lost settle would log "succeeded" as the cause instead).
    assert any("lease lost (lease_lost)" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- real worker


@pytest.mark.slow
def test_lease_keeper_holds_a_long_step_without_reclaim(worker_env: dict[str, str]) -> None:
    """lease_ttl 1 s, 3 s in agent code that never touches ctx: the keeper alone keeps it."""
    run = enqueue("tests.sleeper", {"seconds": 3})
    with helpers.start_manage(["runworker", "--burst"], worker_env) as proc:
        helpers.wait_until(lambda: SideEffect.objects.filter(run_id=run.pk, note="start").exists(),
                           message="the sleeper to start")
        reaps = 0
        # A reaper running all along finds nothing stale while the worker is alive.
        while AgentRun.objects.get(pk=run.pk).status == Status.RUNNING:
            report = reaper.reap()
            assert report.stale == [], f"reaped a live run: {report}"
            reaps += 1
            if reaps == 5:
                result = helpers.run_manage(["reap"], worker_env)
                assert result.returncode == 0, result.stderr
                assert result.stdout.startswith("stale 0:"), result.stdout
            time.sleep(0.05)  # the reaper's polling interval, not a wait for state
        assert proc.wait() == 0, proc.output()
    row = AgentRun.objects.get(pk=run.pk)
    assert row.status == Status.SUCCEEDED
    assert (row.attempt, row.requeue_count) == (1, 0)
    # It really did keep looking while the run was in flight, the CLI reap included (the loop
    # runs it only while the run is running; a count, not a rate: a loaded machine runs fewer
    # passes in the same three seconds).
    assert reaps >= 5
    assert not RunEvent.objects.filter(run_id=run.pk, type=transitions.ABANDONED).exists()
    assert list(SideEffect.objects.filter(run_id=run.pk).values_list("note", "attempt")) == \
        [("start", 1), ("end", 1)]
