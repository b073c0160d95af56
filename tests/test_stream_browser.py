"""The example project's live page in a real browser: Debian's Chromium driven by Playwright.

An operator starts a run on the page (a CSRF-checked POST); a real worker (`runworker`
subprocess) executes it; the page shows its steps as they arrive over the event stream
(EventSource), survives the stream's reconnects without showing anything twice, and ends
on the run's outcome. Served by pytest-django's `live_server` from tests/urls.py, which
mounts the example's view with a test agent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.http import HttpRequest

from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.streaming import sse as stream
from tests import helpers
from tests.browser import BROWSER_MARKS, SCREENSHOTS, launched_browser, new_page
from tests.testapp.models import SideEffect

with contextlib.suppress(ImportError):  # tests.browser's marks skip (or fail in CI)
    from playwright.sync_api import Browser, Page, expect

DEMO_TEMPLATES = helpers.REPO_ROOT / "example_project" / "demo" / "templates"
LIVE_PAGE = "/demo/live/"

pytestmark = BROWSER_MARKS


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    yield from launched_browser()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    yield from new_page(browser, 1100, 700)


@pytest.fixture
def demo_templates(settings: Any) -> None:
    """The example app is not installed in the tests: find its templates by directory."""
    settings.TEMPLATES = [{**settings.TEMPLATES[0], "DIRS": [DEMO_TEMPLATES]}]


@pytest.fixture
def viewer(transactional_db: None) -> User:
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(
        content_type__app_label="django_agentruns", codename="view_agentrun"))
    return user


@pytest.fixture
def resumes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Streams end after a second (the browser then reconnects and resumes); the
    Last-Event-ID of each reconnect is recorded here."""
    seen: list[str] = []
    position = stream._position

    def recording(request: HttpRequest) -> int | None:
        if "Last-Event-ID" in request.headers:
            seen.append(request.headers["Last-Event-ID"])
        return position(request)

    monkeypatch.setattr(stream, "MAX_LIFE", 1.0)
    monkeypatch.setattr(stream, "_position", recording)
    return seen


def test_a_run_started_on_the_page_is_watched_live_to_its_end(
        page: Page, live_server: Any, viewer: User, demo_templates: None,
        worker_env: dict[str, str], resumes: list[str]) -> None:
    page.goto(f"{live_server.url}/admin/login/?next={LIVE_PAGE}")
    page.fill("#id_username", "viewer")
    page.fill("#id_password", "pw")
    page.click("input[type=submit]")
    expect(page.locator("#start")).to_be_visible()

    with helpers.start_manage(["runworker"], worker_env) as worker:
        page.click("#start")
        status = page.locator("#run-status")
        steps = page.locator("#events li[data-type=step]")
        expect(steps).to_have_count(1)
        expect(status).to_have_attribute("data-status", "running")
        run = AgentRun.objects.get(agent="tests.live_steps")
        # Live: the first step is shown while the run waits at its gate.
        assert run.status == Status.RUNNING

        # Let the stream end and the browser come back with Last-Event-ID at least once,
        # then finish the run.
        helpers.wait_until(lambda: resumes, message="the browser to reconnect and resume")
        SideEffect.objects.create(run_id=run.pk, note="open")
        expect(status).to_have_attribute("data-status", "succeeded", timeout=20_000)
        expect(status).to_have_text(f"Run #{run.pk}: succeeded (completed)")
        expect(steps).to_have_count(2)
        worker.stop()

    shown = page.locator("#events li").evaluate_all(
        "items => items.map(i => [Number(i.dataset.seq), i.dataset.type])")
    trail = [list(e) for e in RunEvent.objects.filter(run=run).order_by("seq")
             .values_list("seq", "type")]
    assert shown == trail  # every event once, in order, across the reconnects
    assert trail[-1][1] == "run.succeeded"
    assert all(int(seq) >= 1 for seq in resumes)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "live-run.png"), full_page=True)


def test_streamed_text_appears_live_and_is_whole_after_a_reload(
        page: Page, live_server: Any, viewer: User, demo_templates: None,
        worker_env: dict[str, str]) -> None:
    page.goto(f"{live_server.url}/admin/login/?next=/demo/live-stream/")
    page.fill("#id_username", "viewer")
    page.fill("#id_password", "pw")
    page.click("input[type=submit]")
    expect(page.locator("#start")).to_be_visible()
    words = "".join(f"w{i} " for i in range(30))

    with helpers.start_manage(["runworker"], worker_env) as worker:
        page.click("#start")
        output = page.locator("#output")
        # The words appear while the run waits at its gate, before anything is stored.
        expect(output).to_have_text(words.strip())
        run = AgentRun.objects.get(agent="tests.streamer")
        assert run.status == Status.RUNNING
        assert not RunEvent.objects.filter(run=run, type="stream").exists()

        SideEffect.objects.create(run_id=run.pk, note="open")
        expect(page.locator("#run-status")).to_have_attribute("data-status", "succeeded",
                                                              timeout=20_000)
        whole = words + "a0 a1 a2 "
        expect(output).to_have_text(whole.strip())
        worker.stop()

    # A reload shows the same run, and the whole text, from the stored event alone.
    page.reload()
    expect(page.locator("#run-status")).to_have_attribute("data-status", "succeeded")
    expect(page.locator("#output")).to_have_text(whole.strip())
    assert page.locator("#events li[data-type=stream]").count() == 1
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "live-stream.png"), full_page=True)
