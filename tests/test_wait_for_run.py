"""`wait_for_run` / `await_run`: a caller blocks until a run is finished.

LISTEN/NOTIFY on PostgreSQL (a trigger of migration 0005 NOTIFYs each run that finishes),
polling on SQLite; `TimeoutError` past the timeout. Also: the waiting runs' gauge.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from django_agentruns import (
    DeliverResult,
    InvalidInputError,
    RunNotFoundError,
    await_run,
    deliver,
    enqueue,
    metrics,
    wait_for_run,
)
from django_agentruns.models import Status
from tests import helpers
from tests.test_waiting import until_status, worker

WAITER = """
import django, json, sys
django.setup()
from django_agentruns import wait_for_run
run = wait_for_run(int(sys.argv[1]), timeout=60)
print(json.dumps({"status": run.status, "output": run.output}), flush=True)
"""


def test_wait_for_run_from_another_process_returns_once_the_run_finishes(
        worker_env: dict[str, str]) -> None:
    run = enqueue("tests.waits")
    with worker(worker_env) as w:
        until_status(run.pk, Status.WAITING)
        proc = subprocess.Popen([sys.executable, "-c", WAITER, str(run.pk)], env=worker_env,
                                cwd=helpers.REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            # It is blocked in wait_for_run: the run is still waiting.
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
            assert deliver(run.pk, "go", "done") is DeliverResult.DELIVERED
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {
            "status": "succeeded", "output": {"got": "done"}}
        assert w.stop() == 0, w.output()


@pytest.mark.django_db(transaction=True)
def test_wait_for_run_times_out_and_checks_its_arguments() -> None:
    run = enqueue("tests.waits")
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        wait_for_run(run.pk, timeout=0.3)
    assert time.monotonic() - began < 10
    with pytest.raises(TimeoutError):
        asyncio.run(await_run(run.pk, timeout=0.2))
    with pytest.raises(RunNotFoundError):
        wait_for_run(run.pk + 100, timeout=1)
    with pytest.raises(InvalidInputError):
        wait_for_run(run.pk, timeout=-1)
    with pytest.raises(InvalidInputError):
        wait_for_run("nope")  # type: ignore[arg-type]


@pytest.mark.django_db(transaction=True)
def test_a_finished_run_is_returned_at_once() -> None:
    from django_agentruns import cancel

    run = enqueue("tests.noop")
    cancel(run.pk)
    assert wait_for_run(run.pk, timeout=0).status == Status.CANCELLED


@pytest.mark.django_db(transaction=True)
def test_waiting_runs_are_counted_per_queue() -> None:
    from django_agentruns.worker import Worker

    enqueue("tests.waits")
    enqueue("tests.waits", {"key": "other"})
    Worker(queues=["waiting"], burst=True, reap_interval=0).run(install_signals=False)
    assert metrics.read_backlog().waiting == {"waiting": 2}


@pytest.mark.postgres_only
def test_a_delivery_wakes_the_queue_and_a_finished_run_notifies_its_id(
        worker_env: dict[str, str]) -> None:
    """Migration 0005's triggers: waiting -> queued NOTIFYs the queue's workers (as an
    operator's retry does), and a run that finishes NOTIFYs agentruns_finished."""
    import psycopg
    from django.db import connection

    from django_agentruns.notify import CHANNEL
    from django_agentruns.waiting import FINISHED_CHANNEL
    from tests.test_notify import sent_before_sentinel

    run = enqueue("tests.waits")
    with worker(worker_env) as w:
        until_status(run.pk, Status.WAITING)
        assert w.stop() == 0, w.output()
    with psycopg.connect(helpers.database_url(connection.settings_dict),
                         autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        listener.execute(f"LISTEN {FINISHED_CHANNEL}")
        deliver(run.pk, "go", 1)
        assert sent_before_sentinel(listener) == ["waiting"]
        from django_agentruns import cancel

        cancel(run.pk)
        assert sent_before_sentinel(listener) == [str(run.pk)]


@pytest.mark.django_db
@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), float("-inf"), -1, "5", True])
def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_refused(timeout: object) -> None:
    """NaN used to wait for ever (it compares false with every deadline)."""
    from django_agentruns import InvalidInputError
    from django_agentruns.models import AgentRun
    from django_agentruns.receiving import deadline_after

    run = enqueue("tests.noop")  # finished: a wait that is not refused returns at once
    AgentRun.objects.filter(pk=run.pk).update(status=Status.SUCCEEDED)
    with pytest.raises(InvalidInputError, match="timeout must be"):
        wait_for_run(run.pk, timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="timeout must be"):
        asyncio.run(await_run(run.pk, timeout=timeout))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="timeout must be"):
        deadline_after(timeout)  # ctx.receive, request_approval, wait_for_runs
