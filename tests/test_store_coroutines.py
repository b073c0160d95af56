"""The attempt store seen from coroutines: an error reaches only its own coroutine, a burst
is answered with one wake-up per batch, a cancelled call not yet taken is not written, and
one run's writes wait for its write in flight on another writer. The helpers are
tests/test_store.py's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from django.db import DatabaseError

from django_agentruns import transitions
from django_agentruns.models import RunEvent
from django_agentruns.runtime.attempt_store import AttemptStore
from django_agentruns.transitions import (
    EmitWrite,
    Renewal,
    RenewWrite,
    Write,
)
from django_agentruns.transitions.batched import Result
from tests import helpers
from tests.test_store import Gated, claimed, emit, story

pytestmark = pytest.mark.django_db(transaction=True)


async def until(predicate: Callable[[], object], message: str, timeout: float = 20) -> None:
    """helpers.wait_until for a coroutine: polls without blocking the event loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {message}"
        await asyncio.sleep(0.01)


def test_an_error_reaches_only_its_own_coroutine() -> None:
    keep, *refs = claimed(41)

    def fail_on_bad(writes: Sequence[Write]) -> None:
        if any(isinstance(w, EmitWrite) and w.type == "bad" for w in writes):
            raise DatabaseError("rejected")

    gated = Gated(before=fail_on_bad)
    store = AttemptStore(1, apply=gated)
    wakeups: list[int] = []

    async def main() -> list[Result | BaseException]:
        loop = asyncio.get_running_loop()
        wake = loop.call_soon_threadsafe

        def counted(*args: Any, **kwargs: Any) -> Any:
            wakeups.append(1)
            return wake(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        held = store.submit(RenewWrite(keep))
        await until(lambda: gated.batches, "the first batch to start")
        calls = [asyncio.ensure_future(store.acall(emit(r, 1, "bad" if i == 7 else "step")))
                 for i, r in enumerate(refs)]
        await until(lambda: store.waiting == len(refs), "the writes to queue")
        gated.gate.set()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert held.result(20) is Renewal.OK
        return outcomes

    try:
        outcomes = asyncio.run(main())
    finally:
        store.close()
    assert isinstance(outcomes[7], DatabaseError)
    assert outcomes[:7] + outcomes[8:] == [Renewal.OK] * 39
    assert store.alone == len(refs), "the batch failed, so each write went alone"
    assert len(wakeups) == 1, "and the loop was still woken once, with every answer"
    assert RunEvent.objects.filter(type="step").count() == 39


def test_a_burst_of_coroutines_is_answered_with_one_wakeup_per_batch() -> None:
    keep, *refs = claimed(41)
    gated = Gated()
    store = AttemptStore(1, apply=gated)
    wakeups: list[int] = []

    async def main() -> list[Result]:
        loop = asyncio.get_running_loop()
        wake = loop.call_soon_threadsafe

        def counted(*args: Any, **kwargs: Any) -> Any:
            wakeups.append(1)
            return wake(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        held = store.submit(RenewWrite(keep))
        await until(lambda: gated.batches, "the first batch to start")
        calls = [asyncio.ensure_future(store.acall(emit(r, 1))) for r in refs]
        await until(lambda: store.waiting == len(refs), "the writes to queue")
        gated.gate.set()
        results = await asyncio.gather(*calls)
        held.result(20)
        return results

    try:
        results = asyncio.run(main())
    finally:
        store.close()
    assert results == [Renewal.OK] * 40
    assert gated.batches == [1, 40]
    assert len(wakeups) == 1


def test_a_cancelled_acall_not_yet_taken_is_not_written() -> None:
    keep, ref = claimed(2)
    gated = Gated()
    store = AttemptStore(1, apply=gated)

    async def main() -> None:
        held = store.submit(RenewWrite(keep))
        await until(lambda: gated.batches, "the first batch to start")
        task = asyncio.ensure_future(store.acall(emit(ref, 1)))
        await until(lambda: store.waiting == 1, "the write to queue")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gated.gate.set()
        held.result(20)
        assert await store.acall(RenewWrite(ref)) is Renewal.OK

    try:
        asyncio.run(main())
    finally:
        store.close()
    assert [t for _, t, _ in story(ref)] == [transitions.STARTED]


@pytest.mark.postgres_only  # on SQLite the held batch holds the write lock: writers take turns
def test_writes_of_one_run_wait_for_its_write_in_flight_on_another_writer() -> None:
    """Two writers: the spare takes a full batch of the writes waiting, but never a write
    of the run the busy one holds, so an attempt's writes commit in submission order."""
    busy, other = claimed(2)
    gated = Gated()
    store = AttemptStore(2, max_batch=2, apply=gated)
    first = store.submit(emit(busy, 1))
    helpers.wait_until(lambda: gated.batches, message="the first batch to start")
    second, third = store.submit(emit(busy, 2)), store.submit(emit(other, 1))
    assert third.result(20) is Renewal.OK, "the spare writer took the other run's write"
    assert not second.done()
    assert store.waiting == 1
    gated.gate.set()
    assert (first.result(20), second.result(20)) == (Renewal.OK, Renewal.OK)
    store.close()
    assert gated.batches == [1, 1, 1]
    assert [p for _, t, p in story(busy) if t == "step"] == [{"n": 1}, {"n": 2}]
