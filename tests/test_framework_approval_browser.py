"""A Pydantic AI agent's tool call that needs approval, approved by clicking Approve on the
run's admin page in Chromium: the run waits after the model asked for the tool, resumes once
approved, and finishes with the tool having run once and the first answer replayed, not asked
of the provider again. The run is made and resumed by a real `runworker` process against the
fake provider (tests/fakeprovider.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User

from django_agentruns import enqueue
from django_agentruns.models import Status
from tests import helpers
from tests.browser import BROWSER_MARKS, launched_browser, new_page
from tests.fakeprovider import FakeProvider
from tests.integration_support import APPROVAL_TURNS, env_for, finished, run, stored_text, tool_runs
from tests.test_admin_browser import CHANGELIST, log_in, make_user

FRAMEWORK = "pydantic_ai"
"""Whose agents this module's worker subprocesses load (`env_for`)."""

pytest.importorskip("pydantic_ai")

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
def approver(transactional_db: None) -> User:
    return make_user("approver", "view_agentrun", "approve_agentrun")


@pytest.mark.parametrize("name", ["tests.pydantic_ai", "tests.pydantic_ai_async"])
def test_approve_a_pydantic_ai_tool_call_in_the_admin_and_the_tool_runs_once(
        page: Page, live_server: Any, approver: User, worker_env: dict[str, str],
        fake_provider: FakeProvider, name: str) -> None:
    fake_provider.script(APPROVAL_TURNS)
    env = env_for(worker_env, fake_provider, FRAMEWORK)
    pk = enqueue(name, {"model": "m", "prompt": "Refund me"}).pk
    log_in(page, live_server, "approver")
    with helpers.start_manage(["runworker"], env) as worker:
        helpers.wait_until(lambda: run(pk).status == Status.WAITING, timeout=90,
                           message="the run to wait for the approval")
        waiting = run(pk)
        assert tool_runs(pk) == []
        page.goto(f"{live_server.url}{CHANGELIST}{pk}/change/")
        expect(page.locator("#agentruns-wait")).to_contain_text(
            f"Waiting for approval of {waiting.wait_key}")
        # The approver sees the tool and its arguments, as the model asked for them.
        proposal = json.loads(page.locator("#agentruns-proposal").input_value())
        assert proposal == {"tool": "refund", "args": {"amount": 5}}
        page.click("#agentruns-approve")
        expect(page.locator(".messagelist")).to_contain_text("the run is queued again")
        helpers.wait_until(lambda: finished(pk), timeout=60, message="the run to finish")
        assert worker.returncode is None, worker.output()
    page.reload()
    expect(page.locator("#agentruns-summary .agentruns-badge")).to_have_text("Succeeded")
    done = run(pk)
    assert done.output == {"output": "Refunded 5.", "attempt": 2}
    assert tool_runs(pk) == ["refund:5"]  # once, after the click
    assert fake_provider.count() == 2  # the first answer replayed from its step's record
    assert stored_text(pk) == "Let me refund that.Refunded 5."
