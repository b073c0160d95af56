"""The attempt store: writes of many attempts committed together on a few connections,
each still fenced on its own, each caller answered once its write has committed."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import pytest
from django.db import DatabaseError, connection

from django_agentruns import transitions
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.runtime.attempt_store import AttemptStore
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
from django_agentruns.transitions.batched import Result
from tests import helpers
from tests.store_support import claimed, emit, reclaim, story

pytestmark = pytest.mark.django_db(transaction=True)


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
