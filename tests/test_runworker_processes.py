"""`runworker --processes N`: a supervisor and N real worker processes, real signals.

Each child is a whole worker (its own slots, connections and record); a child that dies is
restarted and the runs it held are reclaimed once their leases lapse; SIGTERM to the
supervisor stops every child gracefully. Both databases.
"""

from __future__ import annotations

import os
import signal

import pytest

from django_agentruns import enqueue
from django_agentruns.models import AgentRun, Status, WorkerRecord
from tests import helpers
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.slow


def started(run_ids: list[int]) -> bool:
    return SideEffect.objects.filter(run_id__in=run_ids, note="start") \
        .values("run_id").distinct().count() == len(run_ids)


def pid_of(worker_id: str) -> int:
    return int(worker_id.split(":")[1])  # host:pid:random


def holders(run_ids: list[int]) -> dict[int, str]:
    return dict(AgentRun.objects.filter(pk__in=run_ids, status=Status.RUNNING)
                .values_list("pk", "claimed_by"))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_each_process_claims_and_sigterm_stops_them_all_gracefully(
        worker_env: dict[str, str]) -> None:
    runs = [enqueue("tests.gate").pk for _ in range(4)]
    with helpers.start_manage(["runworker", "--processes", "2", "--concurrency", "2",
                               "--grace", "1"], worker_env) as supervisor:
        helpers.wait_until(lambda: started(runs), timeout=60,
                           message=f"4 gate runs started\n{supervisor.output()}")
        held = holders(runs)
        workers = set(held.values())
        assert len(workers) == 2, held  # two processes, two slots each, all four running
        pids = {pid_of(w) for w in workers}
        assert supervisor.pid not in pids
        # Each process shows in `manage.py workers`, with its own record.
        listing = helpers.run_manage(["workers"], worker_env)
        assert listing.returncode == 0, listing.stderr
        for worker_id in workers:
            assert worker_id in listing.stdout, listing.stdout
        assert set(WorkerRecord.objects.values_list("worker_id", flat=True)) == workers

        supervisor.terminate()
        assert supervisor.wait(timeout=45) == 0, supervisor.output()
    for pid in pids:
        assert gone(pid), f"worker process {pid} outlived its supervisor"
    # Graceful: every run interrupted and requeued, its lease released; records removed.
    for run in AgentRun.objects.filter(pk__in=runs):
        assert (run.status, run.claimed_by, run.lease_expires) == (Status.QUEUED, "", None)
    assert not WorkerRecord.objects.exists()


def test_a_killed_process_is_restarted_and_its_runs_are_reclaimed(
        worker_env: dict[str, str]) -> None:
    runs = [enqueue("tests.gate").pk for _ in range(2)]
    with helpers.start_manage(["runworker", "--processes", "2", "--concurrency", "1",
                               "--grace", "1"], worker_env) as supervisor:
        helpers.wait_until(lambda: started(runs) and len(set(holders(runs).values())) == 2,
                           timeout=60, message=f"both runs held\n{supervisor.output()}")
        held = holders(runs)
        victim_run, victim = next(iter(held.items()))
        os.kill(pid_of(victim), signal.SIGKILL)
        helpers.wait_until(lambda: "died (signal SIGKILL)" in supervisor.stderr, timeout=60,
                           message=f"the supervisor to see the death\n{supervisor.output()}")
        # A new process (a new worker id) takes the run once its lease lapses.
        helpers.wait_until(
            lambda: holders([victim_run]).get(victim_run, victim) != victim, timeout=60,
            message=f"the killed process's run reclaimed\n{supervisor.output()}")
        reclaimed = AgentRun.objects.get(pk=victim_run)
        assert reclaimed.attempt == 2
        assert pid_of(reclaimed.claimed_by) != pid_of(victim)
        for run_id in runs:
            SideEffect.objects.create(run_id=run_id, note="open")
        helpers.wait_until(lambda: AgentRun.objects.filter(
            pk__in=runs, status=Status.SUCCEEDED).count() == 2, timeout=60,
            message=f"both runs to succeed\n{supervisor.output()}")
        supervisor.terminate()
        assert supervisor.wait(timeout=45) == 0, supervisor.output()
        assert "restarting it" in supervisor.stderr


def test_burst_processes_drain_the_queue_and_exit(worker_env: dict[str, str]) -> None:
    runs = [enqueue("tests.noop", {"n": i}).pk for i in range(20)]
    done = helpers.run_manage(["runworker", "--processes", "2", "--concurrency", "2",
                               "--burst"], worker_env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert AgentRun.objects.filter(pk__in=runs, status=Status.SUCCEEDED).count() == 20
    assert "worker process 0: claimed" in done.stdout, done.stdout
    assert "worker process 1: claimed" in done.stdout, done.stdout


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_processes_must_be_a_positive_count(worker_env: dict[str, str], value: str) -> None:
    done = helpers.run_manage(["runworker", "--processes", value, "--burst"], worker_env)
    assert done.returncode != 0
    assert "--processes" in done.stderr, done.stderr
    assert "must be a whole number" in done.stderr, done.stderr
