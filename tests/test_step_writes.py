"""What a step writes: a fresh run's step that ends before its start is written is one
row, written by its end; any other step's start is written first (a later attempt, a
fork's, a step that writes inside it, a long one), and a crash before a start was
written executes the step again with the same key, as one after it would."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from django_agentruns import enqueue, fork
from django_agentruns.models import AgentRun, RunEvent, RunStep, Status
from django_agentruns.runtime import steps
from django_agentruns.transitions import STEP, StepEndWrite, StepStartWrite, batched
from tests import helpers
from tests.test_steps import burst, kill_and_finish, steps_of
from tests.testapp.step_agents import executions


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every write of steps, usage and the like the worker's attempt store applies, in
    order. Not a success's: on PostgreSQL the claim loop's settle-and-claim statement
    writes that (transitions.handover), elsewhere the store does."""
    seen: list[Any] = []
    apply = batched.apply_writes

    def recording(writes: Any, at: Any = None) -> Any:
        seen.extend(w for w in writes if type(w).__name__ != "SucceedWrite")
        return apply(writes, at)

    monkeypatch.setattr(batched, "apply_writes", recording)
    return seen


def kinds(writes: list[Any], run_id: int) -> Counter[str]:
    return Counter(type(w).__name__ for w in writes if w.ref.run_id == run_id)


def test_a_fresh_runs_fast_steps_are_written_once_each_by_their_end(
        transactional_db: None, written: list[Any]) -> None:
    run = enqueue("tests.step_chain", {"n": 3})
    burst()
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED, run.error_message
    assert kinds(written, run.pk) == {"StepEndWrite": 3}
    assert steps_of(run) == [("call", n, "done", 1) for n in (1, 2, 3)]
    for step in RunStep.objects.filter(run=run):
        assert step.checkpoint == 0
        assert step.started_at <= step.finished_at
    assert RunEvent.objects.filter(run=run, type=STEP).count() == 3
    assert executions(run.pk) == [f"run-{run.pk}/call/{n}" for n in (1, 2, 3)]


def test_a_steps_start_is_written_ahead_of_a_write_made_inside_it(
        transactional_db: None, written: list[Any]) -> None:
    run = enqueue("tests.step_loop", {"n": 2})  # each step records usage inside
    burst()
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED, run.error_message
    mine = [type(w).__name__ for w in written if w.ref.run_id == run.pk]
    assert mine == ["StepStartWrite", "UsageWrite", "StepEndWrite"] * 2
    assert steps_of(run) == [("draft", 1, "done", 1), ("draft", 2, "done", 1)]
    assert run.input_tokens == 20


def test_a_long_steps_start_is_written_while_it_runs(
        transactional_db: None, written: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps, "START_HELD", 0.05)
    run = enqueue("tests.step_chain", {"n": 1, "sleep": 1.2})  # past a lease keeper pass
    burst()
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED, run.error_message
    starts = [w for w in written if isinstance(w, StepStartWrite) and w.ref.run_id == run.pk]
    assert [(w.name, w.occurrence) for w in starts] == [("call", 1)]
    assert steps_of(run) == [("call", 1, "done", 1)]


def test_a_later_attempt_and_a_replaying_fork_ask_for_every_step_first(
        transactional_db: None, written: list[Any]) -> None:
    retried = enqueue("tests.step_loop", {"n": 2, "fail": True})
    burst()
    retried.refresh_from_db()
    assert (retried.status, retried.attempt) == (Status.SUCCEEDED, 2)
    second = [w for w in written if w.ref.run_id == retried.pk and w.ref.attempt == 2]
    assert [type(w).__name__ for w in second] == ["StepStartWrite"] * 2

    copy = fork(retried.pk, replay=True)
    plain = fork(retried.pk)
    assert (copy.steps_copied, plain.steps_copied) == (True, False)
    AgentRun.objects.filter(pk=retried.pk).delete()  # the link goes; the mark stays
    burst()
    copy.refresh_from_db()
    assert copy.status == Status.SUCCEEDED, copy.error_message
    assert executions(copy.pk) == []
    first = [type(w).__name__ for w in written if w.ref.run_id == copy.pk
             and w.ref.attempt == 1]
    assert first[:2] == ["StepStartWrite"] * 2  # both answered from the copied records
    assert len(executions(plain.pk)) == 2  # executed: a plain fork holds no steps


def test_an_end_whose_start_another_attempt_wrote_records_nothing(db: None) -> None:
    from django.db import transaction

    from django_agentruns import transitions
    from django_agentruns.outcomes import AttemptRef, Renewal
    from django_agentruns.registry import scope_policy

    enqueue("tests.noop")
    [claimed] = transitions.claim("w-a", ["default"], 1, scope_policy(), {}, 2.0)
    ref = AttemptRef(claimed.pk, claimed.attempt, "w-a", 2.0)
    later = AttemptRef(claimed.pk, claimed.attempt + 1, "w-a", 2.0)
    RunStep.objects.create(run_id=claimed.pk, name="s", occurrence=1, attempt=later.attempt)
    with transaction.atomic():
        [ended] = batched.apply_writes([StepEndWrite(ref, "s", 1, True, [1])])
    assert ended is Renewal.OK  # the fence held, but the record is not this attempt's
    assert list(RunStep.objects.values_list("status", "attempt")) == [
        ("started", later.attempt)]
    assert not RunEvent.objects.filter(type=STEP).exists()


@pytest.mark.slow
def test_a_sigkill_inside_a_step_whose_start_was_held_repeats_it_with_the_same_key(
        worker_env: dict[str, str]) -> None:
    run = enqueue("tests.step_chain", {"n": 3, "hang_in": 1})
    env = {**worker_env, "AGENTRUNS_TEST_START_HELD": "3600"}
    worker = helpers.start_manage(["runworker"], env)
    helpers.wait_until(lambda: len(executions(run.pk)) == 2, message="inside step 2")
    assert steps_of(run) == [("call", 1, "done", 1)]  # step 2 has no record yet
    run = kill_and_finish(worker, run, worker_env)
    key = f"run-{run.pk}/call/"
    assert executions(run.pk) == [key + "1", key + "2", key + "2", key + "3"]
    assert steps_of(run) == [("call", 1, "done", 1), ("call", 2, "done", 2),
                             ("call", 3, "done", 2)]


def test_a_write_inside_a_step_in_the_agents_transaction_takes_the_held_start_with_it(
        transactional_db: None, written: list[Any]) -> None:
    from django.db import transaction

    from django_agentruns import RunContext, agent
    from django_agentruns.registry import unregister

    @agent("tests.step_atomic_emit")
    def step_atomic_emit(ctx: RunContext) -> str:
        def inside() -> str:
            with transaction.atomic():  # the agent's own writes and its emit, together
                ctx.emit("note", {"inside": True})
            return "ok"

        return ctx.step("inside", inside)

    try:
        run = enqueue("tests.step_atomic_emit")
        burst()
    finally:
        unregister("tests.step_atomic_emit")
    run.refresh_from_db()
    assert (run.status, run.output) == (Status.SUCCEEDED, "ok"), run.error_message
    # The start and the emit went in the agent's transaction, the end through the store.
    assert kinds(written, run.pk) == {"StepEndWrite": 1}
    assert steps_of(run) == [("inside", 1, "done", 1)]
    assert RunEvent.objects.filter(run=run, type="note").count() == 1
