"""Attempts write through the worker's attempt store: real worker processes.

A worker's connections are bounded whatever its concurrency (writers, claim loop, lease
keeper, listener); writes of many attempts commit together, each fenced on its own; a
worker killed mid-batch loses nothing committed, and the rerun adds no duplicate.
"""

from __future__ import annotations

import json
import re
import signal
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import F

from django_agentruns import enqueue_many, transitions
from django_agentruns.api import RunRequest
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.runtime import reaper
from tests import helpers

pytestmark = pytest.mark.slow

STARTUP = re.compile(r"concurrency (\d+), (\d+) database connections")


def env_with(worker_env: dict[str, str], **settings: float) -> dict[str, str]:
    return {**worker_env, "AGENTRUNS_TEST_SETTINGS": json.dumps(settings)}


def others_sessions() -> int:
    """Sessions on this test's database besides the test's own."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                       "current_database() AND pid <> pg_backend_pid()")
        return int(cursor.fetchone()[0])


def steps_of(run_id: int) -> list[int]:
    return [p["i"] for p in RunEvent.objects.filter(run_id=run_id, type="step")
            .order_by("seq").values_list("payload", flat=True)]


def assert_story_once(run_id: int, steps: int) -> None:
    """Every step's event exactly once, in order, and seqs with no gap."""
    assert steps_of(run_id) == list(range(steps))
    seqs = list(RunEvent.objects.filter(run_id=run_id).order_by("seq")
                .values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1))


@pytest.mark.postgres_only
def test_300_sync_attempts_that_emit_hold_only_the_workers_stated_connections(
        worker_env: dict[str, str]) -> None:
    runs = enqueue_many([RunRequest("tests.writer", {"steps": 4, "sleep": 0.3})
                         for _ in range(300)])
    assert others_sessions() == 0
    seen: list[int] = []

    def all_done() -> bool:
        seen.append(others_sessions())
        return AgentRun.objects.filter(status=Status.SUCCEEDED).count() == len(runs)

    env = env_with(worker_env, LEASE_TTL=30.0)
    with helpers.start_manage(["runworker", "--concurrency", "300"], env) as worker:
        helpers.wait_until(lambda: STARTUP.search(worker.stdout), timeout=60,
                           message="the worker's startup line")
        started = STARTUP.search(worker.stdout)
        assert started is not None
        stated = int(started.group(2))
        # WRITER_CONNECTIONS, claim loop, keeper, listener, and the live-chunk sender
        # (only while agents stream: these don't, so the count seen stays below it).
        assert stated == 2 + 4
        helpers.wait_until(lambda: AgentRun.objects.filter(status=Status.RUNNING).count()
                           >= 200, timeout=60, message="most attempts running at once")
        helpers.wait_until(all_done, timeout=120, interval=0.05,
                           message="every run to succeed")
        assert worker.stop() == 0, worker.output()
    assert max(seen) <= stated, (max(seen), stated)
    assert max(seen) >= 3  # it was counting the worker's sessions at all
    for run in runs[:20]:
        assert_story_once(run.pk, 4)


@pytest.mark.parametrize("agent", ["tests.writer", "tests.async_writer"])
def test_an_attempt_whose_lease_was_taken_keeps_none_of_its_writes(
        worker_env: dict[str, str], agent: str) -> None:
    """Many attempts write together; one loses its run to another worker mid-way: its
    writes stop there (nothing of it after the theft), and every other run's commit."""
    steps = 60
    runs = enqueue_many([RunRequest(agent, {"steps": steps, "sleep": 0.02})
                         for _ in range(12)])
    victim = runs[5]
    env = env_with(worker_env, LEASE_TTL=30.0)
    with helpers.start_manage(["runworker", "--concurrency", "12"], env) as worker:
        helpers.wait_until(lambda: len(steps_of(victim.pk)) >= 3, timeout=60,
                           message="the victim to be writing")
        # Another worker takes the run, as a reclaim would (a new attempt, its own fence).
        assert AgentRun.objects.filter(pk=victim.pk, status=Status.RUNNING).update(
            claimed_by="thief", attempt=F("attempt") + 1,
            lease_expires=transitions.now() + timedelta(minutes=10))
        taken = RunEvent.objects.filter(run_id=victim.pk).count()
        others = [r.pk for r in runs if r.pk != victim.pk]
        helpers.wait_until(lambda: AgentRun.objects.filter(
            pk__in=others, status=Status.SUCCEEDED).count() == len(others), timeout=90,
            message="every other run to succeed")
        assert worker.stop() == 0, worker.output()
    assert RunEvent.objects.filter(run_id=victim.pk).count() == taken
    row = AgentRun.objects.get(pk=victim.pk)
    assert (row.status, row.claimed_by) == (Status.RUNNING, "thief")
    for pk in others:
        assert_story_once(pk, steps)


@pytest.mark.parametrize("agent", ["tests.writer", "tests.async_writer"])
def test_sigkill_mid_batch_loses_no_committed_event_and_the_rerun_adds_no_duplicate(
        worker_env: dict[str, str], agent: str) -> None:
    steps = 40
    runs = enqueue_many([RunRequest(agent, {"steps": steps, "sleep": 0.01})
                         for _ in range(20)])
    with helpers.start_manage(["runworker", "--concurrency", "20"], worker_env) as worker:
        helpers.wait_until(lambda: RunEvent.objects.filter(type="step").count() >= 200,
                           timeout=60, message="the attempts to be writing")
        committed = set(RunEvent.objects.values_list("event_id", flat=True))
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    after_kill = set(RunEvent.objects.values_list("event_id", flat=True))
    assert committed <= after_kill
    unfinished = AgentRun.objects.filter(status=Status.RUNNING).count()
    assert unfinished > 0  # killed mid-run, not after
    # The leases lapse (2 s) and are reaped; a new worker resumes the runs.
    def reaped() -> bool:
        reaper.reap()
        return not AgentRun.objects.filter(status=Status.RUNNING).exists()

    helpers.wait_until(reaped, timeout=60, message="the dead worker's leases to be reaped")
    result = helpers.run_manage(["runworker", "--burst", "--concurrency", "20"], worker_env)
    assert result.returncode == 0, result.stderr
    assert committed <= set(RunEvent.objects.values_list("event_id", flat=True))
    statuses = Counter(AgentRun.objects.values_list("status", flat=True))
    assert statuses == {Status.SUCCEEDED: len(runs)}
    for run in runs:
        assert_story_once(run.pk, steps)
