"""Live output: `ctx.stream` chunks reach open streams while the run goes on, and are stored
once per step as a `stream` event (a reload, a late page, a reconnect see the whole text).

A real `runworker` subprocess streams; a real `runserver` subprocess serves the event
stream, read by a real socket (tests/test_stream_resources.py's `Stream`).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db import connection

from django_agentruns import deliver, enqueue, run_now, stream_chunks
from django_agentruns.exceptions import InvalidInputError
from django_agentruns.models import AgentRun, RunEvent, Status, StreamChunk
from django_agentruns.outcomes import AttemptRef
from django_agentruns.registry import agent, unregister
from django_agentruns.runtime.worker import Worker
from django_agentruns.streaming import sse as stream
from django_agentruns.streaming import transport as chunk_transport
from django_agentruns.streaming.chunks import MAX_CHANNEL, stream_event_id
from django_agentruns.streaming.hub import Hub
from tests import helpers
from tests.test_stream import parse
from tests.test_stream_resources import Stream, server, session_of
from tests.testapp.models import SideEffect


def chunk_text(text: str) -> str:
    """The text of every `chunk` message of an SSE body, in order."""
    return "".join(m.json["text"] for m in parse(text) if m.event == "chunk" and m.data)


def stored_text(run_id: int, channel: str = "output") -> str:
    return "".join(p["text"] for p in RunEvent.objects.filter(
        run_id=run_id, type="stream").order_by("seq").values_list("payload", flat=True)
        if p["channel"] == channel)


def words(n: int, prefix: str = "w") -> str:
    return "".join(f"{prefix}{i} " for i in range(n))


def finished(run_id: int) -> bool:
    return AgentRun.objects.get(pk=run_id).status in (Status.SUCCEEDED, Status.FAILED)


# --------------------------------------------------------------------------- end to end


def test_chunks_reach_an_open_stream_before_the_run_ends_and_are_stored_once(
        worker_env: dict[str, str]) -> None:
    session = session_of("watcher")
    run = enqueue("tests.streamer", {"n": 20, "gate": True, "after": 5})
    with server(worker_env) as port, helpers.start_manage(["runworker"], worker_env):
        live = Stream(port, f"/agentruns/runs/{run.pk}/events/", session)
        assert live.status == 200
        # Every word arrives while the run waits at its gate: live, not stored yet.
        helpers.wait_until(lambda: words(20) in chunk_text(live.read_until("w19 ")),
                           message="the live words")
        assert AgentRun.objects.get(pk=run.pk).status == Status.RUNNING
        assert not RunEvent.objects.filter(run_id=run.pk, type="stream").exists()
        first = next(m.json for m in parse(live.text) if m.event == "chunk")
        assert (first["channel"], first["attempt"], first["first"]) == ("output", 1, 0)

        SideEffect.objects.create(run_id=run.pk, note="open")
        body = live.read_to_end()
        assert chunk_text(body) == words(20) + words(5, "a")
        assert parse(body)[-1].event == "end"

        # One stored event holds the whole text: a page opened now shows it.
        assert stored_text(run.pk) == words(20) + words(5, "a")
        events = [m.json for m in parse(body) if m.event == "message" and m.data]
        assert [e["type"] for e in events] == ["run.started", "stream", "run.succeeded"]
        assert events[1]["payload"] == {"channel": "output", "text": words(20) + words(5, "a"),
                                        "attempt": 1, "first": 0, "end": 25}

        # A reconnect after run.started (Last-Event-ID) gets the coalesced text.
        again = Stream(port, f"/agentruns/runs/{run.pk}/events/?after={events[0]['seq']}",
                       session).read_to_end()
        resumed = [m.json for m in parse(again) if m.event == "message" and m.data]
        assert [e["type"] for e in resumed] == ["stream", "run.succeeded"]
        assert resumed[0]["payload"]["text"] == words(20) + words(5, "a")
        # Pruned (a moment after the text was stored, so late readers still got them).
        helpers.wait_until(lambda: not StreamChunk.objects.exists(), message="the prune")


def test_two_thousand_chunks_store_a_handful_of_rows(worker_env: dict[str, str]) -> None:
    run = enqueue("tests.streamer", {"n": 2000, "emit": True, "after": 2000})
    with helpers.start_manage(["runworker"], worker_env):
        helpers.wait_until(lambda: finished(run.pk), timeout=60, message="the run to end")
        helpers.wait_until(lambda: not StreamChunk.objects.exists(), message="the prune")
    types = list(RunEvent.objects.filter(run_id=run.pk).values_list("type", flat=True))
    # The emit is a step boundary: the words before it are one event, those after another.
    assert types == ["run.started", "stream", "step", "stream", "run.succeeded"]
    assert stored_text(run.pk) == words(2000) + words(2000, "a")


def test_a_retry_stores_its_own_different_text_and_replays_its_emits(
        worker_env: dict[str, str]) -> None:
    run = enqueue("tests.stream_retry")
    with helpers.start_manage(["runworker"], worker_env):
        helpers.wait_until(lambda: finished(run.pk), message="the run to end")
    stored = [(t, p.get("text"), p.get("attempt")) for t, p in RunEvent.objects.filter(
        run_id=run.pk).order_by("seq").values_list("type", "payload")
        if t in ("stream", "step")]
    # Attempt 2 resumes from the same (no) checkpoint: its emit is a replay and adds
    # nothing, but the text it streams is its own (a model answers differently), stored
    # beside attempt 1's, not taken for it.
    assert stored == [("stream", "first1 ", 1), ("step", None, None),
                      ("stream", "then1 ", 1), ("stream", "first2 ", 2),
                      ("stream", "then2 ", 2)]


def test_stream_chunks_gives_python_code_the_live_chunks(worker_env: dict[str, str]) -> None:
    run = enqueue("tests.async_streamer", {"n": 5})
    got: list[dict[str, Any]] = []

    def consume() -> None:
        for chunk in stream_chunks(run.pk):
            got.append(chunk)
        connection.close()

    async def consume_async() -> list[str]:
        return [chunk["text"] async for chunk in stream_chunks(run.pk)]

    reader = threading.Thread(target=consume)
    reader.start()
    results: list[list[str]] = []
    areader = threading.Thread(target=lambda: results.append(async_to_sync(consume_async)()))
    areader.start()
    with helpers.start_manage(["runworker"], worker_env):
        helpers.wait_until(lambda: "".join(c["text"] for c in got) == words(5),
                           message="the live words through stream_chunks")
        SideEffect.objects.create(run_id=run.pk, note="open")
        reader.join(20)
        areader.join(20)
    assert not reader.is_alive()  # both end with the run
    assert not areader.is_alive()
    assert stored_text(run.pk) == words(5) + "last"
    # Live chunks may miss the last few at the very end; the stored text has them all.
    assert "".join(results[0]).startswith(words(5))


# --------------------------------------------------------------------------- fencing

STALE = "tests.stale_streamer"


@pytest.fixture
def stale_streamer() -> Iterator[None]:
    @agent(STALE)
    def stale(ctx: Any) -> dict[str, Any]:
        ctx.stream("mine ")
        helpers.wait_until(lambda: gate_seen(ctx.run_id), message="the test to see 'mine'")
        # Another worker takes the run over (its lease lapsed): this attempt is stale now.
        AgentRun.objects.filter(pk=ctx.run_id).update(claimed_by="thief", attempt=2)
        for _ in range(50):
            ctx.stream("stale ")
        return {}

    yield
    unregister(STALE)


def gate_seen(run_id: int) -> bool:
    return SideEffect.objects.filter(run_id=run_id, note="seen").exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stale_streamer")
def test_a_stale_attempts_chunks_reach_no_client() -> None:
    run = enqueue(STALE)
    got: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: got.extend(stream_chunks(run.pk)))
    reader.start()

    def watch() -> None:
        helpers.wait_until(lambda: any(c["text"] == "mine " for c in got),
                           message="the attempt's own chunk")
        SideEffect.objects.create(run_id=run.pk, note="seen")
        connection.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    stats = Worker(burst=True).run(install_signals=False)
    watcher.join(20)
    assert stats.settled == {"lost": 1}
    sender = chunk_transport.sender()
    sender.flush()
    # The new owner streams a marker through the same sender: once it arrives, anything the
    # stale attempt sent before it would have too.
    sender.send(AttemptRef(run.pk, 2, "thief", 60.0), "output", 0, "marker", lambda: False)
    helpers.wait_until(lambda: any(c["text"] == "marker" for c in got),
                       message="the new owner's chunk")
    assert [c["text"] for c in got] == ["mine ", "marker"]
    assert not RunEvent.objects.filter(run_id=run.pk, type="stream").exists()
    AgentRun.objects.filter(pk=run.pk).update(status=Status.SUCCEEDED)  # lets the reader end
    reader.join(20)
    connection.close()


@pytest.mark.django_db(transaction=True)
def test_the_sender_sends_nothing_for_an_attempt_that_lost_its_run() -> None:
    run = enqueue("tests.noop")
    AgentRun.objects.filter(pk=run.pk).update(status=Status.RUNNING, claimed_by="owner",
                                              attempt=2)
    stale, owner = AttemptRef(run.pk, 1, "owner", 60.0), AttemptRef(run.pk, 2, "owner", 60.0)
    thief = AttemptRef(run.pk, 2, "thief", 60.0)
    sender = chunk_transport.Sender()
    heard: list[str] = []
    listening = None
    if connection.vendor == "postgresql":
        import psycopg

        from django_agentruns.db import connect_params

        listening = psycopg.connect(**connect_params("default"), autocommit=True)
        listening.execute(f"LISTEN {chunk_transport.run_channel(run.pk)}")
    try:
        for ref, text in ((stale, "stale"), (thief, "thief"), (owner, "marker")):
            sender.send(ref, "output", 0, text, lambda: False)
            sender.flush()
        if listening is not None:
            def marker_heard() -> bool:
                for note in listening.notifies(timeout=0.05):
                    heard.extend(c["text"] for c in json.loads(note.payload))
                return "marker" in heard
            helpers.wait_until(marker_heard, message="the owner's chunk")
        else:
            heard = list(StreamChunk.objects.filter(run_id=run.pk).values_list("text",
                                                                                 flat=True))
    finally:
        if listening is not None:
            listening.close()
        sender._close()
    assert heard == ["marker"]


def test_the_hub_hands_on_an_earlier_attempts_chunks_that_arrive_late(db: None) -> None:
    """A chunk sent just before a wait (or a retry) may reach the hub after the run's next
    attempt started: it was fenced on its attempt when sent, so it is live output, not a
    stale worker's (those never leave the sender: the tests above)."""
    run = enqueue("tests.noop")
    AgentRun.objects.filter(pk=run.pk).update(attempt=3)
    hub = Hub(stream.read_runs, stream.POLL_INTERVAL, background=False)
    sub = hub.subscribe(run.pk, 0, lambda: None)
    hub.poll_once()  # reads the run at attempt 3
    sub.take()
    hub.deliver_chunks(run.pk, [{"channel": "output", "text": "before the wait ", "attempt": 2},
                                {"channel": "output", "text": "after", "attempt": 3}])
    found = sub.take()
    assert found is not None
    assert [c["text"] for c in found.chunks] == ["before the wait ", "after"]


WAITER = "tests.streams_then_waits"


@pytest.fixture
def streams_then_waits() -> Iterator[None]:
    @agent(WAITER)
    def streams_then_waits(ctx: Any) -> dict[str, Any]:
        ctx.stream("before the wait")
        answer = ctx.receive("go")  # at once: no other write between the chunk and the wait
        ctx.stream(" and after")
        return {"answer": answer}

    yield
    unregister(WAITER)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("streams_then_waits")
def test_a_chunk_streamed_just_before_a_wait_reaches_the_reader(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender gathers chunks for BATCH_INTERVAL and fences each write on the attempt; a
    wait committed meanwhile used to leave the run `waiting` first, and the chunk was
    dropped. A long gathering makes the race certain: the wait now waits for the sender."""
    monkeypatch.setattr(chunk_transport, "BATCH_INTERVAL", 0.5)
    run = enqueue(WAITER)
    got: list[str] = []

    def read() -> None:
        got.extend(c["text"] for c in stream_chunks(run.pk))
        connection.close()

    reader = threading.Thread(target=read, daemon=True)  # a failed test leaves no thread
    reader.start()
    # A long-running worker, as `runworker` is: a burst worker's stop would prune SQLite's
    # chunk rows at once, before the web poller reads them.
    worker = Worker(reap_interval=0)
    serving = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    serving.start()
    try:
        helpers.wait_until(lambda: AgentRun.objects.get(pk=run.pk).status == Status.WAITING,
                           message="the run to wait")
        helpers.wait_until(lambda: got == ["before the wait"], timeout=10,
                           message="the chunk streamed before the wait, live")
        monkeypatch.undo()
        deliver(run.pk, "go", "yes")
        reader.join(20)
    finally:
        worker.stop()
        serving.join(20)
        connection.close()
    # The second attempt runs the agent again from its start: its own chunks follow.
    assert "".join(got) == "before the wait" + "before the wait and after", got
    assert AgentRun.objects.get(pk=run.pk).output == {"answer": "yes"}


def test_an_async_stream_sends_chunks_between_stored_events(transactional_db: None) -> None:
    """Under ASGI too: a chunk the hub is handed goes out as `event: chunk`, with no id."""
    run = enqueue("tests.noop")
    AgentRun.objects.filter(pk=run.pk).update(status=Status.RUNNING, attempt=1)
    hub = Hub(stream.read_runs, stream.POLL_INTERVAL, background=False)
    events = stream.EventStream(run.pk, fanout=hub)

    async def first_two() -> list[str]:
        iterator = events.__aiter__()
        texts = [await iterator.__anext__()]  # the catch-up: retry: and nothing stored
        waiting = asyncio.ensure_future(iterator.__anext__())
        while not len(hub):  # the stream subscribes once caught up
            await asyncio.sleep(0.01)
        hub.deliver_chunks(run.pk, [{"channel": "output", "text": "hi", "attempt": 1,
                                     "first": 0, "end": 1}])
        texts.append(await waiting)
        await iterator.aclose()
        return texts

    texts = async_to_sync(first_two)()
    chunk = parse(texts[1])
    assert [(m.event, m.id) for m in chunk] == [("chunk", None)]
    assert chunk[0].json == {"channel": "output", "text": "hi", "attempt": 1, "first": 0,
                             "end": 1}


# --------------------------------------------------------------------------- bad input


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("text", "channel", "message"), [
    (42, "output", "takes text (str), not int"),
    (["a list"], "output", "takes text (str), not list"),
    ("x", "c" * (MAX_CHANNEL + 1), f"string of 1-{MAX_CHANNEL} characters"),
    ("x", "", f"string of 1-{MAX_CHANNEL} characters"),
    ("nul\x00", "output", "NUL character"),
])
def test_bad_chunks_are_a_clear_error(text: Any, channel: str, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_now("tests.stream_bad", {"text": text, "channel": channel})


# --------------------------------------------------------------------------- transport


def test_notify_payloads_stay_under_postgres_limit() -> None:
    chunks = [{"channel": "output", "text": "é" * 5000, "attempt": 1, "first": i, "end": i + 1}
              for i in range(5)]
    out = chunk_transport.payloads(chunks)
    assert all(len(p.encode()) <= chunk_transport.PAYLOAD_BYTES for p in out)
    assert "".join(c["text"] for p in out for c in json.loads(p)) == "é" * 25000


def test_stream_event_ids_are_deterministic_and_apart_from_emits() -> None:
    assert stream_event_id(1, 1, 0, "output", 0) == stream_event_id(1, 1, 0, "output", 0)
    assert stream_event_id(1, 1, 0, "output", 0) != stream_event_id(1, 1, 0, "other", 0)
    assert stream_event_id(1, 1, 1, "output", 0) != stream_event_id(1, 1, 0, "output", 0)
    assert stream_event_id(1, 2, 0, "output", 0) != stream_event_id(1, 1, 0, "output", 0)
