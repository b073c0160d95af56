"""The console's 3 a.m. buttons and columns, through Django's test client (the browser
tests click them too): Retry with a budget, Reap now, Reopen now, the limits' columns, the
run list's task paths and queue filter, and the overview's stuck section first."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_agentruns.models import AgentLimit, AgentRun, Reason, RunEvent, Status
from django_agentruns.transitions import close_key
from tests.test_admin import changelist, login, make_run, messages_of, run_url, staff

pytestmark = pytest.mark.django_db


def budget_dead_letter() -> AgentRun:
    return make_run(Status.FAILED, agent="tests.spender", reason=Reason.BUDGET_EXHAUSTED,
                    error_type="BudgetExhausted", input_tokens=1200)


def stuck() -> AgentRun:
    return make_run(Status.RUNNING, claimed_by="gone:1:x",
                    lease_expires=timezone.now() - timedelta(seconds=90))


def test_retry_confirmation_offers_a_budget_and_retries_with_it(operator: Client) -> None:
    run = budget_dead_letter()
    page = operator.get(run_url(run, "retry"))
    assert b'id="agentruns-budget-tokens"' in page.content
    assert b"stops again at once" in page.content
    done = operator.post(run_url(run, "retry"), {"post": "yes", "budget_tokens": "5,000",
                                                 "budget_cost": ""})
    assert done.status_code == 302
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.budget) == (Status.QUEUED, {"tokens": 5000})
    assert RunEvent.objects.get(run=run, type="run.retried").payload["by"] == "operator"


def test_a_malformed_budget_retries_nothing(operator: Client) -> None:
    run = budget_dead_letter()
    done = operator.post(run_url(run, "retry"), {"post": "yes", "budget_cost": "lots"})
    assert "Budget cost must be a number" in " ".join(messages_of(operator, done))
    assert AgentRun.objects.get(pk=run.pk).status == Status.FAILED


def test_retry_without_a_budget_field_keeps_the_plain_retry(operator: Client) -> None:
    run = make_run(Status.FAILED)
    page = operator.get(run_url(run, "retry"))
    assert b"agentruns-budget-tokens" not in page.content
    operator.post(run_url(run, "retry"), {"post": "yes"})
    row = AgentRun.objects.get(pk=run.pk)
    assert (row.status, row.budget) == (Status.QUEUED, None)


def test_bulk_retry_warns_of_budget_dead_letters(operator: Client) -> None:
    runs = [budget_dead_letter(), make_run(Status.FAILED)]
    page = operator.post(changelist(), {"action": "retry_runs",
                                        "_selected_action": [r.pk for r in runs]})
    assert b"1 of these was dead-lettered for its budget" in page.content


def test_reap_now_takes_back_a_stuck_run_and_needs_retry_permission(operator: Client,
                                                                    viewer: Client) -> None:
    run = stuck()
    assert viewer.post(run_url(run, "reap")).status_code == 403
    assert operator.get(run_url(run, "reap")).status_code == 405
    page = operator.get(run_url(run))
    assert b'id="agentruns-reap"' in page.content
    assert b"Stuck: lease lapsed" in page.content
    done = operator.post(run_url(run, "reap"), {"back": "overview"})
    assert done["Location"] == reverse("admin:django_agentruns_agentrun_overview")
    assert "reaped: requeued" in " ".join(messages_of(operator, done))
    assert AgentRun.objects.get(pk=run.pk).status == Status.QUEUED


def test_reap_now_leaves_a_run_whose_lease_holds(operator: Client) -> None:
    run = make_run(Status.RUNNING)
    done = operator.post(run_url(run, "reap"))
    assert "was not reaped" in " ".join(messages_of(operator, done))
    assert AgentRun.objects.get(pk=run.pk).status == Status.RUNNING
    assert b'id="agentruns-reap"' not in operator.get(run_url(run)).content


def test_the_overview_puts_stuck_runs_before_everything_else(operator: Client) -> None:
    run = stuck()
    page = operator.get(reverse("admin:django_agentruns_agentrun_overview")).content.decode()
    assert page.index('id="agentruns-stuck-section"') < page.index("Runs finished and dead")
    assert f'data-run="{run.pk}"' in page
    assert "gone:1:x gone" in page


def test_limits_show_paused_keys_queued_counts_and_reopen(admin_client: Client) -> None:
    AgentLimit.objects.create(key="paused", max_running=0, updated_at=timezone.now())
    close_key("openai", timezone.now() + timedelta(minutes=5), "429 on run 3")
    make_run(Status.QUEUED, limit_key="openai")
    make_run(Status.QUEUED, limit_key="openai")
    listing = admin_client.get("/admin/django_agentruns/agentlimit/").content.decode()
    assert "paused (limit 0)" in listing
    assert '<td class="field-queued">2</td>' in listing
    assert "429 on run 3" in listing
    assert "agentruns-badge" in listing or "<style>" in listing  # the app's stylesheet
    reopen = reverse("admin:django_agentruns_agentlimit_reopen", args=["openai"])
    assert admin_client.get(reopen).status_code == 405
    admin_client.post(reopen)
    assert AgentLimit.objects.get(key="openai").closed_until is None


def test_reopen_needs_the_change_permission() -> None:
    close_key("openai", timezone.now() + timedelta(minutes=5), "429")
    viewer = login(staff("limits-viewer", "view_agentlimit"))
    reopen = reverse("admin:django_agentruns_agentlimit_reopen", args=["openai"])
    assert viewer.post(reopen).status_code == 403
    assert AgentLimit.objects.get(key="openai").closed_until is not None


def test_the_run_list_names_task_runs_by_their_path_and_filters_the_runs_queues(
        viewer: Client) -> None:
    make_run(Status.QUEUED, agent="django.tasks", queue="emails-nightly",
             input={"task": "myapp.tasks.send_digest", "args": []})
    page = viewer.get(changelist()).content.decode()
    assert "myapp.tasks.send_digest" in page
    assert "?queue=emails-nightly" in page


def test_every_agentruns_admin_page_carries_the_one_stylesheet(admin_client: Client) -> None:
    for url in ("/admin/django_agentruns/workerrecord/", "/admin/django_agentruns/schedule/",
                "/admin/django_agentruns/agentlimit/", "/admin/django_agentruns/agentrun/",
                "/admin/django_agentruns/agentrun/overview/"):
        assert b".agentruns-badge {" in admin_client.get(url).content, url
