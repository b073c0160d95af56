"""The 3 a.m. pages in a real browser at 1400x900: a stuck run reaped from its page and from
the overview, a budget dead letter retried with a raised budget, a 429-closed key reopened,
a running run's output shown as it is written, the run list and the workers page.

Every button here is clicked, and what it did is read back from the database. The
screenshots (into AGENTRUNS_SCREENSHOTS, e.g. docs/screenshots) are taken here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from django_agentruns import api
from django_agentruns.models import AgentLimit, AgentRun, Reason, RunEvent, Status, WorkerRecord
from tests import helpers
from tests.browser import BROWSER_MARKS, launched_browser, new_page
from tests.test_admin_browser import CHANGELIST, log_in, make_user, screenshot
from tests.testapp.models import SideEffect

with contextlib.suppress(ImportError):  # tests.browser's marks skip (or fail in CI)
    from playwright.sync_api import Browser, Page, expect

pytestmark = BROWSER_MARKS
LAPTOP = (1400, 900)
LIMITS = "/admin/django_agentruns/agentlimit/"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    yield from launched_browser()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    yield from new_page(browser, *LAPTOP)


@pytest.fixture
def operator(transactional_db: None) -> User:
    return make_user("operator", "view_agentrun", "retry_agentrun", "cancel_agentrun",
                     "view_agentlimit", "change_agentlimit", "view_workerrecord")


def stuck_run(worker: str = "web-3:4711:gone", lapsed: float = 95.0, **fields: Any) -> AgentRun:
    """A running run whose worker died: its lease lapsed, and no worker is left to reap it."""
    now = timezone.now()
    return AgentRun.objects.create(
        agent="tests.noop", queue="default", status=Status.RUNNING, attempt=1,
        claimed_by=worker, started_at=now - timedelta(seconds=lapsed + 30),
        lease_expires=now - timedelta(seconds=lapsed), input={"n": 1}, **fields)


def badge(page: Page) -> Any:
    return page.locator("#agentruns-summary .agentruns-badge")


def test_a_stuck_run_says_so_and_reap_now_takes_it_back(
        page: Page, live_server: Any, operator: User) -> None:
    run = stuck_run()
    log_in(page, live_server, "operator")
    page.goto(f"{live_server.url}{CHANGELIST}{run.pk}/change/")
    expect(badge(page)).to_contain_text("Stuck: lease lapsed")
    expect(badge(page)).to_contain_text("worker web-3:4711:gone gone")
    expect(badge(page)).not_to_contain_text("Running")
    expect(page.locator("#agentruns-stuck-note")).to_contain_text("No live worker will take "
                                                                  "it back")
    screenshot(page, "stuck-run.png", full_page=False)

    page.click("#agentruns-reap")
    expect(page.locator(".messagelist")).to_contain_text(f"Run #{run.pk} reaped: requeued.")
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.requeue_count, row.claimed_by) == (Status.QUEUED, 1, "")
    assert RunEvent.objects.filter(run=run, type="run.abandoned").exists()
    expect(page.locator("#agentruns-reap")).to_have_count(0)


def test_the_overview_shows_stuck_runs_first_and_reaps_one(
        page: Page, live_server: Any, operator: User) -> None:
    # A busy history below: dead letters, finished runs; the stuck section stays on top.
    for n in range(6):
        AgentRun.objects.create(agent=f"tests.agent_{n}", queue="default",
                                status=Status.FAILED, reason=Reason.RETRIES_EXHAUSTED,
                                error_type="TimeoutError", error_message="timed out",
                                finished_at=timezone.now(), attempt=1)
    first, second = stuck_run(), stuck_run(worker="web-4:99:gone", lapsed=400)
    log_in(page, live_server, "operator")
    page.goto(f"{live_server.url}{CHANGELIST}overview/")
    section = page.locator("#agentruns-stuck-section")
    expect(section).to_contain_text("Stuck: lease lapsed, not yet taken back: 2")
    expect(section).to_contain_text("worker web-4:99:gone gone")
    box = section.bounding_box()
    assert box is not None
    assert box["y"] < LAPTOP[1], box  # on the first screen
    screenshot(page, "overview-stuck.png", full_page=False)

    section.locator(f"tr[data-run='{second.pk}'] input[type=submit]").click()
    expect(page.locator(".messagelist")).to_contain_text(f"Run #{second.pk} reaped: requeued.")
    assert AgentRun.objects.get(pk=second.pk).status == Status.QUEUED
    assert AgentRun.objects.get(pk=first.pk).status == Status.RUNNING  # only the one clicked
    expect(page.locator("#agentruns-stuck-section")).to_contain_text("not yet taken back: 1")


def test_a_budget_dead_letter_is_retried_with_a_raised_budget(
        page: Page, live_server: Any, operator: User, worker_env: dict[str, str]) -> None:
    run = api.enqueue("tests.spender", {"steps": 5})
    done = helpers.run_manage(["runworker", "--burst"], worker_env)
    assert done.returncode == 0, done.stderr
    run.refresh_from_db()
    assert (run.status, run.reason) == (Status.FAILED, Reason.BUDGET_EXHAUSTED)

    log_in(page, live_server, "operator")
    page.goto(f"{live_server.url}{CHANGELIST}{run.pk}/change/")
    advice = page.locator("#agentruns-advice")
    expect(advice).to_contain_text("Budget exhausted: it recorded 1200 tokens")
    expect(advice).to_contain_text("tokens 1000")
    expect(advice).not_to_contain_text("interactive")
    page.click("#agentruns-retry")
    expect(page.locator("#agentruns-budget-warning")).to_contain_text("stops again at once")
    expect(page.locator("#agentruns-budget-tokens")).to_have_value("1000")
    page.fill("#agentruns-budget-tokens", "5000")
    screenshot(page, "retry-budget.png", full_page=False)
    page.click("#agentruns-confirm")
    expect(page.locator(".messagelist")).to_contain_text("is queued again")
    run.refresh_from_db()
    assert (run.status, run.budget) == (Status.QUEUED, {"tokens": 5000})
    assert RunEvent.objects.get(run=run, type="run.retried").payload["budget"] == {
        "tokens": 5000}

    done = helpers.run_manage(["runworker", "--burst"], worker_env)  # and now it finishes
    assert done.returncode == 0, done.stderr
    assert AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED


def test_limits_show_paused_keys_and_queued_counts_and_reopen_a_closed_key(
        page: Page, live_server: Any, operator: User) -> None:
    until = timezone.now() + timedelta(minutes=10)
    AgentLimit.objects.create(key="openai", max_running=4, closed_until=until,
                              closed_reason="429 on run 17", updated_at=timezone.now())
    AgentLimit.objects.create(key="anthropic", max_running=0, updated_at=timezone.now())
    for _ in range(3):
        api.enqueue("tests.keyed_openai", {})
    api.enqueue("tests.keyed_openai", {}, limit_key="anthropic")

    log_in(page, live_server, "operator")
    page.goto(f"{live_server.url}{LIMITS}")
    rows = page.locator("#result_list tbody tr")
    expect(rows.filter(has_text="anthropic")).to_contain_text("paused (limit 0)")
    expect(rows.filter(has_text="openai").locator("td.field-queued")).to_have_text("3")
    expect(rows.filter(has_text="anthropic").locator("td.field-queued")).to_have_text("1")
    expect(rows.filter(has_text="openai").locator("td.field-closed")).to_contain_text(
        "429 on run 17")
    screenshot(page, "limits.png", full_page=False)

    page.goto(f"{live_server.url}{LIMITS}openai/change/")
    page.click("#agentruns-reopen")
    expect(page.locator(".messagelist")).to_contain_text("Key 'openai' reopened")
    row = AgentLimit.objects.get(key="openai")
    assert (row.closed_until, row.closed_reason, row.max_running) == (None, "", 4)
    expect(page.locator("#agentruns-reopen")).to_have_count(0)


def test_a_running_run_shows_its_output_as_it_is_written(
        page: Page, live_server: Any, operator: User, worker_env: dict[str, str]) -> None:
    run = api.enqueue("tests.streamer", {"n": 12, "gate": True, "after": 2})
    words = "".join(f"w{i} " for i in range(12))
    log_in(page, live_server, "operator")
    # Opened while queued, the page follows the run's stream (live chunks are not kept:
    # on PostgreSQL they travel by NOTIFY, to the pages listening then).
    page.goto(f"{live_server.url}{CHANGELIST}{run.pk}/change/")
    output = page.locator("#agentruns-output")
    expect(output).to_have_attribute("data-follow", f"/agentruns/runs/{run.pk}/events/")
    page.wait_for_function("window.agentrunsFollowing === true")
    with helpers.start_manage(["runworker"], worker_env) as worker:
        # The words show while the run waits at its gate: live chunks, nothing stored yet.
        expect(output).to_have_text(words.strip() + " ", use_inner_text=True, timeout=20_000)
        assert AgentRun.objects.get(pk=run.pk).status == Status.RUNNING
        assert not RunEvent.objects.filter(run=run, type="stream").exists()
        screenshot(page, "run-live-output.png", full_page=False)

        SideEffect.objects.create(run_id=run.pk, note="open")
        expect(output).to_have_attribute("data-ended", "true", timeout=20_000)
        expect(output).to_contain_text("a0 a1")
        worker.stop()
    assert AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED
    page.reload()  # finished: the stored stream events, read by the page itself
    expect(page.locator("#agentruns-output")).to_contain_text(words + "a0 a1")


def test_the_run_list_fits_1400_px_with_task_paths_and_stuck_runs(
        page: Page, live_server: Any, operator: User) -> None:
    now = timezone.now()
    path = "example_project.demo.tasks.send_the_weekly_digest_to_every_subscriber_in_the_eu"
    AgentRun.objects.create(agent="django.tasks", queue="emails-bulk-low-priority",
                            input={"task": path, "args": [], "kwargs": {}}, status=Status.QUEUED)
    stuck_run(worker="worker-eu-west-1-production-host-0042:123456:9f8e7d6c5b4a",
              scope="customer-8812/ticket-40512/escalation")
    AgentRun.objects.create(
        agent="support.triage_and_escalate_customer_ticket", queue="support-high",
        scope="customer-8812/ticket-40513/" + "x" * 60, status=Status.FAILED,
        reason=Reason.BUDGET_EXHAUSTED, error_type="BudgetExhausted", attempt=3,
        requeue_count=2, error_message="the run passed its budget: tokens 1200 > 1000 " * 5,
        input_tokens=120000, output_tokens=45000, cost=12.3456, finished_at=now)
    AgentRun.objects.create(agent="tests.noop", queue="default", status=Status.RUNNING,
                            attempt=1, claimed_by="w", started_at=now,
                            lease_expires=now + timedelta(seconds=60),
                            cancel_requested_at=now, cancel_reason="operator")
    log_in(page, live_server, "operator")
    expect(page.locator("#nav-sidebar")).to_be_visible()  # the sidebar open, as by default
    expect(page.locator("#result_list")).to_contain_text(path)
    expect(page.locator("#result_list")).to_contain_text("Stuck: lease lapsed")
    queues = page.locator("#changelist-filter").get_by_role("link",
                                                             name="emails-bulk-low-priority")
    expect(queues).to_have_count(1)  # the queue filter offers the runs' own queues
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= LAPTOP[0], f"the page scrolls sideways: scrollWidth {width}"
    results = page.evaluate("[document.querySelector('#changelist .results').scrollWidth,"
                            " document.querySelector('#changelist .results').clientWidth]")
    assert results[0] <= results[1], f"the table is clipped: {results}"
    screenshot(page, "run-list.png", full_page=False)  # (folds the sidebar away)


def test_the_workers_page_has_the_app_stylesheet_and_readable_badges(
        page: Page, live_server: Any, operator: User) -> None:
    now = timezone.now()
    # The live one last beat "in a minute": the tests' lease TTL (the live window) is short.
    for worker_id, seen in (("web-1:100:live", now + timedelta(minutes=1)),
                            ("web-2:200:gone", now - timedelta(hours=1))):
        WorkerRecord.objects.create(worker_id=worker_id, host="web", pid=1, queues=["default"],
                                    concurrency=4, agents=["tests.noop"], version="0.1.0",
                                    started_at=seen, last_seen_at=seen)
    log_in(page, live_server, "operator")
    page.goto(f"{live_server.url}/admin/django_agentruns/workerrecord/")
    for label in ("live", "gone (stopped beating)"):
        found = page.locator(".agentruns-badge", has_text=label)
        expect(found).to_have_count(1)
        assert found.evaluate("e => getComputedStyle(e).color") == "rgb(255, 255, 255)"
    screenshot(page, "workers.png", full_page=False)
