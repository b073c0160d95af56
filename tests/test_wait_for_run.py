"""`wait_for_run` / `await_run`: a caller blocks until a run is finished.

LISTEN/NOTIFY on PostgreSQL (a trigger of migration 0005 NOTIFYs each run that finishes),
polling on SQLite; `TimeoutError` past the timeout. Also: the waiting runs' gauge.
"""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings

from django_agentruns import (
    DeliverResult,
    InvalidInputError,
    RunNotFoundError,
    TooManyWaitersError,
    await_run,
    deliver,
    enqueue,
    wait_for_run,
)
from django_agentruns.models import AgentRun, Status
from django_agentruns.ops import metrics
from django_agentruns.streaming import waiters
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
    from django_agentruns.runtime.worker import Worker

    enqueue("tests.waits")
    enqueue("tests.waits", {"key": "other"})
    Worker(queues=["waiting"], burst=True, reap_interval=0).run(install_signals=False)
    assert metrics.read_backlog().waiting == {"waiting": 2}


@pytest.mark.postgres_only
def test_a_delivery_wakes_the_queue_and_a_finished_run_notifies_its_id(
        worker_env: dict[str, str]) -> None:
    """The triggers: waiting -> queued NOTIFYs the queue's workers (as an operator's retry
    does), and a run that finishes NOTIFYs agentruns_finished, if someone watches it."""
    import psycopg
    from django.db import connection

    from django_agentruns.db import CHANNEL
    from django_agentruns.streaming.waiters import FINISHED_CHANNEL, WATCH_TABLE
    from tests.test_notify import sent_before_sentinel

    run = enqueue("tests.waits")
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {WATCH_TABLE} (run_id, watcher) VALUES (%s, 'test')",
                       [run.pk])
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


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_run_nobody_waits_for_finishes_without_a_notify() -> None:
    """Every NOTIFY costs each LISTENing session of the database (each worker's listener) a
    transaction: a run no waiter watches finishes silently."""
    import psycopg
    from django.db import connection

    from django_agentruns import cancel
    from django_agentruns.db import CHANNEL
    from django_agentruns.streaming.waiters import FINISHED_CHANNEL, WATCH_TABLE
    from tests.test_notify import sent_before_sentinel

    unwatched, watched = parked_runs(2)
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {WATCH_TABLE} (run_id, watcher) VALUES (%s, 'test')",
                       [watched])
    with psycopg.connect(helpers.database_url(connection.settings_dict),
                         autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")  # the sentinel's
        listener.execute(f"LISTEN {FINISHED_CHANNEL}")
        cancel(unwatched)
        cancel(watched)
        assert sent_before_sentinel(listener) == [str(watched)]


# --------------------------------------------------------------------------- shared listener

def parked_runs(n: int) -> list[int]:
    """Runs no worker takes (due in an hour): the test finishes them itself."""
    return [enqueue("tests.noop", {"n": i}, run_after=3600).pk for i in range(n)]


def finish(run_ids: list[int], *, close: bool = False) -> None:
    for rid in run_ids:  # one by one: each with its own output, as a settle commits both
        with transaction.atomic():
            AgentRun.objects.filter(pk=rid).update(status=Status.SUCCEEDED)
            helpers.store_payloads([rid], "output", {"id": rid})
    if close:  # another thread's: give its connection back
        connection.close()


def connections_to_this_database() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                       "current_database()")
        return int(cursor.fetchone()[0])


@pytest.mark.django_db(transaction=True)
def test_concurrent_waiters_share_one_listener_and_hold_no_connection_each() -> None:
    sync_ids, async_ids = parked_runs(15), parked_runs(5)
    got: dict[int, tuple[str, Any]] = {}

    def wait(rid: int) -> None:
        run = wait_for_run(rid, timeout=60)
        got[rid] = (run.status, run.output)
        connection.close()  # SQLite's polling used this thread's connection

    async def await_all() -> None:
        for run in await asyncio.gather(*(await_run(rid, timeout=60) for rid in async_ids)):
            got[run.pk] = (run.status, run.output)

    baseline = connections_to_this_database() if connection.vendor == "postgresql" else 0
    threads = [threading.Thread(target=wait, args=(rid,)) for rid in sync_ids]
    threads.append(threading.Thread(target=lambda: asyncio.run(await_all())))
    for thread in threads:
        thread.start()
    helpers.wait_until(lambda: waiters.slots.taken == 20, message="20 callers waiting")
    if connection.vendor == "postgresql":
        helpers.wait_until(lambda: len(waiters.listener) == 20 and waiters.listener.connected,
                           message="every waiter registered with the listener")
        # 20 callers: the listener's LISTEN connection and its reads', not 2 per caller.
        assert connections_to_this_database() - baseline <= 2
    assert got == {}  # nothing finished yet: all still wait
    finish(sync_ids + async_ids)
    for thread in threads:
        thread.join(60)
    assert got == {rid: ("succeeded", {"id": rid}) for rid in sync_ids + async_ids}
    assert waiters.slots.taken == 0


@pytest.mark.django_db(transaction=True)
def test_past_waiters_per_process_a_caller_is_refused_naming_the_setting() -> None:
    first, second = parked_runs(2)
    with override_settings(AGENTRUNS={"WAITERS_PER_PROCESS": 2}):
        threads = [threading.Thread(target=wait_for_run, args=(rid,), kwargs={"timeout": 60})
                   for rid in (first, second)]
        for thread in threads:
            thread.start()
        helpers.wait_until(lambda: waiters.slots.taken == 2, message="two callers waiting")
        with pytest.raises(TooManyWaitersError, match=r"WAITERS_PER_PROCESS"):
            wait_for_run(first, timeout=1)
        with pytest.raises(TooManyWaitersError, match=r"WAITERS_PER_PROCESS"):
            asyncio.run(await_run(first, timeout=1))
        finish([first, second])
        for thread in threads:
            thread.join(60)
        assert waiters.slots.taken == 0
        assert wait_for_run(first, timeout=5).status == Status.SUCCEEDED  # a slot again


@pytest.mark.django_db(transaction=True)
def test_await_run_holds_no_thread_of_the_loops_executor() -> None:
    run_ids = parked_runs(4)

    async def scenario() -> list[str]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
        waits = [asyncio.ensure_future(await_run(rid, timeout=60)) for rid in run_ids]
        while waiters.slots.taken < len(run_ids):
            await asyncio.sleep(0.01)
        # Four waiters blocking the executor's one thread would starve this call.
        assert await asyncio.wait_for(loop.run_in_executor(None, lambda: "free"), 10) == "free"
        await loop.run_in_executor(None, functools.partial(finish, run_ids, close=True))
        return [run.status for run in await asyncio.gather(*waits)]

    assert asyncio.run(scenario()) == ["succeeded"] * 4


@pytest.mark.django_db
@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), float("-inf"), -1, "5", True])
def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_refused(timeout: object) -> None:
    """NaN used to wait for ever (it compares false with every deadline)."""
    from django_agentruns import InvalidInputError
    from django_agentruns.runtime.receiving import deadline_after

    run = enqueue("tests.noop")  # finished: a wait that is not refused returns at once
    AgentRun.objects.filter(pk=run.pk).update(status=Status.SUCCEEDED)
    with pytest.raises(InvalidInputError, match="timeout must be"):
        wait_for_run(run.pk, timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="timeout must be"):
        asyncio.run(await_run(run.pk, timeout=timeout))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="timeout must be"):
        deadline_after(timeout)  # ctx.receive, request_approval, wait_for_runs
