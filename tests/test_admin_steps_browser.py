"""The run page's "Replay with...", clicked: a replaying fork opens beside its origin."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User

from django_agentruns import run_now
from django_agentruns.models import AgentRun
from django_agentruns.runtime.worker import Worker
from tests.browser import BROWSER_MARKS, launched_browser, new_page
from tests.test_admin_browser import log_in, make_user

with contextlib.suppress(ImportError):
    from playwright.sync_api import Browser, Page, expect

pytestmark = BROWSER_MARKS


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    yield from launched_browser()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    yield from new_page(browser, 1400, 900)


@pytest.fixture
def operator(transactional_db: None) -> User:
    return make_user("operator", "view_agentrun", "retry_agentrun")


def test_replay_with_an_agent_opens_the_fork_with_its_steps_beside_the_origins(
        page: Page, live_server: Any, operator: User) -> None:
    run_now("tests.step_loop", {"n": 2})
    origin = AgentRun.objects.get()
    log_in(page, live_server, "operator")
    page.goto(f"{live_server.url}/admin/django_agentruns/agentrun/{origin.pk}/change/")
    expect(page.locator('#steps tr[data-step="draft/2"]')).to_be_visible()
    page.select_option("#agentruns-replay-agent", "tests.step_loop")
    page.click("#agentruns-replay")
    expect(page.locator(".messagelist")).to_contain_text(f"replays run #{origin.pk}")
    replay = AgentRun.objects.exclude(pk=origin.pk).get()
    assert replay.forked_from_id == origin.pk
    Worker(burst=True, reap_interval=0).run(install_signals=False)
    page.reload()
    expect(page.locator("#compare")).to_contain_text(f"Compared with run #{origin.pk}")
    expect(page.locator('#compare tr[data-compare="draft/2"]')).to_contain_text("replayed")
    expect(page.locator("#steps")).to_contain_text("(replayed)")
