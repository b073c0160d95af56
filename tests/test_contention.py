"""Contention is not idleness: a burst worker leaves only when nothing it could run is left.

A burst worker whose claim came back empty while runs are still due (held by another
worker's transaction, or waiting behind another worker's running run) waits and tries
again, instead of exiting with work pending. The wait is bounded: a run that stays due but
unclaimable makes it raise `ContentionTimeout` after `max_contention_wait`, not hang.
Runs no worker can start by itself (behind a dead letter, or behind a run still backing
off) are not contention: a burst worker exits past them at once.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from django.db import connection, connections
from django.utils import timezone

from django_agentruns import RunRequest, enqueue, enqueue_many, transitions
from django_agentruns.models import AgentRun, Status
from django_agentruns.registry import scope_policy
from django_agentruns.runtime.worker import ContentionTimeout, Worker
from tests import helpers
from tests.testapp.models import SideEffect

ORDERED = "tests.ordered"
SCOPES, RUNS_PER_SCOPE = 2, 3


def pending() -> dict[int, str]:
    return dict(AgentRun.objects.exclude(status__in=[Status.SUCCEEDED, Status.FAILED,
                                                     Status.CANCELLED])
                .values_list("id", "status"))


def enqueue_round(tag: str) -> list[AgentRun]:
    return enqueue_many([RunRequest(ORDERED, {"n": i}, scope=f"{tag}-{s}", fired_seq=i)
                         for s in range(SCOPES) for i in range(RUNS_PER_SCOPE)])


def run_in_thread(worker: Worker, errors: list[BaseException],
                  left_queued: list[int] | None = None) -> threading.Thread:
    """Run `worker` in a thread; on its exit, note how many runs it left queued."""

    def target() -> None:
        try:
            worker.run(install_signals=False)
            if left_queued is not None:
                left_queued.append(AgentRun.objects.filter(status=Status.QUEUED).count())
        except BaseException as exc:
            errors.append(exc)
        finally:
            # Each thread has its own connection; close it, or PostgreSQL cannot drop
            # the test database at teardown.
            connections.close_all()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------- two workers


@pytest.mark.slow
def test_two_burst_workers_in_threads_leave_nothing_pending(transactional_db: None) -> None:
    """300 rounds on SQLite, 150 on PostgreSQL: both workers exit, every run of the round
    succeeded, in firing order.

    The worker that finds the next run of every scope held by the other's running run
    must wait for it, not leave: on exit, each worker leaves nothing queued. (The
    PostgreSQL pass is CI's longest and runs many other races on real row locks; the
    SQLite pass, which ends earlier, carries the long repetition.)
    """
    for round_ in range(150 if connection.vendor == "postgresql" else 300):
        runs = enqueue_round(f"r{round_}")
        errors: list[BaseException] = []
        workers = [Worker(burst=True, reap_interval=0, max_contention_wait=10)
                   for _ in range(2)]
        left_queued: list[int] = []
        threads = [run_in_thread(w, errors, left_queued) for w in workers]
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive(), f"round {round_}: a burst worker did not exit"
        assert errors == [], f"round {round_}"
        # Neither left while runs were still queued behind the other's running run.
        assert left_queued == [0, 0], f"round {round_}"
        assert pending() == {}, f"round {round_}"
        statuses = set(AgentRun.objects.filter(pk__in=[r.pk for r in runs])
                       .values_list("status", flat=True))
        assert statuses == {Status.SUCCEEDED}, f"round {round_}"
    for scope in AgentRun.objects.values_list("scope", flat=True).distinct():
        order = list(SideEffect.objects.filter(note=scope).order_by("id")
                     .values_list("step", flat=True))
        # A transient database error may retry a run (its rows then repeat in a row).
        assert [step for step, _ in itertools.groupby(order)] == list(range(RUNS_PER_SCOPE)), \
            scope


@pytest.mark.slow
def test_two_burst_worker_processes_leave_nothing_pending(worker_env: dict[str, str]) -> None:
    for round_ in range(3):
        runs = enqueue_round(f"p{round_}")
        workers = [helpers.start_manage(["runworker", "--burst"], worker_env)
                   for _ in range(2)]
        for w in workers:
            assert w.wait(60) == 0, w.output()
            w.close()
        assert pending() == {}, f"round {round_}"
        assert set(AgentRun.objects.filter(pk__in=[r.pk for r in runs])
                   .values_list("status", flat=True)) == {Status.SUCCEEDED}


# --------------------------------------------------------------------------- the bound


def hold_scope_with_live_lease(scope: str) -> AgentRun:
    """A run of `scope` running under a fake worker's lease that stays live for a minute."""
    enqueue(ORDERED, scope=scope, fired_seq=0)
    [held] = transitions.claim("fake-worker", ["default"], 1, scope_policy(),
                               {ORDERED: 60.0}, 60.0)
    return held


def test_a_scope_held_under_a_live_lease_raises_contention_timeout(
        transactional_db: None) -> None:
    held = hold_scope_with_live_lease("s")
    waiting = enqueue(ORDERED, scope="s", fired_seq=1)

    worker = Worker(burst=True, reap_interval=0, max_contention_wait=0.3)
    started = time.monotonic()
    with pytest.raises(ContentionTimeout):
        worker.run(install_signals=False)
    assert 0.3 <= time.monotonic() - started < 10
    assert worker.stats.claimed == 0
    assert AgentRun.objects.get(pk=waiting.pk).status == Status.QUEUED

    # Once the holder settles, the same kind of worker runs the scope and exits.
    transitions.settle_succeeded(transitions.AttemptRef(held.pk, held.attempt, "fake-worker",
                                                        60.0), None)
    Worker(burst=True, reap_interval=0, max_contention_wait=5).run(install_signals=False)
    assert AgentRun.objects.get(pk=waiting.pk).status == Status.SUCCEEDED


@pytest.fixture
def second_connection(transactional_db: None) -> Iterator[psycopg.Connection[object]]:
    params = connection.get_connection_params()
    conn = psycopg.connect(**{k: v for k, v in params.items()
                              if k in ("dbname", "user", "password", "host", "port")})
    yield conn
    conn.close()


@pytest.mark.postgres_only
def test_a_row_locked_by_another_connection_raises_contention_timeout(
        second_connection: psycopg.Connection[object]) -> None:
    run = enqueue(ORDERED, scope="s")
    with second_connection.transaction():
        second_connection.execute("SELECT id FROM django_agentruns_agentrun WHERE id = %s "
                                  "FOR UPDATE", [run.pk])
        worker = Worker(burst=True, reap_interval=0, max_contention_wait=0.3)
        with pytest.raises(ContentionTimeout):
            worker.run(install_signals=False)
        assert worker.stats.claimed == 0
    # The lock is gone: the run is claimable again.
    Worker(burst=True, reap_interval=0, max_contention_wait=5).run(install_signals=False)
    assert AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED


# --------------------------------------------------------------------------- not contention


def test_a_burst_worker_exits_past_a_scope_blocked_by_a_dead_letter(
        transactional_db: None) -> None:
    """No worker will ever start these runs without an operator: nothing to wait for."""
    enqueue("tests.ordered_blocking", {"fail": True}, scope="s", fired_seq=0)
    blocked = enqueue("tests.ordered_blocking", scope="s", fired_seq=1)
    free = enqueue(ORDERED, scope="t")

    worker = Worker(burst=True, reap_interval=0, max_contention_wait=2)
    worker.run(install_signals=False)
    assert worker.stats.claimed == 2
    assert AgentRun.objects.get(pk=free.pk).status == Status.SUCCEEDED
    assert AgentRun.objects.get(pk=blocked.pk).status == Status.QUEUED


def test_a_burst_worker_exits_past_a_scope_waiting_on_a_backoff(
        transactional_db: None) -> None:
    enqueue(ORDERED, scope="s", fired_seq=0, run_after=timedelta(minutes=5))
    behind = enqueue(ORDERED, scope="s", fired_seq=1, run_after=timezone.now())

    worker = Worker(burst=True, reap_interval=0, max_contention_wait=2)
    worker.run(install_signals=False)
    assert worker.stats.claimed == 0
    assert AgentRun.objects.get(pk=behind.pk).status == Status.QUEUED
