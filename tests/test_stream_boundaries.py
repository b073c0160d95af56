"""Live output on the split worker: the coalesced `stream` events are written like `emit`'s
(through the attempt store; awaited on the loop for async attempts, never blocking it),
and a wait is a step boundary that stores the text before it releases the lease."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from django_agentruns import deliver, enqueue
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.runtime.attempt_store import AttemptStore
from django_agentruns.runtime.context import RunContext
from django_agentruns.runtime.control import AttemptControl
from django_agentruns.streaming import transport as chunk_transport
from django_agentruns.streaming.chunks import afinish
from django_agentruns.transitions import Write
from tests import helpers
from tests.test_store import claimed


def stored(run_id: int) -> list[tuple[str, int]]:
    return [(p["text"], p["attempt"]) for p in RunEvent.objects.filter(
        run_id=run_id, type="stream").order_by("seq").values_list("payload", flat=True)]


@pytest.mark.parametrize("agent", ["tests.stream_then_wait", "tests.async_stream_then_wait"])
def test_a_wait_stores_the_text_streamed_before_it(worker_env: dict[str, str],
                                                   agent: str) -> None:
    run = enqueue(agent)
    with helpers.start_manage(["runworker"], worker_env):
        helpers.wait_until(lambda: AgentRun.objects.get(pk=run.pk).status == Status.WAITING,
                           message="the run to wait")
        # The wait released the lease: the text before it was stored first, not lost.
        assert stored(run.pk) == [("asked1 ", 1)]
        deliver(run.pk, "answer", "yes")
        helpers.wait_until(lambda: AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED,
                           message="the run to succeed")
    # Attempt 2 runs the step before the wait again: what it streams there is its own
    # text (a model answers anew), stored beside attempt 1's, then what came after it.
    assert stored(run.pk) == [("asked1 ", 1), ("asked2 ", 2), ("got yes", 2)]


@pytest.mark.django_db(transaction=True)
def test_async_stream_writes_go_through_the_store_off_the_loop_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the loop every coalesced write is awaited through the store (`awrite`); nothing
    sync (`write`) runs there, and the end-of-attempt flush waits in another thread."""
    (ref,) = claimed(1)
    store = AttemptStore(1)
    control = AttemptControl(ref, None, 0, store)
    run = AgentRun.objects.get(pk=ref.run_id)
    ctx = RunContext(run_id=run.pk, agent=run.agent, input=None, attempt=run.attempt,
                     state=None, scope="", control=control)
    loop_threads: list[threading.Thread] = []
    flushed_on: list[threading.Thread] = []

    def no_sync_write(self: AttemptControl, write: Write) -> Any:
        raise AssertionError(f"a sync write on the event loop: {write}")

    original_flush = chunk_transport.Sender.flush

    def flush(self: chunk_transport.Sender, timeout: float = 1.0) -> None:
        flushed_on.append(threading.current_thread())
        original_flush(self, timeout)

    sender = chunk_transport.Sender()  # this test's own, closed at its end
    monkeypatch.setattr(chunk_transport, "_sender", sender)
    monkeypatch.setattr(AttemptControl, "write", no_sync_write)
    monkeypatch.setattr(chunk_transport.Sender, "flush", flush)

    async def attempt() -> None:
        loop_threads.append(threading.current_thread())
        await ctx.astream("one ")
        await ctx.astream("two ")
        await ctx.aemit("step", {"n": 1})
        await ctx.astream("three")
        await afinish(control, store=True)

    before = store.writes
    try:
        asyncio.run(attempt())
        # The sender prunes (SQLite) a moment later, on this test's database: let it.
        helpers.wait_until(lambda: not sender._prunes, timeout=60, message="the prunes")
    finally:
        store.close()
        sender._close()  # its NOTIFY connection (PostgreSQL) goes now, not 5 s later
    assert stored(run.pk) == [("one two ", 1), ("three", 1)]
    types = list(RunEvent.objects.filter(run_id=run.pk).order_by("seq")
                 .values_list("type", flat=True))
    assert types[-3:] == ["stream", "step", "stream"]
    assert store.writes - before == 3  # both stream events and the emit, by the store
    assert flushed_on
    assert flushed_on[0] is not loop_threads[0]
    assert control.stop_reason is None  # the attempt went on throughout
