"""Guarantee 6: retries do not emit twice, and no emitted event is lost.

An emitted event's id derives from the run, its checkpoint count and its position since
that checkpoint. A retry that resumes from the same checkpoint re-derives the same ids,
which add nothing; an event emitted after a checkpoint never reuses an id from before it.
"""

from __future__ import annotations

import uuid

import pytest

from django_agentruns import enqueue, transitions
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.outcomes import AttemptRef, Renewal
from django_agentruns.registry import scope_policy
from django_agentruns.rules import policy
from django_agentruns.runtime.worker import Worker
from tests.testapp.models import SideEffect

LIFECYCLE = {transitions.STARTED, transitions.SUCCEEDED, transitions.RETRYING,
             transitions.DEAD_LETTERED, transitions.CANCELLED, transitions.CANCEL_REQUESTED,
             transitions.ABANDONED, transitions.RETRIED, transitions.CHECKPOINT}

# Each test runs on plain history tables and on partitioned ones (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("history_layout")


def run_burst() -> None:
    Worker(burst=True, reap_interval=0, max_contention_wait=10).run(install_signals=False)


def emitted(run: AgentRun) -> list[tuple[str, int]]:
    """The run's emitted (non-lifecycle) events as (type, attempt), in stream order."""
    return [(e.type, e.attempt) for e in RunEvent.objects.filter(run=run).order_by("seq")
            if e.type not in LIFECYCLE]


def assert_seq_has_no_gaps(run: AgentRun) -> None:
    seqs = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1))


def claim_one(worker: str = "w-test") -> AttemptRef:
    [run] = transitions.claim(worker, ["default"], 1, scope_policy(), {}, 2.0)
    return AttemptRef(run.pk, run.attempt, worker, 2.0)


# --------------------------------------------------------------------------- the guarantee


def test_guarantee_6_retries_do_not_emit_twice(transactional_db: None) -> None:
    """Attempt 1 emits a, checkpoints, emits b and fails; attempt 2 resumes, emits b and c.

    The resumed b re-derives attempt 1's id for b and adds nothing; c is new. With ids
    numbered from zero per attempt (the reference implementation's bug), the resumed b
    would take a's id and be dropped as a duplicate, and c would take b's.
    """
    run = enqueue("tests.emit_resume")
    run_burst()

    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED
    assert run.attempt == 2
    assert run.checkpoint_count == 1
    assert emitted(run) == [("a", 1), ("b", 1), ("c", 2)]
    assert_seq_has_no_gaps(run)
    ids = {e.type: e.event_id for e in RunEvent.objects.filter(run=run, type__in="abc")}
    assert ids == {"a": transitions.emitted_event_id(run.pk, 0, 0),
                   "b": transitions.emitted_event_id(run.pk, 1, 0),
                   "c": transitions.emitted_event_id(run.pk, 1, 1)}


def test_a_retry_resuming_from_the_same_checkpoint_adds_no_rows(
        transactional_db: None) -> None:
    """Attempt 1 of tests.steps, by hand: step 0, checkpoint 1, step 1, then it fails.

    Attempt 2, a real one, resumes from checkpoint 1 and re-emits step 1 under the same id.
    """
    run = enqueue("tests.steps", {"steps": 3})
    ref = claim_one()
    step_0 = transitions.emitted_event_id(run.pk, 0, 0)
    assert transitions.emit(ref, step_0, "step", {"n": 0}) is Renewal.OK
    assert transitions.checkpoint(ref, {"step": 1}, 1) is Renewal.OK
    step_1 = transitions.emitted_event_id(run.pk, 1, 0)
    assert transitions.emit(ref, step_1, "step", {"n": 1}) is Renewal.OK
    failure = policy.Failure(retryable=True)
    error = transitions.ErrorInfo("ConnectionError", "flaky", "")
    assert transitions.settle_failed(ref, failure, error) is transitions.Settlement.REQUEUED
    before = RunEvent.objects.filter(run=run, type="step").count()
    assert before == 2

    run_burst()
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED
    steps = list(RunEvent.objects.filter(run=run, type="step").order_by("seq")
                 .values_list("payload", "attempt"))
    assert steps == [({"n": 0}, 1), ({"n": 1}, 1), ({"n": 2}, 2)]
    assert_seq_has_no_gaps(run)


def test_inserting_a_duplicate_event_id_adds_nothing_and_raises_nothing(db: None) -> None:
    run = enqueue("tests.noop")
    ref = claim_one()
    event_id = uuid.uuid4()
    assert transitions.emit(ref, event_id, "x", {"first": True}) is Renewal.OK
    assert transitions.emit(ref, event_id, "x", {"first": False}) is Renewal.OK
    rows = RunEvent.objects.filter(event_id=event_id)
    assert [r.payload for r in rows] == [{"first": True}]
    # The next event takes the next seq: the duplicate consumed none.
    assert transitions.emit(ref, uuid.uuid4(), "y", {}) is Renewal.OK
    assert_seq_has_no_gaps(run)


def test_a_stale_attempt_emits_nothing(db: None) -> None:
    """Emit is fenced: the renewal comes first, so a lost attempt appends no row."""
    run = enqueue("tests.noop")
    ref = claim_one()
    stale = AttemptRef(ref.run_id, ref.attempt, "someone-else", 2.0)
    before = RunEvent.objects.filter(run=run).count()
    assert transitions.emit(stale, uuid.uuid4(), "x", {}) is Renewal.LOST
    assert RunEvent.objects.filter(run=run).count() == before


@pytest.mark.parametrize("agent", ["tests.steps", "tests.async_steps"])
def test_ids_are_derived_from_checkpoint_and_position(transactional_db: None, agent: str) -> None:
    run = enqueue(agent, {"steps": 3})
    run_burst()
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED
    events = RunEvent.objects.filter(run=run, type="step").order_by("seq")
    assert [e.event_id for e in events] == [
        transitions.emitted_event_id(run.pk, n, 0) for n in range(3)]
    assert_seq_has_no_gaps(run)


def test_seq_has_no_gaps_across_retries_and_lifecycle_events(transactional_db: None) -> None:
    run = enqueue("tests.flaky", {"succeed_on": 3})
    run_burst()
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED
    assert SideEffect.objects.filter(run_id=run.pk).count() == 3
    types = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("type", flat=True))
    assert types == [transitions.STARTED, transitions.RETRYING] * 2 + [
        transitions.STARTED, transitions.SUCCEEDED]
    assert_seq_has_no_gaps(run)
