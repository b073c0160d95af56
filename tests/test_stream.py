"""The live event stream: a run's events as server-sent events, in order, each once, then `end`.

`GET /agentruns/runs/<id>/events/` (django_agentruns.streaming.sse). Live runs are made by a real
`runworker` subprocess; the stream is read through Django's test client, under WSGI and
under ASGI.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import Permission, User
from django.test import AsyncClient, Client

from django_agentruns import enqueue, run_now
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.streaming import sse as stream
from tests import helpers
from tests.testapp.models import SideEffect


@dataclass
class Message:
    """One block of the stream: an event (id, name, data), or a comment, or `retry:`."""

    event: str = "message"
    id: str | None = None
    data: str | None = None
    comment: str | None = None
    retry: int | None = None

    @property
    def json(self) -> Any:
        assert self.data is not None
        return json.loads(self.data)


def parse(text: str) -> list[Message]:
    """Server-sent events as a browser reads them (blocks end with a blank line)."""
    messages = []
    for block in text.split("\n\n"):
        if not block:
            continue
        message = Message()
        for line in block.split("\n"):
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "":
                message.comment = value
            elif field == "retry":
                message.retry = int(value)
            elif field == "data":
                message.data = value if message.data is None else f"{message.data}\n{value}"
            else:
                setattr(message, field, value)
        messages.append(message)
    return messages


def events_of(messages: list[Message]) -> list[Message]:
    return [m for m in messages if m.data is not None and m.event == "message"]


def url(run_id: int, query: str = "") -> str:
    return f"/agentruns/runs/{run_id}/events/{query}"


def make_user(username: str, *codenames: str, staff: bool = False) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=staff)
    user.user_permissions.set(Permission.objects.filter(
        content_type__app_label="django_agentruns", codename__in=codenames))
    return user


@pytest.fixture(autouse=True)
def streams_let_go() -> Iterator[None]:
    """Every test starts and ends with no stream open and the poller holding no connection
    (PostgreSQL could not drop the test database under it)."""

    def let_go() -> bool:
        gc.collect()  # a response a test did not close gives its slot back when collected
        return len(stream.hub) == 0 and not stream.hub.connected and stream.caps.open == 0

    helpers.wait_until(let_go, timeout=60, message="streams of earlier tests to let go")
    yield
    helpers.wait_until(let_go, timeout=60, message="streams to let go")


@pytest.fixture
def watcher(client: Client, db: None) -> Client:
    client.force_login(make_user("watcher", "view_agentrun"))
    return client


def finished_run(steps: int = 2) -> AgentRun:
    """A run of tests.steps that succeeded, executed here (run_now), with its event trail."""
    run_now("tests.steps", {"steps": steps})
    return AgentRun.objects.filter(agent="tests.steps").latest("id")


def trail(run: AgentRun) -> list[tuple[int, str, Any]]:
    return list(RunEvent.objects.filter(run=run).order_by("seq")
                .values_list("seq", "type", "payload"))


def read(client: Client, path: str, **headers: str) -> tuple[Any, list[Message]]:
    response = client.get(path, headers=headers)
    assert response.status_code == 200, response
    return response, parse(b"".join(response.streaming_content).decode())


# --------------------------------------------------------------------------- a finished run


def test_a_finished_run_streams_its_whole_trail_in_order_then_end(watcher: Client) -> None:
    run = finished_run(steps=2)
    expected = trail(run)
    assert len(expected) >= 6  # started, 2 x (step, checkpoint), succeeded

    response, messages = read(watcher, url(run.pk))

    assert response["Content-Type"] == "text/event-stream"
    assert response["Cache-Control"] == "no-cache"
    assert messages[0].retry == stream.RETRY_MS
    events = events_of(messages)
    assert [(int(m.id or 0), m.json["type"], m.json["payload"]) for m in events] == expected
    assert all(m.json["seq"] == int(m.id or 0) for m in events)
    assert events[-1].json["type"] == "run.succeeded"
    assert messages[-1].event == "end"
    assert messages[-1].json == {"status": "succeeded", "reason": "completed"}


def test_after_and_last_event_id_resume_past_the_given_sequence(watcher: Client) -> None:
    run = finished_run(steps=2)
    seqs = [seq for seq, _, _ in trail(run)]

    _, after_two = read(watcher, url(run.pk, "?after=2"))
    assert [int(m.id or 0) for m in events_of(after_two)] == [s for s in seqs if s > 2]

    # A reconnecting browser repeats the URL it was given and adds Last-Event-ID: the
    # header is where it really is.
    _, resumed = read(watcher, url(run.pk, "?after=1"), **{"Last-Event-ID": "4"})
    assert [int(m.id or 0) for m in events_of(resumed)] == [s for s in seqs if s > 4]
    assert resumed[-1].event == "end"

    _, past_the_end = read(watcher, url(run.pk, f"?after={seqs[-1]}"))
    assert events_of(past_the_end) == []
    assert past_the_end[-1].event == "end"


def test_a_long_trail_is_sent_in_batches_each_event_once(
        watcher: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "BATCH", 2)
    run = finished_run(steps=4)
    expected = trail(run)
    assert len(expected) > 2 * 4

    _, messages = read(watcher, url(run.pk))

    assert [int(m.id or 0) for m in events_of(messages)] == [seq for seq, _, _ in expected]
    assert [m.event for m in messages].count("end") == 1


# --------------------------------------------------------------------------- refusals


def test_anonymous_users_and_users_without_view_permission_are_refused(
        client: Client, db: None) -> None:
    run = finished_run(steps=1)
    assert client.get(url(run.pk)).status_code == 403

    client.force_login(make_user("staff", staff=True))
    assert client.get(url(run.pk)).status_code == 403

    client.force_login(make_user("canceller", "cancel_agentrun", staff=True))
    assert client.get(url(run.pk)).status_code == 403

    client.force_login(make_user("viewer", "view_agentrun"))
    assert client.get(url(run.pk)).status_code == 200


@pytest.mark.parametrize(("query", "headers"), [
    ("?after=-1", {}), ("?after=x", {}), ("?after=1.5", {}), ("", {"Last-Event-ID": "abc"}),
])
def test_a_bad_position_is_a_400(watcher: Client, query: str, headers: dict[str, str]) -> None:
    run = finished_run(steps=1)
    response = watcher.get(url(run.pk, query), headers=headers)
    assert response.status_code == 400
    assert b"sequence number" in response.content


def test_an_unknown_run_is_a_404_and_only_get_is_allowed(watcher: Client) -> None:
    run = finished_run(steps=1)
    assert watcher.get(url(run.pk + 1000)).status_code == 404
    assert watcher.post(url(run.pk)).status_code == 405


# --------------------------------------------------------------------------- live


def test_events_arrive_while_the_run_runs_and_the_stream_ends_when_it_does(
        client: Client, worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "MAX_LIFE", 30.0)  # a bug must not hang the suite for 10 min
    client.force_login(make_user("watcher", "view_agentrun"))
    run = enqueue("tests.live_steps", {"seconds": 30})
    with helpers.start_manage(["runworker"], worker_env) as worker:
        response = client.get(url(run.pk))
        chunks: Iterator[bytes] = iter(response.streaming_content)
        seen: list[Message] = []

        def read_until(predicate: Any) -> None:
            while not any(predicate(m) for m in seen):
                seen.extend(parse(next(chunks).decode()))

        read_until(lambda m: m.data and m.event == "message" and m.json["type"] == "step")
        # The first step is on the page while the run still waits at its gate.
        assert AgentRun.objects.get(pk=run.pk).status == Status.RUNNING
        assert not any(m.event == "end" for m in seen)

        SideEffect.objects.create(run_id=run.pk, note="open")
        read_until(lambda m: m.event == "end")
        with pytest.raises(StopIteration):
            next(chunks)  # the stream closed after `end`
        worker.stop()

    events = events_of(seen)
    assert [(int(m.id or 0), m.json["type"], m.json["payload"]) for m in events] == \
        trail(run)
    assert [m.json["payload"] for m in events if m.json["type"] == "step"] == \
        [{"n": 0}, {"n": 1}]
    assert seen[-1].json == {"status": "succeeded", "reason": "completed"}


def test_a_quiet_stream_sends_heartbeats_and_ends_at_its_life_bound_without_end(
        db: None, monkeypatch: pytest.MonkeyPatch) -> None:
    run = enqueue("tests.noop", run_after=3600)  # stays queued: no event will come
    now = [100.0]
    events = stream.EventStream(run.pk, clock=lambda: now[0])

    first, state = events.poll()
    assert (parse(first), state) == ([Message(retry=stream.RETRY_MS)], stream.WAIT)
    now[0] += stream.HEARTBEAT - 1
    assert events.poll() == ("", stream.WAIT)
    now[0] += 1
    assert events.poll() == (": keep-alive\n\n", stream.WAIT)
    assert events.poll() == ("", stream.WAIT)  # the next one is a HEARTBEAT away again
    now[0] = 100.0 + stream.MAX_LIFE
    # No `end`: the run is not over. The browser reconnects, with Last-Event-ID.
    assert events.poll() == ("", stream.DONE)


def test_a_deleted_run_ends_the_stream(db: None) -> None:
    run = enqueue("tests.noop", run_after=3600)
    events = stream.EventStream(run.pk)
    events.poll()
    AgentRun.objects.filter(pk=run.pk).delete()
    text, state = events.poll()
    assert state == stream.DONE
    assert parse(text)[-1] == Message(event="end", data='{"status": null, "reason": null}')


# --------------------------------------------------------------------------- ASGI


def test_under_asgi_the_stream_is_async_and_says_the_same(watcher: Client) -> None:
    run = finished_run(steps=2)
    _, over_wsgi = read(watcher, url(run.pk))
    client = AsyncClient()
    client.force_login(User.objects.get(username="watcher"))

    async def read_async() -> tuple[bool, str]:
        response = await client.get(url(run.pk))
        assert response.status_code == 200
        body = b"".join([chunk async for chunk in response.streaming_content])
        return response.is_async, body.decode()

    began = time.monotonic()
    is_async, text = async_to_sync(read_async)()
    assert is_async  # served by the async iterator, not a sync one read to its end first
    assert parse(text) == over_wsgi
    assert time.monotonic() - began < 5


# --------------------------------------------------------------------------- the example's page

LIVE_PAGE = "/demo/live/"  # tests/urls.py mounts it offering tests.live_steps


@pytest.fixture
def demo_templates(settings: Any) -> None:
    """The example app is not installed in the tests: find its templates by directory."""
    settings.TEMPLATES = [{**settings.TEMPLATES[0],
                           "DIRS": [helpers.REPO_ROOT / "example_project/demo/templates"]}]


def test_the_live_page_starts_a_run_with_a_csrf_checked_post(
        db: None, demo_templates: None) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("watcher", "view_agentrun"))
    page = client.get(LIVE_PAGE)
    assert page.status_code == 200
    assert b'<option value="tests.live_steps">' in page.content

    assert client.post(LIVE_PAGE, {"agent": "tests.live_steps"}).status_code == 403
    assert not AgentRun.objects.exists()

    token = client.cookies["csrftoken"].value
    started = client.post(LIVE_PAGE, {"agent": "tests.live_steps",
                                      "csrfmiddlewaretoken": token})
    assert started.status_code == 201
    run = AgentRun.objects.get()
    assert (run.agent, run.input, run.status) == ("tests.live_steps", {"seconds": 60},
                                                  Status.QUEUED)
    assert started.json() == {"run": run.pk, "events": url(run.pk),
                              "admin": f"/admin/django_agentruns/agentrun/{run.pk}/change/"}

    refused = client.post(LIVE_PAGE, {"agent": "tests.noop", "csrfmiddlewaretoken": token})
    assert refused.status_code == 400  # only the agents the page offers
    assert AgentRun.objects.count() == 1


def test_the_live_page_needs_a_login_with_view_permission(client: Client, db: None) -> None:
    response = client.get(LIVE_PAGE)
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/?next=/demo/live/")
    client.force_login(make_user("staff", staff=True))
    assert client.get(LIVE_PAGE).status_code == 403
    assert client.post(LIVE_PAGE, {"agent": "tests.live_steps"}).status_code == 403
    assert not AgentRun.objects.exists()
