"""The console's checkpoints and "fork from here" on the run page, paused
queues on the overview with Pause / Resume, and the schedules' admin."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from django_agentruns import add_schedule, pause_queue, run_now
from django_agentruns.models import AgentRun, PausedQueue, Schedule
from tests.test_admin import login, messages_of, staff

pytestmark = pytest.mark.django_db


def url(name: str, *args: object) -> str:
    return reverse(f"admin:django_agentruns_agentrun_{name}", args=args)


@pytest.fixture
def origin() -> AgentRun:
    run_now("tests.steps", {"steps": 4})
    return AgentRun.objects.get()


def test_the_run_page_lists_checkpoints_with_fork_buttons(origin: AgentRun) -> None:
    client = login(staff("op", "view_agentrun", "retry_agentrun"))
    page = client.get(url("change", origin.pk))
    assert page.status_code == 200
    assert [r["number"] for r in page.context["checkpoints"]["rows"]] == [4, 3, 2, 1]
    assert page.context["checkpoints"]["rows"][-1]["preview"] == '{"step": 1}'
    assert b"Fork from here" in page.content

    viewer = login(staff("viewer", "view_agentrun"))
    page = viewer.get(url("change", origin.pk))
    assert b"Fork from here" not in page.content
    assert viewer.post(url("fork", origin.pk), {"checkpoint": "2"}).status_code == 403
    assert AgentRun.objects.count() == 1


def test_fork_from_here_creates_the_fork_and_opens_it(origin: AgentRun) -> None:
    client = login(staff("op", "view_agentrun", "retry_agentrun"))
    response = client.post(url("fork", origin.pk), {"checkpoint": "2"})
    forked = AgentRun.objects.exclude(pk=origin.pk).get()
    assert response.status_code == 302
    assert response.url == url("change", forked.pk)
    assert forked.forked_from_id == origin.pk
    assert forked.checkpoint_state == {"step": 2}
    assert messages_of(client, response) == [
        f"Run #{forked.pk} forked from run #{origin.pk} at checkpoint 2."]
    page = client.get(url("change", forked.pk))
    assert f'href="{url("change", origin.pk)}"'.encode() in page.content  # forked from


@pytest.mark.parametrize(("number", "message"), [
    ("9", "has no checkpoint 9"), ("x", "Malformed checkpoint number"), ("", "Malformed")])
def test_fork_from_a_bad_checkpoint_says_so_and_writes_nothing(
    origin: AgentRun, number: str, message: str,
) -> None:
    client = login(staff("op", "view_agentrun", "retry_agentrun"))
    response = client.post(url("fork", origin.pk), {"checkpoint": number})
    assert response.status_code == 302
    assert message in messages_of(client, response)[0]
    assert AgentRun.objects.count() == 1
    assert client.get(url("fork", origin.pk)).status_code == 405


def test_the_overview_shows_paused_queues_and_pauses_and_resumes(admin_client: Client) -> None:
    pause_queue("slow", by="alice")
    page = admin_client.get(url("overview"))
    rows = {q.queue: q for q in page.context["queues"]}
    assert rows["slow"].paused is not None
    assert rows["slow"].paused.paused_by == "alice"
    assert rows["default"].paused is None
    assert b"Paused</strong>" in page.content
    assert b'value="Resume"' in page.content

    response = admin_client.post(url("pause_queue"), {"queue": "default"})
    assert messages_of(admin_client, response) == ["Queue 'default' paused."]
    assert PausedQueue.objects.get(name="default").paused_by == "admin"
    for name in ("default", "slow"):
        response = admin_client.post(url("resume_queue"), {"queue": name})
        assert messages_of(admin_client, response) == [f"Queue {name!r} resumed."]
    assert not PausedQueue.objects.exists()
    response = admin_client.post(url("pause_queue"), {"queue": "a b"})
    assert "queue name" in messages_of(admin_client, response)[0]
    assert not PausedQueue.objects.exists()


def test_pausing_needs_the_paused_queue_permissions() -> None:
    client = login(staff("viewer", "view_agentrun"))
    assert client.post(url("pause_queue"), {"queue": "default"}).status_code == 403
    page = client.get(url("overview"))
    assert b'value="Pause"' not in page.content
    assert not PausedQueue.objects.exists()


def test_the_schedules_admin_adds_checks_and_lists_next_ticks(admin_client: Client) -> None:
    add = reverse("admin:django_agentruns_schedule_add")
    bad = admin_client.post(add, {"name": "r", "agent": "tests.noop", "cron": "99 * * * *",
                                  "input": "{}", "enabled": "on"})
    assert bad.status_code == 200
    assert b"bad cron expression" in bad.content
    assert not Schedule.objects.exists()
    unknown = admin_client.post(add, {"name": "r", "agent": "tests.nope", "every": "60",
                                      "input": "{}", "enabled": "on"})
    assert unknown.status_code == 200
    assert not Schedule.objects.exists()

    done = admin_client.post(add, {"name": "r", "agent": "tests.noop", "every": "60",
                                   "input": '{"a": 1}', "enabled": "on"})
    assert done.status_code == 302, done.content
    row = Schedule.objects.get()
    assert row.last_tick is not None
    assert row.input == {"a": 1}
    listing = admin_client.get(reverse("admin:django_agentruns_schedule_changelist"))
    assert b"every 60 s" in listing.content


def test_a_declared_schedule_can_be_paused_but_not_retimed_or_deleted(
    admin_client: Client,
) -> None:
    add_schedule("rt", "tests.noop", every=60)
    Schedule.objects.filter(name="rt").update(origin=Schedule.Origin.CODE)
    row = Schedule.objects.get()
    change = reverse("admin:django_agentruns_schedule_change", args=[row.pk])
    response = admin_client.post(change, {"every": "1"})  # enabled unticked: paused
    assert response.status_code == 302
    row.refresh_from_db()
    assert row.every == 60
    assert row.enabled is False
    delete = reverse("admin:django_agentruns_schedule_delete", args=[row.pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
