"""The fan-out behind the event streams (django_agentruns.streaming.hub), and the stream caps.

The hub's reads are driven by hand here (`background=False`, `poll_once()`), so each step
is deterministic; the view's caps and the release of a closed stream go through Django's
test clients. tests/test_stream_resources.py shows the same against a real server.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.contrib.auth.models import User
from django.core.signals import request_finished
from django.db import close_old_connections, connection
from django.test import AsyncClient, Client
from django.test.utils import CaptureQueriesContext

from django_agentruns import cancel, enqueue
from django_agentruns.models import AgentRun, RunEvent
from django_agentruns.streaming import hub as fanout
from django_agentruns.streaming import sse as stream
from django_agentruns.streaming.hub import Found, Hub, Subscription
from tests.test_stream import (
    finished_run,
    make_user,
    parse,
    streams_let_go,  # noqa: F401  (autouse here too)
    trail,
    url,
)


def close_as_a_server_does(response: Any) -> None:
    """`response.close()`, as the test client does it: its request_finished must not close
    the test's own connection (inside the test's transaction)."""
    request_finished.disconnect(close_old_connections)
    try:
        response.close()
    finally:
        request_finished.connect(close_old_connections)


def hand_driven() -> Hub:
    return Hub(stream.read_runs, stream.POLL_INTERVAL, background=False)


def subscribe(hub: Hub, run_id: int, after: int = 0) -> tuple[Subscription, threading.Event]:
    woken = threading.Event()
    return hub.subscribe(run_id, after, woken.set), woken


def seqs(found: Found | None) -> list[int]:
    assert found is not None
    return [row["seq"] for row in found.rows]


# --------------------------------------------------------------------------- the hub


def test_one_read_of_two_statements_serves_every_stream_of_every_run(db: None) -> None:
    first, second = finished_run(steps=2), finished_run(steps=1)
    hub = hand_driven()
    from_start, first_woken = subscribe(hub, first.pk)
    from_three, _ = subscribe(hub, first.pk, after=3)
    other, _ = subscribe(hub, second.pk)
    assert len(hub) == 3

    with CaptureQueriesContext(connection) as queries:
        assert hub.poll_once() is False  # no batch was full
    assert len(queries) == 2  # the runs' status, then all their events

    assert first_woken.is_set()
    all_of_first = [seq for seq, _, _ in trail(first)]
    taken = from_start.take()
    assert seqs(taken) == all_of_first
    assert taken is not None
    assert taken.finished
    assert taken.run == {"status": "succeeded", "reason": "completed"}
    assert seqs(from_three.take()) == [s for s in all_of_first if s > 3]
    assert seqs(other.take()) == [seq for seq, _, _ in trail(second)]
    assert from_start.take() is None  # taken once
    assert len(hub) == 0  # finished runs' subscriptions leave the registry at once


def test_a_quiet_run_wakes_nobody_and_a_deleted_one_ends(db: None) -> None:
    quiet = enqueue("tests.noop", run_after=3600)
    hub = hand_driven()
    sub, woken = subscribe(hub, quiet.pk)
    hub.poll_once()
    assert not woken.is_set()
    assert sub.take() is None
    assert len(hub) == 1

    AgentRun.objects.filter(pk=quiet.pk).delete()
    hub.poll_once()
    found = sub.take()
    assert woken.is_set()
    assert found is not None
    assert (found.run, found.rows, found.finished) == (None, [], True)
    assert len(hub) == 0


def test_each_run_gets_a_batch_per_read_so_a_long_backlog_starves_no_other(
        db: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "BATCH", 2)
    long, short = finished_run(steps=4), finished_run(steps=0)
    hub = hand_driven()
    long_sub, _ = subscribe(hub, long.pk)
    short_sub, _ = subscribe(hub, short.pk)

    assert hub.poll_once() is True  # a full batch: read again at once
    first = long_sub.take()
    assert seqs(first) == [1, 2]
    assert first is not None
    assert not first.finished
    short_found = short_sub.take()
    assert seqs(short_found) == [seq for seq, _, _ in trail(short)]  # two events, in one read
    assert short_found is not None
    assert short_found.finished is False

    received = seqs(first)
    while len(hub):
        hub.poll_once()
        for sub in (long_sub, short_sub):
            found = sub.take()
            if sub is long_sub and found:
                received += seqs(found)
    assert received == [seq for seq, _, _ in trail(long)]


def held(sub: Subscription) -> int:
    pending = sub._pending
    return 0 if pending is None else len(pending.rows) + len(pending.chunks)


def test_a_subscriber_that_does_not_read_is_bounded_then_resyncs_from_the_stored_events(
        db: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "BATCH", 2)
    monkeypatch.setattr(fanout, "PENDING_ITEMS", 5)
    monkeypatch.setattr(fanout, "PENDING_CHARS", 1000)
    run = enqueue("tests.noop", run_after=3600)
    RunEvent.objects.bulk_create(RunEvent(run=run, seq=n, event_id=uuid.uuid4(), type="step",
                                          payload={"n": n}) for n in range(1, 13))
    hub = hand_driven()
    slow, slow_woken = subscribe(hub, run.pk)
    prompt, _ = subscribe(hub, run.pk)
    received: list[int] = []
    for _ in range(20):  # the hub reads on; `slow` never takes
        hub.poll_once()
        hub.deliver_chunks(run.pk, [{"channel": "output", "text": "x" * 10, "attempt": 0}])
        received += seqs(prompt.take() or Found(None))
        assert held(slow) <= fanout.PENDING_ITEMS
    assert received == list(range(1, 13))  # the reader that keeps up lost nothing
    assert slow.parked
    assert slow_woken.is_set()
    assert held(slow) == 0  # what it held was dropped, and nothing more was handed to it

    # Its next take says so, and the stored events come again from where it was.
    found = slow.take()
    assert found is not None
    assert found.resync
    again: list[int] = []
    while len(again) < 12:
        hub.poll_once()
        again += seqs(slow.take() or Found(None))
    assert again == list(range(1, 13))

    # A chunk flood parks it too (PENDING_CHARS), whatever the count.
    hub.deliver_chunks(run.pk, [{"channel": "output", "text": "y" * 2000, "attempt": 0}])
    assert slow.parked
    assert held(slow) == 0
    # The event stream tells its client to resync (live chunks were lost).
    events = stream.EventStream(run.pk, 12, fanout=hub)
    text, _ = events.compose(slow.take())
    assert [m.event for m in parse(text) if m.event == "resync"] == ["resync"]
    hub.unsubscribe(slow)
    hub.unsubscribe(prompt)


def test_a_stream_that_joins_behind_a_read_is_served_by_the_next_one(db: None) -> None:
    run = finished_run(steps=2)
    late: list[Subscription] = []

    def read(positions: Mapping[int, int]) -> dict[int, Found]:
        if not late:  # a stream resuming from the start joins while the read is under way
            late.append(hub.subscribe(run.pk, 0, lambda: None))
        return stream.read_runs(positions)

    hub = Hub(read, stream.POLL_INTERVAL, background=False)
    ahead, _ = subscribe(hub, run.pk, after=4)
    hub.poll_once()
    assert seqs(ahead.take()) == [seq for seq, _, _ in trail(run) if seq > 4]
    assert late[0].take() is None  # not handed rows read from past its position

    hub.poll_once()
    assert seqs(late[0].take()) == [seq for seq, _, _ in trail(run)]


# --------------------------------------------------------------------------- the caps


@pytest.fixture
def small_caps(settings: Any) -> None:
    settings.AGENTRUNS = {**settings.AGENTRUNS, "STREAMS_PER_USER": 2,
                          "STREAMS_PER_PROCESS": 3}


def test_streams_past_a_cap_get_429_with_retry_after_until_one_closes(
        db: None, small_caps: None) -> None:
    run = finished_run(steps=1)
    alice, bob = Client(), Client()
    alice.force_login(make_user("alice", "view_agentrun"))
    bob.force_login(make_user("bob", "view_agentrun"))

    # Responses not read yet hold their slots, as streams being served do.
    held = [alice.get(url(run.pk)) for _ in range(2)]
    assert [r.status_code for r in held] == [200, 200]
    refused = alice.get(url(run.pk))
    assert refused.status_code == 429
    assert refused["Retry-After"] == str(stream.RETRY_AFTER)
    assert b"STREAMS_PER_USER" in refused.content

    held.append(bob.get(url(run.pk)))
    assert held[-1].status_code == 200
    refused = bob.get(url(run.pk))
    assert refused.status_code == 429
    assert b"STREAMS_PER_PROCESS" in refused.content

    # Closed without ever being read: the slot comes back all the same.
    close_as_a_server_does(held.pop(0))
    assert stream.caps.of(User.objects.get(username="alice").pk) == 1
    again = alice.get(url(run.pk))
    assert again.status_code == 200
    for response in [*held, again]:
        b"".join(response.streaming_content)  # read to `end`, then closed
    assert stream.caps.open == 0


def test_a_closed_response_unsubscribes_and_frees_its_slot_at_once(
        transactional_db: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "HEARTBEAT", 0.05)
    client = Client()
    client.force_login(make_user("watcher", "view_agentrun"))
    run = enqueue("tests.noop", run_after=3600)
    response = client.get(url(run.pk))
    chunks = iter(response.streaming_content)
    assert parse(next(chunks).decode())[0].retry == stream.RETRY_MS
    assert next(chunks) == b": keep-alive\n\n"  # sent while waiting on the hub
    assert len(stream.hub) == 1
    assert stream.caps.open == 1

    # What a WSGI server does when a write to a client that left fails:
    close_as_a_server_does(response)
    assert len(stream.hub) == 0
    assert stream.caps.open == 0


# --------------------------------------------------------------------------- ASGI


def test_under_asgi_a_waiting_stream_gets_new_events_from_the_hub(
        transactional_db: None) -> None:
    client = AsyncClient()
    client.force_login(make_user("watcher", "view_agentrun"))
    run = enqueue("tests.noop", run_after=3600)

    async def watch() -> str:
        response = await client.get(url(run.pk))
        assert response.status_code == 200
        assert response.is_async
        chunks = aiter(response.streaming_content)
        text = (await anext(chunks)).decode()
        while len(stream.hub) == 0:  # waiting on the hub now, holding no connection
            text += (await anext(chunks)).decode()
        await sync_to_async(cancel)(run.pk)
        async for chunk in chunks:
            text += chunk.decode()
        await sync_to_async(response.close)()
        return text

    messages = parse(async_to_sync(watch)())
    assert [m.json["type"] for m in messages if m.data and m.event == "message"] == \
        ["run.cancelled"]
    assert messages[-1].event == "end"
    assert messages[-1].json == {"status": "cancelled", "reason": "cancelled"}
