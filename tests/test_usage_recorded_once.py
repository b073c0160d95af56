"""Usage is counted once per call: a usage write applied again (its commit's
acknowledgement lost, the store reconnecting and writing its batch again) adds nothing;
and `ctx.stop_requested` turns True once `record_usage` spent the budget, so an agent
that checks it makes no further paid call."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from django.db import OperationalError, connection, transaction

from django_agentruns import enqueue, transitions
from django_agentruns.models import AgentRun, RunEvent, RunUsage, Status
from django_agentruns.outcomes import AttemptRef, Renewal, UsageTotals
from django_agentruns.runtime.attempt_store import AttemptStore
from django_agentruns.runtime.worker import Worker
from django_agentruns.transitions import Write, apply_writes
from django_agentruns.transitions.batched import Result
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True)


def claimed() -> AttemptRef:
    run = enqueue("tests.noop")
    (row,) = transitions.claim("w1", ["default"], 1, transitions.ScopePolicy(), {}, 60.0)
    assert row.pk == run.pk
    return AttemptRef(run.pk, row.attempt, "w1", 60.0)


def totals(run_id: int) -> tuple[int, int, float]:
    return AgentRun.objects.values_list("input_tokens", "output_tokens", "cost").get(pk=run_id)


def test_the_same_usage_write_applied_twice_counts_once() -> None:
    ref = claimed()
    write = transitions.UsageWrite(ref, 5, 6, 0.5, "m", seq=1)
    assert transitions.batched.apply_alone(write) == UsageTotals(Renewal.OK, 11, 0.5)
    assert transitions.batched.apply_alone(write) == UsageTotals(Renewal.OK, 11, 0.5)
    assert totals(ref.run_id) == (5, 6, 0.5)
    assert RunEvent.objects.filter(run_id=ref.run_id, type=transitions.USAGE).count() == 1
    assert list(RunUsage.objects.filter(run_id=ref.run_id).values_list(
        "attempt", "seq", "input_tokens", "output_tokens", "cost", "model")) == [
        (ref.attempt, 1, 5, 6, 0.5, "m")]
    # The next call of the attempt is counted.
    nxt = transitions.UsageWrite(ref, 1, 1, 0.25, "m", seq=2)
    assert transitions.batched.apply_alone(nxt) == UsageTotals(Renewal.OK, 13, 0.75)


def test_a_usage_write_retried_after_a_lost_commit_acknowledgement_counts_once() -> None:
    """The store's batch commits, then the connection dies before the answer (the
    acknowledgement is lost): the writer reconnects and writes the batch again."""
    ref = claimed()
    batches: list[int] = []

    def ack_lost_once(writes: Sequence[Write]) -> list[Result]:
        results = apply_writes(writes)
        batches.append(len(writes))
        if len(batches) == 1:
            def lose_the_ack() -> None:
                connection.close()
                raise OperationalError("server closed the connection unexpectedly")
            transaction.on_commit(lose_the_ack)
        return results

    store = AttemptStore(1, apply=ack_lost_once)
    try:
        answer = store.call(transitions.UsageWrite(ref, 300, 100, 0.01, "gpt", seq=1))
    finally:
        store.close()
    assert len(batches) == 2  # it was written twice
    assert answer == UsageTotals(Renewal.OK, 400, 0.01)
    assert totals(ref.run_id) == (300, 100, 0.01)
    assert RunEvent.objects.filter(run_id=ref.run_id, type=transitions.USAGE).count() == 1


def test_stop_requested_turns_true_once_the_budget_is_spent() -> None:
    run = enqueue("tests.polite_spender")
    Worker(burst=True, reap_interval=0).run(install_signals=False)
    row = AgentRun.objects.get(pk=run.pk)
    # 400 tokens a call against a budget of 1000: the third call passes it, and the agent,
    # checking stop_requested, makes no fourth.
    assert SideEffect.objects.filter(run_id=run.pk, note="model call").count() == 3
    assert row.input_tokens == 1200
    # It stopped by itself, with no context call after the budget passed: its output stands.
    assert (row.status, row.output) == (Status.SUCCEEDED, {"calls": 3})
