"""Checkpoints: fenced JSON resume state that the next attempt, however it comes, resumes from.

`ctx.checkpoint(state)` stores the state and the checkpoint count in one guarded UPDATE
that also renews the lease. Whatever ends an attempt (a failure and its retry, a SIGKILL
and the reaper, a graceful stop), the next attempt sees `ctx.state` and does not redo the
steps before it.
"""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest
from django.utils import timezone

from django_agentruns import cancel, enqueue, transitions
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.outcomes import AttemptRef, Renewal
from django_agentruns.registry import scope_policy
from django_agentruns.runtime import reaper
from django_agentruns.runtime.worker import Worker
from tests import helpers
from tests.testapp.models import SideEffect

STEPS = 6

# Each test runs on plain history tables and on partitioned ones (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("history_layout")


def claim_one(worker: str = "w-test", ttl: float = 2.0) -> AttemptRef:
    [run] = transitions.claim(worker, ["default"], 1, scope_policy(), {}, ttl)
    return AttemptRef(run.pk, run.attempt, worker, ttl)


def resumed_from(run: AgentRun) -> list[str]:
    """Where each attempt began, as tests.resumable notes it."""
    return list(SideEffect.objects.filter(run_id=run.pk, step=-1).order_by("id")
                .values_list("note", flat=True))


def steps_done(run: AgentRun) -> list[tuple[int, int]]:
    """(step, attempt) for every step tests.resumable executed, in order."""
    return list(SideEffect.objects.filter(run_id=run.pk, step__gte=0).order_by("id")
                .values_list("step", "attempt"))


def assert_resumed_at_checkpoint(run: AgentRun, saved: int) -> None:
    """Attempt 2 began at checkpoint `saved`; steps before it ran once, in attempt 1."""
    assert resumed_from(run) == ["resume:0", f"resume:{saved}"]
    done = steps_done(run)
    assert [s for s, a in done if a == 1][:saved] == list(range(saved))
    assert [s for s, _ in done if s < saved] == list(range(saved))
    assert [s for s, a in done if a == 2] == list(range(saved, STEPS))


# --------------------------------------------------------------------------- the write


def test_checkpoint_stores_json_state_and_count_and_renews_the_lease(db: None) -> None:
    run = enqueue("tests.noop")
    ref = claim_one()
    at = timezone.now() + timedelta(seconds=1)
    state = {"step": 2, "notes": ["a", None, 1.5]}

    assert transitions.checkpoint(ref, state, 1, at=at) is Renewal.OK

    run.refresh_from_db()
    assert run.checkpoint_state == state
    assert run.checkpoint_count == 1
    assert run.lease_expires == at + timedelta(seconds=2)
    event = RunEvent.objects.get(run=run, type=transitions.CHECKPOINT)
    assert event.payload == {"count": 1}
    assert event.attempt == ref.attempt


def test_checkpoint_is_fenced(db: None) -> None:
    run = enqueue("tests.noop")
    ref = claim_one()
    assert transitions.checkpoint(ref, {"step": 1}, 1) is Renewal.OK

    for stale in (AttemptRef(ref.run_id, ref.attempt, "someone-else", 2.0),
                  AttemptRef(ref.run_id, ref.attempt + 1, ref.worker_id, 2.0)):
        assert transitions.checkpoint(stale, {"step": 99}, 2) is Renewal.LOST
    run.refresh_from_db()
    assert (run.checkpoint_state, run.checkpoint_count) == ({"step": 1}, 1)

    # A requested cancel wins: the state is not saved and the attempt is told to stop.
    cancel(run.pk)
    assert transitions.checkpoint(ref, {"step": 2}, 2) is Renewal.CANCEL_REQUESTED
    run.refresh_from_db()
    assert (run.checkpoint_state, run.checkpoint_count) == ({"step": 1}, 1)

    transitions.settle_cancelled(ref)
    assert transitions.checkpoint(ref, {"step": 3}, 2) is Renewal.LOST
    assert RunEvent.objects.filter(run=run, type=transitions.CHECKPOINT).count() == 1


def test_non_json_state_fails_the_attempt_as_not_retryable(transactional_db: None) -> None:
    run = enqueue("tests.bad_checkpoint")
    Worker(burst=True, reap_interval=0).run(install_signals=False)

    run.refresh_from_db()
    assert run.status == Status.FAILED
    assert run.reason == Reason.NOT_RETRYABLE
    assert run.error_type == "django_agentruns.exceptions.InvalidInputError"
    assert "Checkpoint state must be JSON-serialisable" in run.error_message
    assert "object" in run.error_message
    assert (run.checkpoint_state, run.checkpoint_count) == (None, 0)
    assert SideEffect.objects.filter(run_id=run.pk).count() == 1  # never retried


# --------------------------------------------------------------------------- resuming


def test_the_attempt_after_a_retry_resumes_from_the_checkpoint(transactional_db: None) -> None:
    run = enqueue("tests.resumable", {"steps": STEPS, "fail_at": 2})
    Worker(burst=True, reap_interval=0).run(install_signals=False)

    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED
    assert run.attempt == 2
    assert run.checkpoint_count == STEPS
    assert steps_done(run) == [(0, 1), (1, 1)] + [(s, 2) for s in range(2, STEPS)]
    assert_resumed_at_checkpoint(run, 2)


def start_and_wait_for_checkpoints(env: dict[str, str], run: AgentRun,
                                   extra: list[str]) -> helpers.ManageProcess:
    worker = helpers.start_manage(["runworker", *extra], env)
    helpers.wait_until(
        lambda: AgentRun.objects.get(pk=run.pk).checkpoint_count >= 2,
        message="two checkpoints saved")
    return worker


def finish_with_a_burst_worker(env: dict[str, str]) -> None:
    result = helpers.run_manage(["runworker", "--burst"], env)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_the_attempt_after_a_sigkill_and_reap_resumes(worker_env: dict[str, str]) -> None:
    run = enqueue("tests.resumable", {"steps": STEPS, "sleep": 0.2})
    worker = start_and_wait_for_checkpoints(worker_env, run, [])
    worker.kill()
    worker.wait()
    killed = AgentRun.objects.get(pk=run.pk)
    assert killed.status == Status.RUNNING
    saved = killed.checkpoint_count

    report = helpers.wait_until(lambda: reaper.reap().requeued, timeout=60,
                                message="the dead worker's lease to lapse and be reaped")
    assert report == [run.pk]
    finish_with_a_burst_worker(worker_env)

    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED
    assert run.attempt == 2
    assert RunEvent.objects.filter(run=run, type=transitions.ABANDONED).count() == 1
    assert_resumed_at_checkpoint(run, saved)


@pytest.mark.slow
def test_the_attempt_after_a_graceful_stop_resumes(worker_env: dict[str, str]) -> None:
    run = enqueue("tests.resumable", {"steps": STEPS, "sleep": 0.2})
    worker = start_and_wait_for_checkpoints(worker_env, run, ["--grace", "0"])
    worker.send_signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.output()
    stopped = AgentRun.objects.get(pk=run.pk)
    # Interrupted by the worker itself, at once: queued again, not waiting for a lease, and
    # its budget whole (a graceful stop is not a failure).
    assert (stopped.status, stopped.requeue_count) == (Status.QUEUED, 0)
    saved = stopped.checkpoint_count
    assert 2 <= saved < STEPS

    finish_with_a_burst_worker(worker_env)

    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED
    assert run.attempt == 2
    assert RunEvent.objects.filter(run=run, type=transitions.INTERRUPTED).count() == 1
    assert_resumed_at_checkpoint(run, saved)
