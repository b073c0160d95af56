"""A worker survives its database: a failed pass or a dropped connection is logged, the
worker keeps serving, and no run is lost (at worst an attempt is retried)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
from django.db import OperationalError, connection

from django_agentruns import enqueue, transitions
from django_agentruns.models import AgentRun, Status
from django_agentruns.runtime.worker import Worker
from django_agentruns.transitions import Result, SucceedWrite, Write, batched
from tests import helpers


def statuses(run_ids: list[int]) -> dict[int, str]:
    return dict(AgentRun.objects.filter(pk__in=run_ids).values_list("pk", "status"))


def all_succeeded(run_ids: list[int]) -> bool:
    return set(statuses(run_ids).values()) == {Status.SUCCEEDED}


def terminate_other_backends() -> int:
    """Kill every other session on the test database (the worker's), as a failover would."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        row = cursor.fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.slow
@pytest.mark.postgres_only
def test_worker_survives_its_connections_being_terminated_mid_run(
    worker_env: dict[str, str],
) -> None:
    runs = [enqueue("tests.steps", {"steps": 4, "sleep": 0.2}).pk for _ in range(4)]
    def progress() -> set[tuple[int, int, int]]:
        return set(AgentRun.objects.filter(
            pk__in=runs, status=Status.RUNNING, checkpoint_count__gte=1,
        ).values_list("pk", "attempt", "checkpoint_count"))

    seen: set[tuple[int, int, int]] = set()

    def kill_mid_run() -> bool:
        """Once an attempt has made progress since the last kill (so it is inside the agent,
        between step boundaries, on a live connection), kill the worker's sessions."""
        return bool(progress() - seen) and terminate_other_backends() >= 1

    with helpers.start_manage(["runworker", "--concurrency", "2"], worker_env) as worker:
        for round_ in range(2):
            helpers.wait_until(kill_mid_run, message=f"an attempt mid-run to kill ({round_})")
            seen |= progress()  # a dead attempt makes no more progress
        helpers.wait_until(lambda: all_succeeded(runs), timeout=60,
                           message="every run to succeed")
        assert worker.returncode is None, worker.output()  # still serving

        # And it goes on serving new work.
        later = enqueue("tests.steps", {"steps": 2}).pk
        helpers.wait_until(lambda: all_succeeded([later]), timeout=60,
                           message="a run enqueued after the failures")
        log = worker.stderr
        assert worker.stop() == 0, worker.output()

    # Logged: as the failed attempt's error (requeued), or as a settle or keeper failure.
    assert "OperationalError" in log, log
    rows = list(AgentRun.objects.filter(pk__in=runs))
    for row in rows:
        assert row.output == {"steps": 4}
        assert row.checkpoint_count == 4
    assert max(row.attempt for row in rows) >= 2  # a kill landed mid-run: that run was retried


@pytest.mark.django_db(transaction=True)
def test_a_failed_worker_pass_is_logged_and_retried(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    real_claim = transitions.settle_and_claim  # the claim loop's one call per pass
    calls: list[int] = []

    def claim_failing_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError("disk I/O error")
        return real_claim(*args, **kwargs)

    monkeypatch.setattr(transitions, "settle_and_claim", claim_failing_once)
    queued = enqueue("tests.noop", {"n": 1})
    worker = Worker(burst=True, reap_interval=0)
    with caplog.at_level(logging.ERROR, logger="django_agentruns.worker"):
        stats = worker.run(install_signals=False)

    assert stats.pass_errors == 1
    assert stats.claimed == 1
    assert len(calls) >= 2
    failures = [r for r in caplog.records if "worker pass failed" in r.getMessage()]
    assert len(failures) == 1
    assert failures[0].exc_info is not None
    assert isinstance(failures[0].exc_info[1], OperationalError)
    row = AgentRun.objects.get(pk=queued.pk)
    assert (row.status, row.attempt, row.output) == (Status.SUCCEEDED, 1,
                                                     {"ok": True, "input": {"n": 1}})


@pytest.mark.django_db(transaction=True)
def test_an_outcome_that_fails_to_record_is_retried_within_the_lease(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A settle that meets a database error (e.g. 'too many clients') is tried again, so the
    run is not left running for the reaper to take back."""
    real_apply = batched.apply_writes
    calls: list[int] = []

    def settle_failing_twice(writes: Sequence[Write]) -> list[Result]:
        # The worker's attempt store writes the success: it fails twice, then goes.
        if any(isinstance(w, SucceedWrite) for w in writes):
            calls.append(1)
            if len(calls) <= 2:
                raise OperationalError("FATAL:  sorry, too many clients already")
        return real_apply(writes)

    monkeypatch.setattr(batched, "apply_writes", settle_failing_twice)
    # On PostgreSQL a success goes to the claim loop's settle-and-claim statement first:
    # that fails too, and hands it to the store, whose writes are the ones tried again.
    real_settle_and_claim = transitions.settle_and_claim

    def handing_to_the_store(worker_id: str, successes: Any, *args: Any, **kwargs: Any) -> Any:
        if successes:
            raise OperationalError("FATAL:  sorry, too many clients already")
        return real_settle_and_claim(worker_id, successes, *args, **kwargs)

    monkeypatch.setattr(transitions, "settle_and_claim", handing_to_the_store)
    queued = enqueue("tests.noop", {"n": 2})
    with caplog.at_level(logging.WARNING, logger="django_agentruns.worker"):
        stats = Worker(burst=True, reap_interval=0).run(install_signals=False)

    assert len(calls) == 3
    assert stats.settled == {"succeeded": 1}
    retries = [r for r in caplog.records if "recording the outcome failed" in r.getMessage()]
    assert len(retries) == 2
    row = AgentRun.objects.get(pk=queued.pk)
    assert (row.status, row.attempt, row.requeue_count) == (Status.SUCCEEDED, 1, 0)


@pytest.mark.slow
@pytest.mark.postgres_only
def test_an_idle_workers_record_beats_again_after_its_backends_are_terminated(
    worker_env: dict[str, str],
) -> None:
    """The presence beat's connection, killed by the database, is replaced on the next beat
    (it used to fail every beat on the dead connection: a live worker looked gone)."""
    import json

    from django.utils import timezone

    from django_agentruns.models import WorkerRecord

    env = {**worker_env, "AGENTRUNS_TEST_SETTINGS": json.dumps({"LEASE_TTL": 1.5})}
    with helpers.start_manage(["runworker"], env) as worker:
        first = helpers.wait_until(lambda: WorkerRecord.objects.first(),
                                   message="the worker's record")
        helpers.wait_until(lambda: WorkerRecord.objects.get().last_seen_at > first.last_seen_at,
                           message="a first beat")
        for round_ in range(3):  # each round kills the connections the last one reopened
            assert terminate_other_backends() >= 1
            killed_at = timezone.now()
            helpers.wait_until(lambda k=killed_at: WorkerRecord.objects.get().last_seen_at > k,
                               timeout=15, message=f"a beat after the kill ({round_})")
        assert worker.returncode is None, worker.output()
