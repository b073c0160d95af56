"""The run page's steps: a compact list, "Replay with..." and a fork beside its origin."""

from __future__ import annotations

import pytest

from django_agentruns import run_now
from django_agentruns.models import AgentRun, RunStep
from django_agentruns.runtime.worker import Worker
from tests.test_admin import login, messages_of, staff
from tests.test_admin_checkpoints_queues_schedules import url

pytestmark = pytest.mark.django_db


@pytest.fixture
def origin() -> AgentRun:
    run_now("tests.step_loop", {"n": 3})
    return AgentRun.objects.get()


def test_the_run_page_lists_the_steps(origin: AgentRun) -> None:
    RunStep.objects.filter(run=origin, occurrence=3).update(status="failed", error="Boom: no")
    client = login(staff("viewer", "view_agentrun"))
    page = client.get(url("change", origin.pk))
    rows = page.context["steps"]["rows"]
    assert [(r["name"], r["occurrence"], r["tokens"], r["cost"]) for r in rows] == [
        ("draft", 1, 10, 0.5), ("draft", 2, 11, 0.5), ("draft", 3, 12, 0.5)]
    assert b'data-step="draft/3"' in page.content
    assert b"Boom: no" in page.content
    assert b"Replay with" not in page.content  # no retry permission


def test_replay_with_another_agent_opens_the_fork_beside_its_origin(
        origin: AgentRun, transactional_db: None) -> None:
    client = login(staff("op", "view_agentrun", "retry_agentrun"))
    assert b"Replay with" in client.get(url("change", origin.pk)).content
    response = client.post(url("fork", origin.pk), {"replay": "1", "agent": "tests.step_loop"})
    replay = AgentRun.objects.exclude(pk=origin.pk).get()
    assert response.url == url("change", replay.pk)
    assert messages_of(client, response) == [
        f"Run #{replay.pk} replays run #{origin.pk} with 'tests.step_loop'."]
    Worker(burst=True, reap_interval=0).run(install_signals=False)
    page = client.get(url("change", replay.pk))
    compare = page.context["steps"]["origin"]
    assert [(r["step"], r["replayed"], r["differs"]) for r in compare["rows"]] == [
        ("draft/1", True, False), ("draft/2", True, False), ("draft/3", True, False)]
    assert page.context["compare_output"]["fork"] == page.context["compare_output"]["origin"]


def test_replay_with_an_unknown_agent_says_so(origin: AgentRun) -> None:
    client = login(staff("op", "view_agentrun", "retry_agentrun"))
    response = client.post(url("fork", origin.pk), {"replay": "1", "agent": "nope"})
    assert "was not replayed" in messages_of(client, response)[0]
    assert AgentRun.objects.count() == 1
