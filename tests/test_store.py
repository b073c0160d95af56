"""The attempt store: writes of many attempts committed together on a few connections,
each still fenced on its own, each caller answered once its write has committed."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import psycopg
import pytest
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_agentruns import enqueue, transitions
from django_agentruns.exceptions import LimitExceeded
from django_agentruns.models import AgentRun, RunCheckpoint, RunEvent, Status
from django_agentruns.outcomes import DeliverResult
from django_agentruns.runtime.attempt_store import AttemptStore
from django_agentruns.transitions import (
    AttemptRef,
    CheckpointWrite,
    EmitWrite,
    Renewal,
    RenewWrite,
    ScopePolicy,
    Settlement,
    SucceedWrite,
    Write,
    apply_writes,
)
from django_agentruns.transitions.batched import Result, stands_alone
from tests import helpers

pytestmark = pytest.mark.django_db(transaction=True)

WORKER = "store:1:abcd"


def claimed(count: int) -> list[AttemptRef]:
    for i in range(count):
        enqueue("tests.noop", {"i": i})
    runs = transitions.claim(WORKER, ["default"], count, ScopePolicy(), {}, 30.0,
                             include_lapsed=False)
    assert len(runs) == count
    return [AttemptRef(r.pk, r.attempt, WORKER, 30.0, r.agent) for r in runs]


def emit(ref: AttemptRef, n: int, type_: str = "step") -> EmitWrite:
    return EmitWrite(ref, uuid.uuid4(), type_, {"n": n})


def story(ref: AttemptRef) -> list[tuple[int, str, Any]]:
    return list(RunEvent.objects.filter(run_id=ref.run_id).order_by("seq")
                .values_list("seq", "type", "payload"))


def reclaim(ref: AttemptRef) -> None:
    """Another worker's attempt took the run (as a reaper reclaim and a new claim do)."""
    AgentRun.objects.filter(pk=ref.run_id).update(claimed_by="other:2:ffff",
                                                  attempt=ref.attempt + 1)


class Gated:
    """Wraps apply_writes: records each batch (and its connection); the first batch waits
    at the gate, so the writes submitted meanwhile queue into the next one."""

    def __init__(self, before: Callable[[Sequence[Write]], None] | None = None) -> None:
        self.batches: list[int] = []
        self.connections: set[int] = set()
        self.gate = threading.Event()
        self.before = before
        self._lock = threading.Lock()

    def __call__(self, writes: Sequence[Write]) -> list[Result]:
        with self._lock:
            self.batches.append(len(writes))
            first = len(self.batches) == 1
            connection.ensure_connection()
            self.connections.add(id(connection.connection))
        if first:
            assert self.gate.wait(20), "the test never opened the gate"
        if self.before is not None:
            self.before(writes)
        return apply_writes(writes)


def queue_behind_a_held_write(store: AttemptStore, gated: Gated, ref: AttemptRef,
                              writes: list[Write]) -> tuple[Future[Result], list[Future[Result]]]:
    held = store.submit(RenewWrite(ref))
    helpers.wait_until(lambda: gated.batches, message="the first batch to start")
    futures = [store.submit(w) for w in writes]
    helpers.wait_until(lambda: store.waiting == len(writes), message="the writes to queue")
    gated.gate.set()
    return held, futures


# --------------------------------------------------------------------------- apply_writes


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


# --------------------------------------------------------------------------- the store


def test_threads_and_coroutines_commit_every_write_on_at_most_writers_connections() -> None:
    refs = claimed(20)
    gated = Gated()
    gated.gate.set()
    started = None
    if connection.vendor == "postgresql":
        # Only connections opened from here on are this test's: an earlier test's idle
        # listener may still be closing.
        with connection.cursor() as cursor:
            cursor.execute("SELECT clock_timestamp()")
            (started,) = cursor.fetchone()
    store = AttemptStore(2, apply=gated)
    steps = 5

    def thread_attempt(ref: AttemptRef) -> None:
        for n in range(steps):
            assert store.call(emit(ref, n)) is Renewal.OK

    async def coroutine_attempt(ref: AttemptRef) -> None:
        for n in range(steps):
            assert await store.acall(emit(ref, n)) is Renewal.OK

    async def coroutines() -> None:
        await asyncio.gather(*(coroutine_attempt(r) for r in refs[10:]))

    threads = [threading.Thread(target=thread_attempt, args=(r,)) for r in refs[:10]]
    for t in threads:
        t.start()
    asyncio.run(coroutines())
    for t in threads:
        t.join(20)
    try:
        assert len(gated.connections) <= 2
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                               "current_database() AND pid <> pg_backend_pid() "
                               "AND backend_start >= %s", [started])
                (others,) = cursor.fetchone()
            assert others <= 2, "only the writers hold connections; the attempts none"
    finally:
        store.close()
    for ref in refs:
        assert [p for _, t, p in story(ref) if t == "step"] == [{"n": n} for n in range(steps)]
        assert [s for s, _, _ in story(ref)] == list(range(1, steps + 2))
    assert store.writes == len(refs) * steps
    assert store.batches == len(gated.batches) < store.writes


@pytest.mark.postgres_only  # on SQLite the held batch holds the write lock: writers take turns
def test_a_spare_writer_takes_a_batch_only_when_a_full_one_waits() -> None:
    """While one writer's batch is in flight, the writes queued meanwhile wait for it
    (they go together after), until a full batch waits: then a spare writer takes it."""
    held, *refs = claimed(9)
    gated = Gated()
    store = AttemptStore(2, max_batch=4, apply=gated)
    try:
        first = store.submit(RenewWrite(held))
        helpers.wait_until(lambda: gated.batches, message="the first batch to start")
        # Three of a full four: the spare leaves them queued (else a batch under four).
        futures = [store.submit(emit(ref, 1)) for ref in refs[:3]]
        futures.append(store.submit(emit(refs[3], 1)))  # four: the spare takes them
        helpers.wait_until(lambda: len(gated.batches) == 2,
                           message="the spare writer to take the full batch")
        assert [f.result(20) for f in futures] == [Renewal.OK] * 4
        futures = [store.submit(emit(ref, 1)) for ref in refs[4:7]]  # three: they wait
        gated.gate.set()
        assert first.result(20) is Renewal.OK
        assert [f.result(20) for f in futures] == [Renewal.OK] * 3
    finally:
        store.close()
    assert gated.batches == [1, 4, 3]
    assert len(gated.connections) == 2


def test_a_lost_lease_in_a_batch_costs_only_its_own_write() -> None:
    keep, ref1, lost, ref2, ref3 = claimed(5)
    gated = Gated()
    store = AttemptStore(1, apply=gated)
    reclaim(lost)
    held, futures = queue_behind_a_held_write(store, gated, keep, [
        emit(ref1, 1), emit(lost, 1), SucceedWrite(lost, {}), CheckpointWrite(ref2, 7, 1),
        SucceedWrite(ref3, {"ok": True})])
    assert held.result(20) is Renewal.OK
    assert [f.result(20) for f in futures] == [
        Renewal.OK, Renewal.LOST, Settlement.LOST, Renewal.OK, Settlement.SUCCEEDED]
    store.close()
    assert gated.batches == [1, 5]
    assert (store.batches, store.writes, store.alone) == (2, 6, 0)
    assert [t for _, t, _ in story(lost)] == [transitions.STARTED]
    assert AgentRun.objects.get(pk=ref3.run_id).status == Status.SUCCEEDED


def test_a_write_that_fails_fails_only_its_own_caller() -> None:
    keep, *refs = claimed(5)

    def fail_on_bad(writes: Sequence[Write]) -> None:
        if any(isinstance(w, EmitWrite) and w.type == "bad" for w in writes):
            with connection.cursor() as cursor:
                cursor.execute("SELECT * FROM no_such_table_of_agentruns")

    gated = Gated(before=fail_on_bad)
    store = AttemptStore(1, apply=gated)
    held, futures = queue_behind_a_held_write(store, gated, keep, [
        emit(refs[0], 1), emit(refs[1], 1, "bad"), emit(refs[2], 1),
        SucceedWrite(refs[3], {})])
    held.result(20)
    with pytest.raises(DatabaseError):
        futures[1].result(20)
    assert [futures[i].result(20) for i in (0, 2, 3)] == [
        Renewal.OK, Renewal.OK, Settlement.SUCCEEDED]
    store.close()
    assert (store.alone, store.writes) == (4, 4)
    assert [t for _, t, _ in story(refs[1])] == [transitions.STARTED]
    assert [t for _, t, _ in story(refs[0])] == [transitions.STARTED, "step"]


@pytest.mark.postgres_only
def test_a_payload_postgresql_rejects_fails_only_its_own_emit() -> None:
    keep, good, bad = claimed(3)
    gated = Gated()
    store = AttemptStore(1, apply=gated)
    rejected = EmitWrite(bad, uuid.uuid4(), "step", {"text": "nul \x00 byte"})
    held, (ok, no) = queue_behind_a_held_write(store, gated, keep, [emit(good, 1), rejected])
    held.result(20)
    assert ok.result(20) is Renewal.OK
    with pytest.raises(DatabaseError):
        no.result(20)
    store.close()
    assert [t for _, t, _ in story(bad)] == [transitions.STARTED]


def test_a_lock_conflict_retries_the_whole_batch() -> None:
    (ref,) = claimed(1)
    failures = [DatabaseError("database is locked")] * 2

    def flaky(writes: Sequence[Write]) -> list[Result]:
        results = apply_writes(writes)
        if failures:
            raise failures.pop()
        return results

    store = AttemptStore(1, apply=flaky)
    try:
        assert store.call(emit(ref, 1)) is Renewal.OK
    finally:
        store.close()
    assert (store.batches, store.writes, store.alone) == (1, 1, 0)
    assert [t for _, t, _ in story(ref)] == [transitions.STARTED, "step"]


@pytest.mark.postgres_only
def test_a_writer_whose_connection_died_reconnects_and_writes_the_batch() -> None:
    (ref,) = claimed(1)
    pids: list[int] = []

    def record_pid(writes: Sequence[Write]) -> list[Result]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pids.append(cursor.fetchone()[0])
        return apply_writes(writes)

    store = AttemptStore(1, apply=record_pid)
    try:
        assert store.call(RenewWrite(ref)) is Renewal.OK
        with connection.cursor() as cursor:  # the writer's own session, nobody else's
            cursor.execute("SELECT pg_terminate_backend(%s)", [pids[0]])
        assert store.call(emit(ref, 1)) is Renewal.OK
    finally:
        store.close()
    assert pids[-1] != pids[0]
    assert [t for _, t, _ in story(ref)] == [transitions.STARTED, "step"]


def test_500_coroutines_await_their_writes_without_executor_threads() -> None:
    refs = claimed(50)
    store = AttemptStore(2)
    baseline = threading.active_count()
    seen: list[int] = []

    async def attempt(ref: AttemptRef, n: int) -> Result:
        result = await store.acall(emit(ref, n))
        seen.append(threading.active_count())
        return result

    async def main() -> list[Result]:
        return await asyncio.gather(*(attempt(refs[i % 50], i) for i in range(500)))

    try:
        results = asyncio.run(main())
    finally:
        store.close()
    assert results == [Renewal.OK] * 500
    assert max(seen) <= baseline, "no thread beyond the store's writers"
    assert RunEvent.objects.filter(type="step").count() == 500
    assert store.batches < 500


def test_close_commits_what_is_queued_then_refuses_writes() -> None:
    keep, *refs = claimed(11)
    gated = Gated()
    store = AttemptStore(1, apply=gated)
    held = store.submit(RenewWrite(keep))
    helpers.wait_until(lambda: gated.batches, message="the first batch to start")
    futures = [store.submit(emit(r, 1)) for r in refs]
    closer = threading.Thread(target=store.close, args=(20,))
    closer.start()
    helpers.wait_until(lambda: store._closed, message="close() to begin")
    with pytest.raises(RuntimeError, match="closed"):
        store.submit(RenewWrite(keep))
    gated.gate.set()
    closer.join(20)
    assert not closer.is_alive()
    assert held.result(0) is Renewal.OK
    assert [f.result(0) for f in futures] == [Renewal.OK] * 10
    assert RunEvent.objects.filter(type="step").count() == 10
    assert not any(t.name.startswith("agentruns-writer") for t in threading.enumerate())


def test_the_store_reads_its_writer_count_from_the_setting(settings: Any) -> None:
    settings.AGENTRUNS = {"WRITER_CONNECTIONS": 3}
    store = AttemptStore()
    store.close()
    assert store.writers == 3


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
