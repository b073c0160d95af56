"""The console's triage pages in a real browser: the run page, the overview, asking first.

Runs are made by real workers against pytest-django's `live_server`, as in
test_admin_browser. The docs' screenshots of the run page and the overview come from here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User

from django_agentruns import api
from django_agentruns.models import AgentRun, Status
from tests import helpers
from tests.browser import BROWSER_MARKS, launched_browser, new_page
from tests.test_admin_browser import CHANGELIST, log_in, make_user, screenshot

with contextlib.suppress(ImportError):  # tests.browser's marks skip (or fail in CI)
    from playwright.sync_api import Browser, Page, expect

pytestmark = BROWSER_MARKS
LAPTOP = (1400, 900)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    yield from launched_browser()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    yield from new_page(browser, *LAPTOP)


@pytest.fixture
def operator(transactional_db: None) -> User:
    return make_user("operator", "view_agentrun", "retry_agentrun", "cancel_agentrun")


@pytest.fixture
def failures(worker_env: dict[str, str]) -> dict[str, AgentRun]:
    """Successes and dead letters of both kinds, run to the end by a burst worker."""
    runs = {f"ok{n}": api.enqueue("tests.triage", {"ticket": 4500 + n}, scope=f"t-{n}")
            for n in range(4)}
    runs |= {f"auth{n}": api.enqueue("tests.triage", {"ticket": 4600 + n, "fail": "auth"},
                                     scope=f"a-{n}") for n in range(2)}
    runs["timeout"] = api.enqueue("tests.triage", {"ticket": 4700, "fail": "timeout"},
                                  scope="ticket-4700")
    runs["flaky"] = api.enqueue("tests.flaky", {"succeed_on": 2}, scope="sync-crm")
    done = helpers.run_manage(["runworker", "--burst"], worker_env)
    assert done.returncode == 0, done.stderr
    for run in runs.values():
        run.refresh_from_db()
    assert runs["timeout"].is_dead_letter
    assert runs["auth0"].is_dead_letter
    return runs


def in_first_screen(page: Page, selector: str) -> bool:
    box = page.locator(selector).first.bounding_box()
    return box is not None and box["y"] + box["height"] <= LAPTOP[1]


def test_the_run_page_puts_the_failure_first_and_asks_before_retrying(
        page: Page, live_server: Any, operator: User, failures: dict[str, AgentRun]) -> None:
    run = failures["timeout"]
    log_in(page, live_server, "operator")
    page.goto(f"{live_server.url}{CHANGELIST}{run.pk}/change/")
    summary = page.locator("#agentruns-summary")
    expect(summary).to_contain_text("Retries exhausted")
    expect(page.locator("#agentruns-error")).to_contain_text(
        "TimeoutError: model call timed out after 30 s")
    expect(page.locator("#agentruns-advice")).to_contain_text("read the last error")
    assert in_first_screen(page, "#agentruns-advice")  # no scrolling to learn what happened
    # The timeline opens on its newest event: the one that explains the dead letter.
    expect(page.locator("#events tbody tr").first).to_contain_text("run.dead_lettered")
    screenshot(page, "admin-run.png")

    page.click("#agentruns-oldest-first")
    expect(page.locator("#events tbody tr").first).to_contain_text("run.started")

    page.goto(f"{live_server.url}{CHANGELIST}{failures['auth0'].pk}/change/")
    expect(page.locator("#agentruns-advice")).to_contain_text("fix the cause first")
    page.click("#agentruns-retry")
    expect(page.locator("#agentruns-not-retryable")).to_contain_text("will likely fail again")
    assert AgentRun.objects.get(pk=failures["auth0"].pk).status == Status.FAILED
    page.click("#agentruns-confirm")
    expect(page.locator(".messagelist")).to_contain_text("is queued again")
    page.get_by_role("link", name="History").click()
    expect(page.locator("#change-history")).to_contain_text("Retried from the admin")


def test_a_running_run_shows_its_latest_progress_and_cancel_asks_first(
        page: Page, live_server: Any, operator: User, worker_env: dict[str, str]) -> None:
    run = api.enqueue("tests.heartbeats", {"seconds": 60}, scope="ticket-4800")
    with helpers.start_manage(["runworker"], worker_env) as worker:
        helpers.wait_until(lambda: AgentRun.objects.filter(pk=run.pk, status=Status.RUNNING)
                           .exists(), message="the run to start")
        log_in(page, live_server, "operator")
        page.goto(f"{live_server.url}{CHANGELIST}{run.pk}/change/")
        expect(page.locator("#agentruns-summary")).to_be_visible()
        page.click("#agentruns-cancel")
        expect(page.locator("#content-main")).to_contain_text(
            "Cancel 1 queued, running or waiting run?")
        expect(page.locator("#content-main")).not_to_contain_text("Skipped")
        assert AgentRun.objects.get(pk=run.pk).cancel_requested_at is None
        page.click("#agentruns-confirm")
        expect(page.locator(".messagelist")).to_contain_text("was asked to stop")
        helpers.wait_until(lambda: AgentRun.objects.get(pk=run.pk).status == Status.CANCELLED,
                           message="the run to be cancelled")
        worker.stop()


def test_the_overview_triages_and_retries_a_group(
        page: Page, live_server: Any, operator: User, failures: dict[str, AgentRun],
        worker_env: dict[str, str]) -> None:
    api.enqueue("tests.noop", queue="reports")  # due, and no worker serves "reports"
    with helpers.start_manage(["runworker"], worker_env) as worker:
        helpers.wait_until(lambda: helpers_live_workers() == 1, message="a live worker")
        log_in(page, live_server, "operator")
        page.goto(f"{live_server.url}{CHANGELIST}overview/")
        expect(page.locator("#agentruns-chart")).to_be_visible()
        expect(page.locator("#agentruns-live-workers")).to_have_text("1")
        expect(page.locator("#agentruns-queues tr[data-queue='reports']")).to_contain_text(
            "none")
        expect(page.locator("#agentruns-agents tr[data-agent='tests.triage']")).to_contain_text(
            "57%")  # 4 of the 7 triage runs succeeded
        screenshot(page, "admin-overview.png")
        group = page.locator("#agentruns-groups tr[data-reason='not_retryable']")
        expect(group).to_contain_text("model provider answered 401")
        group.get_by_role("button").click()
        expect(page.locator("#agentruns-not-retryable")).to_contain_text("2 of the 2")
        page.click("#agentruns-confirm")
        expect(page.locator(".messagelist")).to_contain_text("2 runs queued again")
        worker.stop()


def helpers_live_workers() -> int:
    from django_agentruns.ops import workers

    return workers.live().count()


def test_the_run_list_fits_a_laptop_screen(
        page: Page, live_server: Any, operator: User, failures: dict[str, AgentRun]) -> None:
    AgentRun.objects.filter(pk=failures["timeout"].pk).update(
        error_message="model call timed out after 30 s while waiting for " + "a" * 400)
    log_in(page, live_server, "operator")
    expect(page.locator("#nav-sidebar")).to_be_visible()  # the sidebar open, as by default
    expect(page.locator("#result_list .agentruns-error-short").first).to_be_visible()
    # The admin scrolls a wide table inside div.results, not the page: measure both.
    for element in ("document.documentElement", "document.querySelector('#changelist .results')"):
        widths = page.evaluate(f"[{element}.scrollWidth, {element}.clientWidth]")
        assert widths[0] <= widths[1], f"horizontal scroll in {element}: {widths}"
    expect(page.locator("#result_list")).to_contain_text("model call timed out after 30 s")
