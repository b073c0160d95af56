"""Guarantee 2, nothing lost: a run whose worker died is reclaimed once its lease lapses,
by `reap` or by a claim; the lost attempt counts against the budget; a reaper racing a
heartbeat or a settle changes nothing."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_agentruns import CancelResult, cancel, enqueue, enqueue_many, transitions
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.runtime import reaper
from django_agentruns.transitions import AttemptRef, ScopePolicy, Settlement
from tests import helpers
from tests.testapp.models import SideEffect

T0 = datetime(2030, 1, 1, 12, 0, tzinfo=transitions.now().tzinfo)
TTL = 2.0  # tests/settings.py LEASE_TTL


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def claim(worker: str, when: datetime, limit: int = 100) -> list[AgentRun]:
    return transitions.claim(worker, ["default"], limit, ScopePolicy(), {}, TTL, at=when)


def claimed_run(agent: str = "tests.noop", worker: str = "A", when: datetime = T0,
                ) -> tuple[AgentRun, AttemptRef]:
    run = enqueue(agent, run_after=when)
    [row] = claim(worker, when)
    assert row.pk == run.pk
    return row, AttemptRef(row.pk, row.attempt, worker, TTL)


def event_types(run_id: int) -> list[str]:
    return list(RunEvent.objects.filter(run_id=run_id).order_by("seq")
                .values_list("type", flat=True))


def snapshot(run_id: int) -> tuple[dict[str, Any], list[str]]:
    return dict(AgentRun.objects.values().get(pk=run_id)), event_types(run_id)


# --------------------------------------------------------------------------- a real crash


@pytest.mark.slow
def test_guarantee_2_nothing_lost(worker_env: dict[str, str]) -> None:
    run = enqueue("tests.heartbeats", {"seconds": 2})
    with helpers.start_manage(["runworker"], worker_env) as doomed:
        helpers.wait_until(
            lambda: SideEffect.objects.filter(run_id=run.pk, note="start").exists(),
            message="the first attempt to start")
        doomed.kill()  # SIGKILL: no handler, no cleanup, no last write
        assert doomed.wait() == -signal.SIGKILL
    lost = AgentRun.objects.get(pk=run.pk)
    assert (lost.status, lost.attempt) == (Status.RUNNING, 1)
    assert lost.lease_expires is not None

    # Before the lease lapses there is nothing to reap; after, reap takes it back.
    reaps: list[tuple[datetime, reaper.ReapReport]] = []

    def reap_requeued() -> list[int]:
        reaps.append((transitions.now(), reaper.reap()))
        return reaps[-1][1].requeued

    helpers.wait_until(reap_requeued, message="the lease to lapse and reap to requeue the run")
    assert reaps[-1][1].requeued == [run.pk]
    assert reaps[-1][0] > lost.lease_expires
    assert all(report.stale == [] for _, report in reaps[:-1])
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.requeue_count, row.claimed_by, row.lease_expires) == \
        (Status.QUEUED, 1, "", None)
    assert row.error_type == "AbandonedAttempt"
    assert event_types(run.pk) == [transitions.STARTED, transitions.ABANDONED,
                                   transitions.RETRYING]

    # A new worker finishes it.
    result = helpers.run_manage(["runworker", "--burst"], worker_env)
    assert result.returncode == 0, result.stderr
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.attempt, row.requeue_count) == (Status.SUCCEEDED, 2, 1)
    assert event_types(run.pk)[-2:] == [transitions.STARTED, transitions.SUCCEEDED]
    notes = list(SideEffect.objects.filter(run_id=run.pk).values_list("attempt", "note"))
    assert notes == [(1, "start"), (2, "start"), (2, "end")]


# --------------------------------------------------------------------------- reap outcomes


@pytest.mark.django_db
def test_reap_requeues_a_lapsed_run() -> None:
    run, _ = claimed_run()
    assert reaper.reap(at(2)).stale == []  # lapses strictly after lease_expires
    report = reaper.reap(at(2.5))
    assert (report.stale, report.requeued, report.total) == ([run.pk], [run.pk], 1)
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.requeue_count, row.attempt, row.available_at) == \
        (Status.QUEUED, 1, 1, at(2.5))
    abandoned = RunEvent.objects.get(run_id=run.pk, type=transitions.ABANDONED)
    assert abandoned.payload == {"why": "lease lapsed", "worker": "A"}
    assert abandoned.attempt == 1


@pytest.mark.django_db
def test_reap_dead_letters_a_run_with_no_budget_left() -> None:
    """tests.always_fails has max_requeues=2: the third lost attempt is its last."""
    run = enqueue("tests.always_fails", run_after=T0)
    for n in range(3):
        [row] = claim("A", at(10 * n))
        assert (row.attempt, row.requeue_count) == (n + 1, n)
        report = reaper.reap(at(10 * n + 5))
        assert report.stale == [run.pk]
        if n < 2:
            assert report.requeued == [run.pk]
    assert report.dead_lettered == [run.pk]
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.reason, row.requeue_count, row.attempt) == \
        (Status.FAILED, Reason.RETRIES_EXHAUSTED, 2, 3)
    assert row.finished_at == at(25)
    assert row.lease_expires is None
    assert event_types(run.pk).count(transitions.ABANDONED) == 3
    assert event_types(run.pk)[-1] == transitions.DEAD_LETTERED
    assert claim("A", at(100)) == []


@pytest.mark.django_db
def test_reap_cancels_a_lapsed_run_that_was_asked_to_stop() -> None:
    run, _ = claimed_run()
    assert cancel(run.pk, "operator") is CancelResult.REQUESTED
    report = reaper.reap(at(3))
    assert report.cancelled == [run.pk]
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.reason, row.requeue_count) == (Status.CANCELLED, Reason.CANCELLED, 0)
    assert event_types(run.pk)[-2:] == [transitions.ABANDONED, transitions.CANCELLED]


# --------------------------------------------------------------------------- the race


@pytest.mark.django_db
@pytest.mark.parametrize("lands", ["renew", "emit", "checkpoint", "settle_succeeded",
                                   "settle_failed", "claim"])
def test_reaper_racing_a_live_worker_changes_nothing(lands: str) -> None:
    """find_stale reads the row; the owner's write lands; reap_one re-checks and backs off."""
    run, ref = claimed_run()
    reap_at = at(2.5)
    [row] = transitions.find_stale(reap_at, 10)
    assert row["id"] == run.pk

    # The slow-but-alive owner gets its write in between (at the reaper's own time).
    if lands == "renew":
        assert transitions.renew(ref, at=reap_at) is transitions.Renewal.OK
    elif lands == "emit":
        assert transitions.emit(ref, transitions.emitted_event_id(run.pk, 0, 0), "step", {},
                                at=reap_at) is transitions.Renewal.OK
    elif lands == "checkpoint":
        assert transitions.checkpoint(ref, {"s": 1}, 1, at=reap_at) is transitions.Renewal.OK
    elif lands == "settle_succeeded":
        assert transitions.settle_succeeded(ref, {}, at=reap_at) is Settlement.SUCCEEDED
    elif lands == "settle_failed":
        failure = transitions.policy.Failure(False)
        error = transitions.ErrorInfo("E", "e", "")
        assert transitions.settle_failed(ref, failure, error, at=reap_at) \
            is Settlement.DEAD_LETTERED
    else:  # another worker's claim took the lapsed run first
        assert [r.pk for r in claim("B", reap_at)] == [run.pk]
    before = snapshot(run.pk)

    assert transitions.reap_one(row, reap_at) is Settlement.LOST
    assert snapshot(run.pk) == before
    assert event_types(run.pk).count(transitions.ABANDONED) == (1 if lands == "claim" else 0)


@pytest.mark.django_db
def test_reap_reports_a_run_renewed_meanwhile_as_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    run, ref = claimed_run()
    found = transitions.find_stale

    def find_then_heartbeat(when: datetime, limit: int) -> list[dict[str, Any]]:
        rows = found(when, limit)
        assert transitions.renew(ref, at=when) is transitions.Renewal.OK
        return rows

    monkeypatch.setattr(transitions, "find_stale", find_then_heartbeat)
    report = reaper.reap(at(3))
    assert (report.stale, report.skipped, report.total) == ([run.pk], [run.pk], 0)
    assert AgentRun.objects.get(pk=run.pk).status == Status.RUNNING


# --------------------------------------------------------------------------- claims reclaim


@pytest.mark.django_db
def test_a_claim_takes_a_lapsed_run_directly() -> None:
    run, _ = claimed_run(worker="A")
    [row] = claim("B", at(3))
    assert row.pk == run.pk
    assert (row.status, row.claimed_by, row.attempt, row.requeue_count) == \
        (Status.RUNNING, "B", 2, 1)
    assert row.lease_expires == at(3) + timedelta(seconds=TTL)
    assert event_types(run.pk) == [transitions.STARTED, transitions.ABANDONED,
                                   transitions.RETRYING, transitions.STARTED]
    abandoned = RunEvent.objects.get(run_id=run.pk, type=transitions.ABANDONED)
    assert (abandoned.attempt, abandoned.payload["worker"]) == (1, "A")


@pytest.mark.django_db
def test_a_claim_dead_letters_a_lapsed_run_with_no_budget_left() -> None:
    run = enqueue("tests.always_fails", run_after=T0)  # max_requeues=2
    for n in range(3):
        [row] = claim("A", at(10 * n))
        assert row.attempt == n + 1
    assert claim("B", at(25)) == []
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.reason, row.attempt) == (Status.FAILED, Reason.RETRIES_EXHAUSTED, 3)


# --------------------------------------------------------------------------- the command


def reap_command(*args: str) -> str:
    out = StringIO()
    call_command("reap", *args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_reap_command_reports_what_it_did() -> None:
    live, _ = claimed_run(when=transitions.now())
    past = transitions.now() - timedelta(minutes=5)  # claimed then: long lapsed now
    stale = [claimed_run(when=past)[0], claimed_run(when=past)[0]]
    cancel(stale[1].pk)

    dry = reap_command("--dry-run")
    assert dry.strip() == f"2 stale runs: {sorted(r.pk for r in stale)}"
    assert all(AgentRun.objects.get(pk=r.pk).status == Status.RUNNING for r in stale)

    out = reap_command()
    assert out.strip() == ("stale 2: requeued 1, dead-lettered 0, cancelled 1, skipped 0 "
                           "(renewed or settled meanwhile)")
    assert AgentRun.objects.get(pk=stale[0].pk).status == Status.QUEUED
    assert AgentRun.objects.get(pk=stale[1].pk).status == Status.CANCELLED
    assert AgentRun.objects.get(pk=live.pk).status == Status.RUNNING

    assert reap_command().startswith("stale 0:")


@pytest.mark.django_db
def test_reap_command_limit() -> None:
    past = transitions.now() - timedelta(minutes=5)
    for _ in range(3):
        claimed_run(when=past)
    assert reap_command("--limit", "2").startswith("stale 2: requeued 2,")
    assert reap_command("--limit", "2").startswith("stale 1: requeued 1,")


@contextmanager
def runs_locked(ids: list[int]) -> Iterator[BaseDatabaseWrapper]:
    """Hold the runs' rows (PostgreSQL) or the database write lock (SQLite) on a second
    connection until the block ends, so that processes started inside it queue up on it."""
    other = connections.create_connection(DEFAULT_DB_ALIAS)
    table = AgentRun._meta.db_table
    try:
        with other.cursor() as cursor:
            if other.vendor == "postgresql":
                cursor.execute("BEGIN")
                cursor.execute(f"SELECT id FROM {table} WHERE id = ANY(%s) FOR UPDATE", [ids])
            else:
                cursor.execute("BEGIN IMMEDIATE")
        yield other
        with other.cursor() as cursor:
            cursor.execute("ROLLBACK")
    finally:
        other.close()


def waiting_on_locks() -> int:
    # Asked on the test's own connection: the locking one is inside a transaction, where
    # PostgreSQL keeps showing the statistics snapshot it took first.
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                       " AND wait_event_type = 'Lock'")
        return int(cursor.fetchone()[0])


@pytest.mark.slow
def test_two_reapers_at_once_reclaim_each_run_exactly_once(worker_env: dict[str, str]) -> None:
    runs = enqueue_many([{"agent": "tests.noop"} for _ in range(60)])
    ids = [r.pk for r in runs]
    past = transitions.now() - timedelta(minutes=5)
    AgentRun.objects.filter(pk__in=ids).update(available_at=past)
    assert len(claim("A", past)) == 60

    with runs_locked(ids) as other:
        procs = [helpers.start_manage(["reap"], worker_env) for _ in range(2)]
        if other.vendor == "postgresql":
            # Both reapers have listed the stale runs and wait on the first one's row: from
            # here on they contend for every run.
            helpers.wait_until(lambda: waiting_on_locks() >= 2,
                               message="both reapers to wait on the locked rows")
    outputs = []
    for proc in procs:
        with proc:
            assert proc.wait(timeout=60) == 0, proc.output()
            outputs.append(proc.stdout)
    reports = []
    for out in outputs:
        match = re.match(r"stale (\d+): requeued (\d+), dead-lettered 0, cancelled 0, "
                         r"skipped (\d+)", out)
        assert match, out
        stale, requeued, skipped = map(int, match.groups())
        assert stale == requeued + skipped
        reports.append((stale, requeued))
    assert sum(requeued for _, requeued in reports) == 60, outputs
    if connection.vendor == "postgresql":
        assert [stale for stale, _ in reports] == [60, 60], outputs

    assert set(AgentRun.objects.filter(pk__in=ids).values_list("status", "requeue_count")) == \
        {(Status.QUEUED, 1)}
    for run_id in ids:
        assert event_types(run_id) == [transitions.STARTED, transitions.ABANDONED,
                                       transitions.RETRYING]
