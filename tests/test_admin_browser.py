"""The operations console in a real browser: Debian's Chromium driven by Playwright.

Runs are made by real workers (`runworker` subprocesses) against pytest-django's
`live_server`. The screenshots the docs show are taken here (into artifacts/screenshots/, or
where AGENTRUNS_SCREENSHOTS says).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User

from django_agentruns import api
from django_agentruns.models import AgentRun, Status
from tests import helpers
from tests.browser import BROWSER_MARKS, SCREENSHOTS, launched_browser, new_page

with contextlib.suppress(ImportError):  # tests.browser's marks skip (or fail in CI)
    from playwright.sync_api import Browser, Page, expect

CHANGELIST = "/admin/django_agentruns/agentrun/"

pytestmark = BROWSER_MARKS


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    yield from launched_browser()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    yield from new_page(browser, 1600, 900)


def make_user(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(
        content_type__app_label="django_agentruns", codename__in=codenames))
    return user


@pytest.fixture
def operator(transactional_db: None) -> User:
    return make_user("operator", "view_agentrun", "retry_agentrun", "cancel_agentrun")


def log_in(page: Page, live_server: Any, username: str) -> None:
    page.goto(f"{live_server.url}/admin/login/?next={CHANGELIST}")
    page.fill("#id_username", username)
    page.fill("#id_password", "pw")
    page.click("input[type=submit]")
    expect(page.locator("#result_list, .paginator").first).to_be_visible()


@pytest.fixture
def history(worker_env: dict[str, str]) -> dict[str, AgentRun]:
    """A small but real history, run to the end by a burst worker."""
    runs = {
        "ok1": api.enqueue("tests.triage", {"ticket": 4507}, scope="ticket-4507"),
        "auth": api.enqueue("tests.triage", {"ticket": 4511, "fail": "auth"},
                            scope="ticket-4511"),
        "timeout": api.enqueue("tests.triage", {"ticket": 4512, "fail": "timeout"},
                               scope="ticket-4512"),
        "ok2": api.enqueue("tests.triage", {"ticket": 4513}, scope="ticket-4513"),
        "flaky": api.enqueue("tests.flaky", {"succeed_on": 2}, scope="sync-crm"),
        "cancelled": api.enqueue("tests.steps", {"steps": 2}, scope="digest-weekly",
                                 run_after=3600),
        "later": api.enqueue("tests.steps", {"steps": 3}, scope="digest-daily", run_after=3600),
    }
    api.cancel(runs["cancelled"].pk, reason="not needed this week")
    done = helpers.run_manage(["runworker", "--burst"], worker_env)
    assert done.returncode == 0, done.stderr
    for run in runs.values():
        run.refresh_from_db()
    assert runs["timeout"].is_dead_letter
    assert runs["auth"].is_dead_letter
    return runs


def screenshot(page: Page, name: str, *, full_page: bool = True) -> None:
    """A screenshot for the docs, with the app sidebar folded away."""
    toggle = page.locator("#toggle-nav-sidebar")
    if toggle.count() and page.locator("#nav-sidebar").is_visible():
        toggle.click()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / name), full_page=full_page)


def badge(page: Page) -> Any:
    return page.locator(".field-status_badge .agentruns-badge")


def test_operator_filters_dead_letters_and_retries_one(
        page: Page, live_server: Any, operator: User, history: dict[str, AgentRun]) -> None:
    log_in(page, live_server, "operator")
    page.get_by_role("link", name="Dead letters").click()
    expect(page.locator("#result_list tbody tr")).to_have_count(2)
    shown = page.locator("#result_list tbody th.field-short_id a").all_inner_texts()
    assert sorted(shown) == sorted(f"#{history[k].pk}" for k in ("auth", "timeout"))

    page.get_by_role("link", name=f"#{history['timeout'].pk}", exact=True).click()
    expect(badge(page)).to_have_text("Failed (dead letter)")
    expect(page.locator("#events")).to_contain_text("run.dead_lettered")

    page.click("#agentruns-retry")
    expect(page.locator("#content-main")).to_contain_text("Retry 1 failed or cancelled run?")
    page.click("#agentruns-confirm")
    expect(page.locator(".messagelist")).to_contain_text("is queued again")
    expect(badge(page)).to_have_text("Queued")
    expect(page.locator("#events")).to_contain_text("run.retried")
    run = AgentRun.objects.get(pk=history["timeout"].pk)
    assert (run.status, run.requeue_count) == (Status.QUEUED, 0)
    assert run.events.get(type="run.retried").payload["by"] == "operator"


def test_cancel_a_running_run_and_see_it_cancelled_once_its_worker_notices(
        page: Page, live_server: Any, operator: User, history: dict[str, AgentRun],
        worker_env: dict[str, str]) -> None:
    run = api.enqueue("tests.heartbeats", {"seconds": 60}, scope="ticket-4520")
    with helpers.start_manage(["runworker"], worker_env) as worker:
        helpers.wait_until(lambda: AgentRun.objects.filter(pk=run.pk, status=Status.RUNNING)
                           .exists(), message="the run to start")
        log_in(page, live_server, "operator")
        screenshot(page, "admin-list.png", full_page=False)

        page.goto(f"{live_server.url}{CHANGELIST}{run.pk}/change/")
        expect(badge(page)).to_have_text("Running")
        page.click("#agentruns-cancel")
        page.click("#agentruns-confirm")
        expect(page.locator(".messagelist")).to_contain_text("was asked to stop")

        def shown_cancelled() -> bool:
            page.reload()
            return badge(page).inner_text() == "Cancelled"

        helpers.wait_until(shown_cancelled, interval=0.2, message="the page to show Cancelled")
        assert worker.returncode is None  # the worker stopped the attempt, not itself
        worker.stop()
    assert AgentRun.objects.get(pk=run.pk).reason == "cancelled"


def test_bulk_cancel_asks_for_confirmation_and_reports_the_skipped(
        page: Page, live_server: Any, operator: User, history: dict[str, AgentRun]) -> None:
    later = [api.enqueue("tests.noop", {"n": n}, run_after=3600) for n in range(2)]
    log_in(page, live_server, "operator")
    for run in [*later, history["ok1"]]:
        page.locator(f"input.action-select[value='{run.pk}']").check()
    page.select_option("select[name=action]", "cancel_runs")
    page.click("button[name=index]")
    expect(page.locator("#content-main")).to_contain_text(
        "Cancel 2 queued, running or waiting runs?")
    expect(page.locator(".agentruns-skipped")).to_contain_text(
        "1 run not queued, running or waiting")
    assert {AgentRun.objects.get(pk=r.pk).status for r in later} == {Status.QUEUED}

    page.click("#agentruns-confirm")
    expect(page.locator(".messagelist")).to_contain_text(
        "Cancel: 2 queued runs cancelled; 1 skipped (already finished).")
    assert {AgentRun.objects.get(pk=r.pk).status for r in later} == {Status.CANCELLED}
    assert AgentRun.objects.get(pk=history["ok1"].pk).status == Status.SUCCEEDED


def test_erase_a_finished_run_with_the_delete_permission_and_keep_the_unfinished(
        page: Page, live_server: Any, history: dict[str, AgentRun]) -> None:
    make_user("dpo", "view_agentrun", "delete_agentrun")
    ok, later = history["ok1"], history["later"]
    assert ok.events.exists()
    log_in(page, live_server, "dpo")
    for run in (ok, later):
        page.locator(f"input.action-select[value='{run.pk}']").check()
    page.select_option("select[name=action]", "erase_runs")
    page.click("button[name=index]")
    expect(page.locator("#content-main")).to_contain_text(
        "Erase 1 finished or cancelled run?")
    expect(page.locator(".agentruns-skipped")).to_contain_text("1 run not finished")
    assert AgentRun.objects.filter(pk=ok.pk).exists()

    page.click("#agentruns-confirm")
    expect(page.locator(".messagelist")).to_contain_text(
        "Erase: 1 run erased, stored rows and all; 1 skipped (not finished).")
    assert not AgentRun.objects.filter(pk=ok.pk).exists()
    assert AgentRun.objects.get(pk=later.pk).status == Status.QUEUED
    expect(page.locator(f"input.action-select[value='{ok.pk}']")).to_have_count(0)


def test_staff_without_the_permissions_see_runs_but_no_actions(
        page: Page, live_server: Any, transactional_db: None) -> None:
    make_user("viewer", "view_agentrun")
    failed = AgentRun.objects.create(agent="tests.noop", queue="default", status=Status.FAILED,
                                     reason="not_retryable", error_type="PermissionError")
    running = AgentRun.objects.create(agent="tests.noop", queue="default",
                                      status=Status.RUNNING, attempt=1, claimed_by="w")
    log_in(page, live_server, "viewer")
    expect(page.locator("#result_list tbody tr")).to_have_count(2)
    expect(page.locator("select[name=action]")).to_have_count(0)
    expect(page.locator("input.action-select")).to_have_count(0)
    for run in (failed, running):
        page.goto(f"{live_server.url}{CHANGELIST}{run.pk}/change/")
        expect(badge(page)).to_be_visible()
        expect(page.locator("#agentruns-retry, #agentruns-cancel")).to_have_count(0)
    page.goto(f"{live_server.url}{CHANGELIST}overview/")
    expect(page.locator("#agentruns-groups")).to_contain_text("PermissionError")
    expect(page.get_by_role("button", name="Retry")).to_have_count(0)
