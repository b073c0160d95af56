"""`apply_writes`: many attempts' writes in one transaction, each still fenced on its own,
in as few statements as their kinds allow."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_agentruns import transitions
from django_agentruns.exceptions import LimitExceeded
from django_agentruns.models import AgentRun, RunCheckpoint, Status
from django_agentruns.outcomes import DeliverResult
from django_agentruns.transitions import (
    AttemptRef,
    CheckpointWrite,
    EmitWrite,
    Renewal,
    RenewWrite,
    Settlement,
    SucceedWrite,
    Write,
    apply_writes,
)
from django_agentruns.transitions.batched import Result, stands_alone
from tests import helpers
from tests.store_support import claimed, emit, reclaim, story

pytestmark = pytest.mark.django_db(transaction=True)


def test_apply_writes_fences_each_write_on_its_own_in_one_transaction() -> None:
    ok, lost, cancelled, pointed, done, gone = claimed(6)
    reclaim(lost)
    reclaim(gone)
    AgentRun.objects.filter(pk=cancelled.run_id).update(cancel_requested_at=timezone.now())
    writes: list[Write] = [
        emit(ok, 1), emit(lost, 1), emit(cancelled, 1), CheckpointWrite(pointed, {"s": 1}, 1),
        SucceedWrite(done, {"out": 1}), SucceedWrite(gone, {"out": 2}),
        emit(ok, 2), RenewWrite(ok), RenewWrite(lost), CheckpointWrite(cancelled, {}, 1),
        CheckpointWrite(lost, {}, 1),
    ]
    with transaction.atomic():
        results = apply_writes(writes)
    assert results == [
        Renewal.OK, Renewal.LOST, Renewal.CANCEL_REQUESTED, Renewal.OK,
        Settlement.SUCCEEDED, Settlement.LOST,
        Renewal.OK, Renewal.OK, Renewal.LOST, Renewal.CANCEL_REQUESTED, Renewal.LOST,
    ]
    started = (1, transitions.STARTED)
    assert [(s, t) for s, t, _ in story(ok)] == [started, (2, "step"), (3, "step")]
    assert [p for _, t, p in story(ok) if t == "step"] == [{"n": 1}, {"n": 2}]
    for ref in (lost, cancelled, gone):
        assert [(s, t) for s, t, _ in story(ref)] == [started]
    assert [(s, t) for s, t, _ in story(pointed)] == [started, (2, transitions.CHECKPOINT)]
    assert AgentRun.objects.get(pk=pointed.run_id).checkpoint_state == {"s": 1}
    assert [(s, t) for s, t, _ in story(done)] == [started, (2, transitions.SUCCEEDED)]
    finished = AgentRun.objects.get(pk=done.run_id)
    assert (finished.status, finished.output) == (Status.SUCCEEDED, {"out": 1})
    assert AgentRun.objects.get(pk=gone.run_id).status == Status.RUNNING


def test_an_emit_retried_with_the_same_id_adds_nothing() -> None:
    (ref,) = claimed(1)
    write = emit(ref, 1)
    with transaction.atomic():
        assert apply_writes([write, write]) == [Renewal.OK, Renewal.OK]
    with transaction.atomic():
        assert apply_writes([write]) == [Renewal.OK]
    assert [(s, t) for s, t, _ in story(ref)] == [(1, transitions.STARTED), (2, "step")]


def test_apply_writes_refuses_to_run_outside_a_transaction() -> None:
    (ref,) = claimed(1)
    with pytest.raises(RuntimeError, match="inside"):
        apply_writes([RenewWrite(ref), RenewWrite(ref)])  # two of a run never stand alone


def test_emits_checkpoints_and_renewals_alone_commit_in_one_statement(settings: Any) -> None:
    """PostgreSQL: emits, checkpoints and renewals alone, one per run (an agent's
    commonest batches), renew, save and append in one statement with no transaction
    around it. A write the statement did not wholly make (a fence that failed, a cancel
    request, a replay) is written again in a transaction, which answers it as a batch in a
    transaction does. SQLite keeps the transaction."""
    settings.AGENTRUNS = {**settings.AGENTRUNS, "CHECKPOINT_HISTORY": 2}
    ok, pointed, renewed, lost, cancelled, replayed, pointed_again = claimed(7)
    reclaim(lost)
    AgentRun.objects.filter(pk=cancelled.run_id).update(cancel_requested_at=timezone.now())
    first = emit(replayed, 1)
    with transaction.atomic():
        apply_writes([first, CheckpointWrite(pointed_again, {"n": 1}, 1)])
    leases = dict(AgentRun.objects.values_list("pk", "lease_expires"))
    clean: list[Write] = [emit(ok, 1), CheckpointWrite(pointed, {"n": 1}, 1),
                          RenewWrite(renewed)]
    if connection.vendor != "postgresql":
        assert not stands_alone(clean)
        with pytest.raises(RuntimeError, match="inside"):
            apply_writes(clean)
        return
    assert stands_alone(clean)
    assert not stands_alone([emit(ok, 2), emit(ok, 3)])  # two of a run: rounds, in order
    assert not stands_alone([EmitWrite(ok, uuid.uuid4(), "out", {}, despite_cancel=True)])
    with CaptureQueriesContext(connection) as queries:
        assert apply_writes(clean) == [Renewal.OK] * 3
    assert len(queries) == 1, [q["sql"][:80] for q in queries]
    started = (1, transitions.STARTED)
    assert [(s, t) for s, t, _ in story(ok)] == [started, (2, "step")]
    assert [(s, t, p) for s, t, p in story(pointed)][1:] == [
        (2, transitions.CHECKPOINT, {"count": 1})]
    assert AgentRun.objects.get(pk=pointed.run_id).checkpoint_state == {"n": 1}
    assert [(s, t) for s, t, _ in story(renewed)] == [started]
    after = dict(AgentRun.objects.values_list("pk", "lease_expires"))
    assert all(after[r.run_id] > leases[r.run_id] for r in (ok, pointed, renewed))

    # Checkpoints past CHECKPOINT_HISTORY trim the oldest states, in the same statement.
    for number in (2, 3):
        assert apply_writes([CheckpointWrite(pointed, {"n": number}, number)]) == [Renewal.OK]
    assert sorted(RunCheckpoint.objects.filter(run_id=pointed.run_id)
                  .values_list("number", flat=True)) == [2, 3]
    assert AgentRun.objects.get(pk=pointed.run_id).checkpoint_state == {"n": 3}

    rare: list[Write] = [emit(lost, 1), emit(cancelled, 1), first,
                         CheckpointWrite(pointed_again, {"n": 1}, 1), RenewWrite(lost)]
    leases = dict(AgentRun.objects.values_list("pk", "lease_expires"))
    with CaptureQueriesContext(connection) as queries:
        results = apply_writes(rare[:4])
    assert results == [Renewal.LOST, Renewal.CANCEL_REQUESTED, Renewal.OK, Renewal.OK]
    assert queries[0]["sql"].startswith("WITH v")  # the statement, then the transaction
    assert any(q["sql"].upper().startswith("BEGIN") for q in queries[1:])
    for ref in (lost, cancelled):
        assert [(s, t) for s, t, _ in story(ref)] == [started]
    assert [(s, t) for s, t, _ in story(replayed)] == [started, (2, "step")]
    assert [t for _, t, _ in story(pointed_again)] == [transitions.STARTED,
                                                       transitions.CHECKPOINT]
    after = dict(AgentRun.objects.values_list("pk", "lease_expires"))
    assert after[pointed_again.run_id] > leases[pointed_again.run_id]  # a replay renews
    assert after[lost.run_id] == leases[lost.run_id]
    assert after[cancelled.run_id] == leases[cancelled.run_id]
    assert apply_writes([rare[4]]) == [Renewal.LOST]


def test_successes_beside_other_runs_writes_commit_in_two_statements() -> None:
    """PostgreSQL: successes that came while the claim loop's statement ran meet other
    attempts' emits in the store's batches. One run a write, they commit in two
    statements of their own (the emits', then the successes'), not in a transaction of
    rounds; a lost success is answered LOST, as in a transaction."""
    done, emitting, pointed, lost = claimed(4)
    reclaim(lost)
    mixed: list[Write] = [emit(emitting, 1), SucceedWrite(done, {"answer": 42}),
                          CheckpointWrite(pointed, {"n": 1}, 1), SucceedWrite(lost, None)]
    if connection.vendor != "postgresql":
        assert not stands_alone(mixed)
        return
    assert stands_alone(mixed)
    assert not stands_alone([emit(done, 1), SucceedWrite(done, None)])  # one run: in order
    assert not stands_alone([emit(done, 1), SucceedWrite(emitting, None),
                             SucceedWrite(AttemptRef(pointed.run_id, 1, "other:2:ffff", 30.0),
                                          None)])  # two workers' successes
    with CaptureQueriesContext(connection) as queries:
        results = apply_writes(mixed)
    assert results == [Renewal.OK, Settlement.SUCCEEDED, Renewal.OK, Settlement.LOST]
    assert len(queries) == 2, [q["sql"][:80] for q in queries]
    started = (1, transitions.STARTED)
    assert [(s, t) for s, t, _ in story(done)] == [started, (2, transitions.SUCCEEDED)]
    assert [(s, t) for s, t, _ in story(emitting)] == [started, (2, "step")]
    assert [(s, t) for s, t, _ in story(pointed)] == [started, (2, transitions.CHECKPOINT)]
    assert [(s, t) for s, t, _ in story(lost)] == [started]
    statuses = dict(AgentRun.objects.values_list("pk", "status"))
    assert [statuses[r.run_id] for r in (done, emitting, pointed, lost)] == [
        Status.SUCCEEDED, Status.RUNNING, Status.RUNNING, Status.RUNNING]
    assert AgentRun.objects.get(pk=done.run_id).output == {"answer": 42}


@pytest.mark.postgres_only
def test_an_emit_alone_past_its_cap_fails_and_its_batch_mates_stay_written() -> None:
    """The batch committed as it ran: its other emits are written, and the store's retry
    of each alone adds nothing twice; the refused emit raises, as `emit` does."""
    capped, other = claimed(2)
    over = EmitWrite(capped, uuid.uuid4(), "step", {}, max_events=1)  # `started` fills it
    mate = emit(other, 1)
    with pytest.raises(LimitExceeded):
        apply_writes([over, mate])
    assert apply_writes([mate]) == [Renewal.OK]
    assert [t for _, t, _ in story(other)] == [transitions.STARTED, "step"]
    assert [t for _, t, _ in story(capped)] == [transitions.STARTED]


@pytest.mark.postgres_only
def test_an_event_appended_while_emits_alone_wait_is_kept_before_theirs() -> None:
    """Emits alone compute each seq from their statement's snapshot. A payload delivered
    to the run (its row locked, its event appended) while the statement waits on that lock
    collides with that seq: the batch is written again in a transaction, and both events
    are kept, in order (the chaos suite met this as an IntegrityError)."""
    (ref,) = claimed(1)
    mine = emit(ref, 1)
    results: list[Result] = []
    errors: list[BaseException] = []

    def write() -> None:
        try:
            results.extend(apply_writes([mine]))
        except BaseException as error:  # the assertion below shows it
            errors.append(error)
        finally:
            connection.close()

    thread = threading.Thread(target=write)
    with transaction.atomic():
        stored = transitions.waiting.deliver(ref.run_id, "early", {"x": 1}, by="test")
        assert stored is DeliverResult.STORED
        thread.start()
        helpers.wait_until(lambda: waiting_on_a_lock("^WITH v"),
                           message="the emits' statement to wait on the row lock")
    thread.join(20)
    assert not errors, errors
    assert results == [Renewal.OK]
    assert [(s, t) for s, t, _ in story(ref)] == [
        (1, transitions.STARTED), (2, "run.delivered"), (3, "step")]


def waiting_on_a_lock(query: str) -> bool:
    """Whether a session of this database waits on a lock running `query` (a regex); asked
    on a connection of its own (a transaction sees pg_stat_activity as it first read it)."""
    params = dict(connection.get_connection_params())
    params.pop("cursor_factory", None)
    params.pop("context", None)
    with psycopg.connect(**params, autocommit=True) as admin:
        return admin.execute("SELECT 1 FROM pg_stat_activity WHERE datname = "
                             "current_database() AND wait_event_type = 'Lock' "
                             "AND query ~ %s", [query]).fetchone() is not None


def test_checkpoint_states_of_any_json_shape_read_back_as_written() -> None:
    states: list[Any] = ["a string", 3, None, [1, "x"], {"nested": {"ok": True}}]
    refs = claimed(len(states))
    with transaction.atomic():
        results = apply_writes([CheckpointWrite(r, s, 2) for r, s in zip(refs, states,
                                                                           strict=True)])
    assert results == [Renewal.OK] * len(states)
    for ref, state in zip(refs, states, strict=True):
        run = AgentRun.objects.get(pk=ref.run_id)
        assert (run.checkpoint_state, run.checkpoint_count) == (state, 2)
        row = RunCheckpoint.objects.values("number", "state").get(run_id=ref.run_id)
        assert row == {"number": 2, "state": state}
    assert RunCheckpoint.objects.filter(state__isnull=True).count() == 1
