"""Streamed text is stored at step boundaries whatever else happens to the run: past the
events cap the text is dropped (the boundary still happens, the run still finishes), and
a cancelled attempt's text is kept on the timeline. A real in-process worker runs them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings

from django_agentruns import cancel, deliver, enqueue
from django_agentruns.models import AgentRun, RunEvent, Status, StreamChunk
from django_agentruns.registry import agent, unregister
from django_agentruns.runtime.worker import Worker
from tests import helpers

CHATTY = "tests.chatty_streamer"
CANCELLED = "tests.cancelled_streamer"
CAP = 4


@pytest.fixture
def agents() -> Iterator[None]:
    @agent(CHATTY, max_requeues=0)
    def chatty(ctx: Any) -> dict[str, Any]:
        """A chat agent: streams and checkpoints each turn, then receives, then waits for
        no children: every boundary kind, with text pending at each."""
        turn = (ctx.state or {}).get("turn", 0)
        for i in range(turn, 6):
            ctx.stream(f"turn{i} ")
            ctx.checkpoint({"turn": i + 1})
        ctx.stream("before receive ")
        got = ctx.receive("go")
        ctx.stream("before wait ")
        ctx.wait_for_runs([])
        ctx.stream("last ")
        return {"turns": ctx.state["turn"], "got": got}

    @agent(CANCELLED, max_requeues=0)
    def cancelled(ctx: Any) -> dict[str, Any]:
        """Streams, is cancelled, then reaches a boundary (`emit`) or only a heartbeat
        (the end of the attempt stores the text)."""
        ctx.stream("said before the cancel ")
        cancel(ctx.run_id)
        connection.close()
        if ctx.input.get("boundary"):
            ctx.emit("step")
        else:
            ctx.heartbeat()
        return {}

    yield
    unregister(CHATTY)
    unregister(CANCELLED)
    # SQLite: the live-chunk rows go a moment after their text is stored (or dropped):
    # before the test database does.
    helpers.wait_until(lambda: not StreamChunk.objects.exists(), message="the prune")


def stream_events(run_id: int) -> list[dict[str, Any]]:
    return list(RunEvent.objects.filter(run_id=run_id, type="stream").order_by("seq")
                .values_list("payload", flat=True))


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("agents")
def test_past_the_events_cap_streamed_text_is_dropped_and_the_run_still_finishes(
        caplog: pytest.LogCaptureFixture) -> None:
    run = enqueue(CHATTY)
    deliver(run.pk, "go", "yes")  # stored: `receive` finds it at once
    with override_settings(AGENTRUNS={"MAX_EVENTS_PER_RUN": CAP}), \
            caplog.at_level(logging.WARNING, logger="django_agentruns.worker"):
        stats = Worker(burst=True).run(install_signals=False)
    done = AgentRun.objects.get(pk=run.pk)
    assert stats.settled == {"succeeded": 1}, (done.status, done.error_message)
    assert done.status == Status.SUCCEEDED
    assert done.output == {"turns": 6, "got": "yes"}
    assert done.checkpoint_count == 6  # every checkpoint saved, past the cap too
    # The text that fit is stored; the rest was dropped, and said so.
    assert [p["text"] for p in stream_events(run.pk)] == ["turn0 "]
    assert "MAX_EVENTS_PER_RUN" in caplog.text
    assert caplog.text.count("is not stored") == 1  # once per attempt


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("agents")
@pytest.mark.parametrize("boundary", [True, False], ids=["at-a-boundary", "at-the-end"])
def test_a_cancelled_attempts_streamed_text_is_stored(boundary: bool) -> None:
    run = enqueue(CANCELLED, {"boundary": boundary})
    stats = Worker(burst=True).run(install_signals=False)
    assert stats.settled == {"cancelled": 1}
    assert AgentRun.objects.get(pk=run.pk).status == Status.CANCELLED
    stored = stream_events(run.pk)
    assert [(p["text"], p["attempt"]) for p in stored] == [("said before the cancel ", 1)]
    # The boundary's own event was refused by the cancel: only the text was kept.
    assert not RunEvent.objects.filter(run_id=run.pk, type="step").exists()
