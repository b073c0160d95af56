"""Answering waiting runs in a real browser: Approve (with an edited proposal and a note),
Reject, Deliver an input, and "Fork from here" on the first and the last checkpoint.

Each button is clicked in Chromium against pytest-django's `live_server`; runs are made and
resumed by real `runworker --burst` processes. A button inside the admin's change form
would submit that form instead (a blank 403): these tests are what catches it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User

from django_agentruns import api
from django_agentruns.models import AgentRun, RunEvent, Status
from tests import helpers
from tests.browser import BROWSER_MARKS, launched_browser, new_page, screenshot
from tests.test_admin_browser import CHANGELIST, log_in, make_user

with contextlib.suppress(ImportError):  # tests.browser's marks skip (or fail in CI)
    from playwright.sync_api import Browser, Page, expect

pytestmark = BROWSER_MARKS


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    yield from launched_browser()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    yield from new_page(browser, 1400, 900)


@pytest.fixture
def answerer(transactional_db: None) -> User:
    return make_user("approver", "view_agentrun", "approve_agentrun", "deliver_agentrun",
                     "retry_agentrun")


def burst(env: dict[str, str]) -> None:
    done = helpers.run_manage(["runworker", "--burst", "--queues", "waiting,default"], env)
    assert done.returncode == 0, done.stderr


def open_run(page: Page, live_server: Any, run: AgentRun | int) -> None:
    page.goto(f"{live_server.url}{CHANGELIST}{getattr(run, 'pk', run)}/change/")


def badge(page: Page) -> Any:
    return page.locator("#agentruns-summary .agentruns-badge")


def timeline(run: AgentRun) -> list[str]:
    return list(RunEvent.objects.filter(run=run).order_by("seq").values_list("type",
                                                                            flat=True))


def fold_sidebar(page: Page) -> None:
    toggle = page.locator("#toggle-nav-sidebar")
    if toggle.count() and page.locator("#nav-sidebar").is_visible():
        toggle.click()
    page.evaluate("window.scrollTo(0, 0)")


def test_approve_an_edited_proposal_with_a_note(
        page: Page, live_server: Any, answerer: User, worker_env: dict[str, str]) -> None:
    run = api.enqueue("tests.approves", {"amount": 80, "order": 1042}, scope="order-1042")
    api.enqueue("tests.approves", {"amount": 15, "order": 1043}, scope="order-1043")
    burst(worker_env)
    log_in(page, live_server, "approver")

    page.goto(f"{live_server.url}{CHANGELIST}overview/")
    expect(page.locator("#agentruns-awaiting h2")).to_have_text("Awaiting approval: 2")
    fold_sidebar(page)
    screenshot(page, "admin-overview-awaiting.png")
    page.locator(f'#agentruns-awaiting tr[data-run="{run.pk}"] a').first.click()

    expect(page.locator("#agentruns-wait")).to_contain_text("Waiting for approval of refund")
    expect(page.locator("#agentruns-wait")).to_contain_text("no deadline")
    proposal = json.loads(page.locator("#agentruns-proposal").input_value())
    assert proposal == {"refund": 80, "order": 1042}
    fold_sidebar(page)
    screenshot(page, "admin-run-waiting.png")

    page.fill("#agentruns-proposal", json.dumps({"refund": 60, "order": 1042}))
    page.fill("#agentruns-note", "partial: late delivery")
    page.click("#agentruns-approve")
    expect(page.locator(".messagelist")).to_contain_text(
        "approve of 'refund' recorded; the run is queued again")
    expect(badge(page)).to_have_text("Queued")
    expect(page.locator("#events")).to_contain_text("run.delivered")
    expect(page.locator("#agentruns-wait")).to_have_count(0)

    burst(worker_env)
    open_run(page, live_server, run)
    expect(badge(page)).to_have_text("Succeeded")
    expect(page.locator("#events")).to_contain_text("run.resumed")
    done = AgentRun.objects.get(pk=run.pk)
    assert done.output == {"approved": True, "by": "approver", "note": "partial: late delivery",
                           "proposal": {"refund": 60, "order": 1042}}
    assert timeline(run)[-4:] == ["run.delivered", "run.resumed", "run.started",
                                  "run.succeeded"]


def test_reject_a_proposal(page: Page, live_server: Any, answerer: User,
                           worker_env: dict[str, str]) -> None:
    run = api.enqueue("tests.approves", {"amount": 500})
    burst(worker_env)
    log_in(page, live_server, "approver")
    open_run(page, live_server, run)
    page.fill("#agentruns-note", "too much")
    page.click("#agentruns-reject")
    expect(page.locator(".messagelist")).to_contain_text("reject of 'refund' recorded")
    expect(badge(page)).to_have_text("Queued")
    burst(worker_env)
    open_run(page, live_server, run)
    expect(badge(page)).to_have_text("Succeeded")
    assert AgentRun.objects.get(pk=run.pk).output == {
        "approved": False, "by": "approver", "note": "too much",
        "proposal": {"refund": 500, "order": 1}}
    assert "run.delivered" in timeline(run)


def test_deliver_an_input_and_a_bad_json_is_refused(
        page: Page, live_server: Any, answerer: User, worker_env: dict[str, str]) -> None:
    run = api.enqueue("tests.waits", {"key": "shipping", "prompt": {"question": "carrier?"}})
    burst(worker_env)
    log_in(page, live_server, "approver")
    open_run(page, live_server, run)
    expect(page.locator("#agentruns-wait")).to_contain_text("Waiting for input shipping")
    expect(page.locator("#agentruns-prompt")).to_contain_text("carrier?")

    page.fill("#agentruns-payload", "{carrier: dhl")
    page.click("#agentruns-deliver-button")
    expect(page.locator(".messagelist")).to_contain_text("the payload is not JSON")
    expect(badge(page)).to_have_text("Waiting")
    assert "run.delivered" not in timeline(run)

    page.fill("#agentruns-payload", '{"carrier": "dhl"}')
    page.click("#agentruns-deliver-button")
    expect(page.locator(".messagelist")).to_contain_text(
        "input for 'shipping' delivered; the run is queued again")
    expect(badge(page)).to_have_text("Queued")
    expect(page.locator("#events")).to_contain_text("run.delivered")
    burst(worker_env)
    open_run(page, live_server, run)
    expect(badge(page)).to_have_text("Succeeded")
    assert AgentRun.objects.get(pk=run.pk).output == {"got": {"carrier": "dhl"}}


@pytest.mark.parametrize("row", ["first", "last"])
def test_fork_from_the_first_and_the_last_checkpoint(
        page: Page, live_server: Any, answerer: User, worker_env: dict[str, str],
        row: str) -> None:
    origin = api.enqueue("tests.steps", {"steps": 3})
    burst(worker_env)
    assert AgentRun.objects.get(pk=origin.pk).checkpoint_count == 3
    log_in(page, live_server, "approver")
    open_run(page, live_server, origin)
    rows = page.locator("#checkpoints tbody tr")
    expect(rows).to_have_count(3)
    chosen = rows.first if row == "first" else rows.last
    number = int(chosen.get_attribute("data-checkpoint") or 0)
    assert number == (3 if row == "first" else 1)  # newest first
    chosen.get_by_role("button", name="Fork from here").click()
    expect(page.locator(".messagelist")).to_contain_text(
        f"forked from run #{origin.pk} at checkpoint {number}")
    forked = AgentRun.objects.get(forked_from=origin)
    assert page.url.endswith(f"{CHANGELIST}{forked.pk}/change/")
    expect(badge(page)).to_have_text("Queued")
    assert forked.checkpoint_state == {"step": number}
    assert timeline(forked)[0] == "run.forked"
    burst(worker_env)
    open_run(page, live_server, forked)
    expect(badge(page)).to_have_text("Succeeded")
    assert AgentRun.objects.get(pk=forked.pk).status == Status.SUCCEEDED
