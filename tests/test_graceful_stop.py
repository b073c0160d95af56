"""Graceful stop (guarantee 8), with real `runworker` processes and real signals.

SIGTERM (or SIGINT): no new claims; running attempts get `--grace` seconds to finish and
are recorded as they end; the ones still running then are stopped at their next step
boundary and recorded as interrupted (requeued without spending the budget: a graceful
stop is not a failure), their leases released;
the process exits 0. A second signal exits at once with a non-zero status, leaving the
run to its lease. Either way no transaction is left open behind.
"""

from __future__ import annotations

import signal
import sqlite3
import time
from typing import Any

import pytest
from django.db import connection, transaction

from django_agentruns import enqueue, transitions
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.runtime import reaper
from tests import helpers
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.slow

SIGNALS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGINT, id="SIGINT")]


def run(run_id: int) -> AgentRun:
    return AgentRun.objects.get(pk=run_id)


def events(run_id: int) -> list[RunEvent]:
    return list(RunEvent.objects.filter(run_id=run_id).order_by("seq"))


def notes(run_id: int) -> list[str]:
    return list(SideEffect.objects.filter(run_id=run_id).order_by("id")
                .values_list("note", flat=True))


def open_gate(run_id: int) -> None:
    SideEffect.objects.create(run_id=run_id, note="open")


def wait_for_log(worker: helpers.ManageProcess, text: str) -> None:
    helpers.wait_until(lambda: text in worker.stderr, message=f"worker log {text!r}")


def assert_database_unlocked() -> None:
    """A new write transaction starts and commits at once: no lock was left behind."""
    began = time.monotonic()
    if connection.vendor == "postgresql":
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '1s'")
            # Every run row, locked for update: a row lock held by a dead session fails here.
            rows = list(AgentRun.objects.select_for_update().values_list("pk", flat=True))
            SideEffect.objects.create(run_id=0, note="lock check")
        assert rows
    else:
        raw = sqlite3.connect(str(connection.settings_dict["NAME"]), timeout=1.0,
                              isolation_level=None)
        try:
            raw.execute("BEGIN IMMEDIATE")  # takes the database's write lock, or fails
            raw.execute("INSERT INTO testapp_sideeffect (run_id, step, attempt, worker, note, "
                        "created_at) VALUES (0, 0, 0, '', 'lock check', CURRENT_TIMESTAMP)")
            raw.execute("COMMIT")
        finally:
            raw.close()
    took = time.monotonic() - began
    assert took < 1.0, f"a new transaction waited {took:.2f}s for a lock"
    assert SideEffect.objects.filter(note="lock check").exists()


def types(run_id: int) -> list[str]:
    return [e.type for e in events(run_id)]


@pytest.mark.parametrize("sig", SIGNALS)
def test_guarantee_8_graceful_stop(worker_env: dict[str, str], sig: signal.Signals) -> None:
    grace = 3.0
    finishes = enqueue("tests.gate")  # ends when the test opens its gate, within the grace
    overstays = enqueue("tests.gate")  # never opened: still running when the grace is over
    waiting = enqueue("tests.noop", priority=-1)  # claimed after those two, if ever

    with helpers.start_manage(["runworker", "--concurrency", "2", "--grace", str(grace)],
                              worker_env) as worker:
        helpers.wait_until(lambda: notes(finishes.pk) == ["start"] and notes(overstays.pk) == [
            "start"], message="both attempts running")
        assert run(waiting.pk).status == Status.QUEUED  # both slots are taken

        worker.send_signal(sig)
        signalled = time.monotonic()
        wait_for_log(worker, f"signal {sig.name}: stopping")
        # A slot frees up within the grace; the stopping worker must not fill it.
        open_gate(finishes.pk)
        helpers.wait_until(lambda: run(finishes.pk).status == Status.SUCCEEDED,
                           timeout=grace, message="the attempt to finish within the grace")
        assert worker.wait(timeout=grace + 15) == 0, worker.output()
        took = time.monotonic() - signalled
        assert took >= grace - 0.5, f"exited {took:.2f}s after the signal, before the grace"
        assert "claimed 2 runs" in worker.stdout

    # (a) Finished within the grace: recorded as it ended.
    done = run(finishes.pk)
    assert (done.status, done.reason, done.output) == (Status.SUCCEEDED, Reason.COMPLETED,
                                                       {"gate": "opened"})
    assert notes(finishes.pk) == ["start", "open", "end"]
    assert types(finishes.pk) == ["run.started", "run.succeeded"]

    # (b) Still running after the grace: interrupted and requeued with its budget whole,
    # its lease released.
    left = run(overstays.pk)
    assert (left.status, left.reason, left.attempt, left.requeue_count) == (
        Status.QUEUED, Reason.NONE, 1, 0)
    assert (left.claimed_by, left.lease_expires) == ("", None)
    assert left.error_type == ""
    assert types(overstays.pk) == ["run.started", "run.interrupted"]
    interrupted: dict[str, Any] = events(overstays.pk)[1].payload
    assert interrupted["why"] == "the worker stopped"
    assert notes(overstays.pk) == ["start"]  # stopped at a boundary: it never reached "end"

    # No new claims after the signal.
    queued = run(waiting.pk)
    assert (queued.status, queued.attempt) == (Status.QUEUED, 0)
    assert types(waiting.pk) == []

    assert_database_unlocked()


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_second_signal_exits_at_once_and_leaves_the_run_to_its_lease(
    worker_env: dict[str, str], sig: signal.Signals,
) -> None:
    held = enqueue("tests.gate")
    with helpers.start_manage(["runworker", "--grace", "60"], worker_env) as worker:
        helpers.wait_until(lambda: notes(held.pk) == ["start"], message="the attempt running")
        owner = run(held.pk).claimed_by
        worker.send_signal(sig)
        wait_for_log(worker, f"signal {sig.name}: stopping")
        again = time.monotonic()
        worker.send_signal(sig)
        returncode = worker.wait(timeout=60)
        took = time.monotonic() - again
        assert returncode != 0, worker.output()
        assert took < 2.0, f"the second signal took {took:.2f}s to end the process"
        assert "second signal: exiting at once" in worker.stderr

    # Nothing was recorded for the attempt: the run is still running under the dead worker.
    row = run(held.pk)
    assert (row.status, row.claimed_by, row.attempt) == (Status.RUNNING, owner, 1)
    assert types(held.pk) == ["run.started"]
    checked = transitions.now()
    assert row.lease_expires is not None
    assert row.lease_expires > checked
    assert reaper.reap(at=checked).stale == []  # not before its lease lapses
    assert_database_unlocked()

    # Its lease lapses (no one renews it now), and then it is taken back. Read afresh each
    # time: a renewal the worker sent just before it died may still commit after the read
    # above (the server runs a statement to its end before it notices the client gone).
    def lapsed() -> bool:
        expires = run(held.pk).lease_expires
        return expires is not None and transitions.now() > expires

    helpers.wait_until(lapsed, timeout=60, message="the lease to lapse")
    assert reaper.reap().requeued == [held.pk]
    row = run(held.pk)
    assert (row.status, row.requeue_count, row.claimed_by) == (Status.QUEUED, 1, "")
    assert types(held.pk) == ["run.started", "run.abandoned", "run.retrying"]
    assert events(held.pk)[1].payload["why"] == "lease lapsed"


def test_an_attempt_that_reaches_no_boundary_is_interrupted_by_the_worker(
    worker_env: dict[str, str],
) -> None:
    """Agent code stuck in `time.sleep` cannot be stopped: once the grace (and a moment
    for an in-flight storage call) is over, the worker records the attempt interrupted
    itself, releases the lease, and exits 0 without waiting for the thread."""
    stuck = enqueue("tests.busy_sleep")
    with helpers.start_manage(["runworker", "--grace", "1"], worker_env) as worker:
        helpers.wait_until(lambda: notes(stuck.pk) == ["start"], message="the attempt running")
        worker.terminate()
        assert worker.wait(timeout=60) == 0, worker.output()
        assert "agent stuck" in worker.stderr

    row = run(stuck.pk)
    assert (row.status, row.requeue_count, row.claimed_by, row.lease_expires) == (
        Status.QUEUED, 0, "", None)
    assert types(stuck.pk) == ["run.started", "run.interrupted"]
    assert "end" not in notes(stuck.pk)
    assert_database_unlocked()
