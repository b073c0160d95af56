"""What an operator is told at 3 a.m., outside the browser: `why` and the run page's advice
for budget dead letters and stuck runs, reopening a closed key, log lines that say each
thing once, who paused a queue, and why the event stream refused."""

from __future__ import annotations

import getpass
import io
import logging
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone

import django_agentruns
from django_agentruns import open_key
from django_agentruns.models import AgentLimit, AgentRun, PausedQueue, Reason, Status
from django_agentruns.ops.diagnosis import advice
from django_agentruns.outcomes import AttemptRef, Outcome, Settlement
from django_agentruns.runtime.recording import log_settlement, settlement_facts
from django_agentruns.transitions import close_key
from tests.test_admin import make_run

pytestmark = pytest.mark.django_db


def why(run: AgentRun) -> str:
    out = io.StringIO()
    call_command("why", str(run.pk), stdout=out)
    return out.getvalue()


def budget_dead_letter() -> AgentRun:
    return make_run(Status.FAILED, agent="tests.spender", reason=Reason.BUDGET_EXHAUSTED,
                    error_type="BudgetExhausted", input_tokens=900, output_tokens=300,
                    error_message="the run passed its budget: tokens 1200 > 1000")


def stuck(worker: str = "web-3:1:gone") -> AgentRun:
    now = timezone.now()
    return make_run(Status.RUNNING, claimed_by=worker, lease_expires=now - timedelta(seconds=80))


def test_a_budget_dead_letter_is_told_to_raise_its_budget_not_blamed_on_run_now() -> None:
    run = budget_dead_letter()
    said = advice(run)
    assert "interactive" not in said
    assert "Budget exhausted: it recorded 1200 tokens" in said
    assert "tokens 1000" in said  # the agent's budget, as it ran under
    assert f"retry({run.pk}, budget=" in said
    assert "stops again at once" in said
    printed = why(run)
    assert "Budget exhausted" in printed
    assert "run_now" not in printed


def test_a_run_retried_with_its_own_budget_is_judged_by_that_one() -> None:
    run = budget_dead_letter()
    run.budget = {"tokens": 1100}
    assert "tokens 1100" in advice(run)


def test_only_an_interactive_failure_is_said_to_be_one() -> None:
    run = make_run(Status.FAILED, reason=Reason.ERROR)
    assert "interactive call (run_now)" in advice(run)


def test_why_a_stuck_run_promises_no_take_back_when_no_live_worker_will() -> None:
    printed = why(stuck())
    assert "will be taken back" not in printed
    assert "worker web-3:1:gone gone" in printed
    assert "no live worker will take it back" in printed
    assert "manage.py reap" in printed


def test_why_a_stuck_run_names_the_live_worker_that_reaps_it() -> None:
    from django_agentruns.models import WorkerRecord

    now = timezone.now()
    WorkerRecord.objects.create(worker_id="web-9:2:live", host="web", pid=2, queues=["other"],
                                concurrency=1, agents=[], version="0", started_at=now,
                                last_seen_at=now)
    printed = why(stuck())
    assert "a live worker's own reap" in printed
    assert "no live worker" not in printed


def test_open_key_reopens_a_closed_key_and_is_public() -> None:
    assert django_agentruns.open_key is open_key
    assert "open_key" in django_agentruns.__all__
    close_key("openai", timezone.now() + timedelta(minutes=5), "429 on run 7")
    assert open_key("openai") is True
    row = AgentLimit.objects.get(key="openai")
    assert (row.closed_until, row.closed_reason) == (None, "")
    assert open_key("openai") is False  # not closed any more
    assert open_key("never-seen") is False


def test_a_reopened_key_lets_its_runs_be_claimed() -> None:
    from django_agentruns import api, transitions
    from django_agentruns.outcomes import ScopePolicy

    def claim() -> list[AgentRun]:
        return transitions.claim_limited("w", ["default"], 5, ScopePolicy(), {}, 60.0)

    run = api.enqueue("tests.keyed_openai", {})
    close_key("openai", timezone.now() + timedelta(minutes=5), "429")
    assert claim() == []
    open_key("openai")
    claimed = claim()
    assert [r.pk for r in claimed] == [run.pk]


def log_line(caplog: pytest.LogCaptureFixture, settlement: Settlement, outcome: Outcome,
             facts: dict[str, str]) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="django_agentruns.worker"):
        log_settlement(AttemptRef(7, 1, "w", 60.0), "tests.a", settlement, outcome, facts)
    return caplog.records[-1].getMessage()


def test_log_lines_say_the_reason_once_and_name_cancels_and_waits(
        caplog: pytest.LogCaptureFixture) -> None:
    budget = Outcome("stopped", stop_reason="budget_exhausted")
    line = log_line(caplog, Settlement.DEAD_LETTERED, budget, {"reason": "budget_exhausted"})
    assert line == "run 7 tests.a attempt 1 dead_lettered (budget_exhausted)"
    cancelled = Outcome("stopped", stop_reason="cancelled")
    line = log_line(caplog, Settlement.CANCELLED, cancelled,
                    {"cancel_reason": "cancelled by ops in the admin"})
    assert line == ("run 7 tests.a attempt 1 cancelled (cancel reason: cancelled by ops in "
                    "the admin)")
    waiting = Outcome("stopped", stop_reason="waiting")
    line = log_line(caplog, Settlement.WAITING, waiting, {"wait_key": "refund"})
    assert line == "run 7 tests.a attempt 1 waiting (wait key 'refund')"


def test_settlement_facts_read_what_the_log_line_names() -> None:
    run = make_run(Status.CANCELLED, cancel_reason="not needed")
    facts = settlement_facts(AttemptRef(run.pk, 1, "w", 60.0), Settlement.CANCELLED)
    assert facts["cancel_reason"] == "not needed"
    assert settlement_facts(AttemptRef(run.pk, 1, "w", 60.0), Settlement.SUCCEEDED) == {}


def test_queues_pause_records_the_os_user_by_default() -> None:
    call_command("queues", "pause", "emails", stdout=io.StringIO())
    assert PausedQueue.objects.get(name="emails").paused_by == getpass.getuser()
    call_command("queues", "pause", "bulk", "--by", "ops-oncall", stdout=io.StringIO())
    assert PausedQueue.objects.get(name="bulk").paused_by == "ops-oncall"


def test_the_event_stream_says_why_it_refuses(client: Client) -> None:
    run = make_run(Status.RUNNING)
    url = reverse("agentruns:run-events", args=[run.pk])
    anonymous = client.get(url)
    assert anonymous.status_code == 403
    assert b"django_agentruns.view_agentrun" in anonymous.content
    assert b"You are not logged in" in anonymous.content
    client.force_login(User.objects.create_user("nobody", is_staff=True))
    refused: Any = client.get(url)
    assert refused.status_code == 403
    assert b"User 'nobody' lacks django_agentruns.view_agentrun" in refused.content
