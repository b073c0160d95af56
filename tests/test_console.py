"""The console's triage: the run page's summary, asking before acting, History, the list."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.ops import workers
from tests.test_admin import (
    OVERVIEW,
    RETRY_CLASS,
    add_events,
    changelist,
    login,
    make_run,
    run_url,
    staff,
    status_of,
)

pytestmark = pytest.mark.django_db


def summary(client: Client, run: AgentRun) -> str:
    html = client.get(run_url(run)).content.decode()
    start = html.index('id="agentruns-summary"')
    # The summary comes before every fieldset of the page.
    assert start < html.index("<fieldset")
    return html[start:html.index("</div>", start)]


# --------------------------------------------------------------------------- run page


def test_a_not_retryable_dead_letter_says_fix_the_cause_first(operator: Client) -> None:
    run = make_run(Status.FAILED, error_type="openai.AuthenticationError",
                   error_message="Incorrect API key provided: sk-…")
    top = summary(operator, run)
    assert "Failed (dead letter)" in top
    assert "Not retryable" in top
    assert "<code>openai.AuthenticationError</code>: Incorrect API key provided" in top
    assert "fix the cause first" in top


def test_exhausted_and_abandoned_dead_letters_say_what_to_read(operator: Client) -> None:
    exhausted = make_run(Status.FAILED, reason=Reason.RETRIES_EXHAUSTED, requeue_count=3,
                         error_type="TimeoutError", error_message="read timed out")
    assert "Retries exhausted after 3 requeues: read the last error" in summary(
        operator, exhausted)
    abandoned = make_run(Status.FAILED, reason=Reason.RETRIES_EXHAUSTED,
                         error_type="AbandonedAttempt",
                         error_message="the attempt was abandoned: lease lapsed")
    assert "its worker died, was stopped, or lost the database" in summary(operator, abandoned)


def test_a_cancel_reason_shows_with_the_status(operator: Client) -> None:
    cancelled = make_run(Status.CANCELLED, cancel_reason="not needed this week")
    assert "Cancelled: not needed this week" in summary(operator, cancelled)
    asked = make_run(Status.RUNNING, cancel_requested_at=timezone.now(),
                     cancel_reason="by alice")
    assert "cancel requested: by alice" in summary(operator, asked)
    html = operator.get(run_url(asked)).content.decode()
    lease = html.index("<h2", html.index("Lease"))  # the Lease fieldset no longer has it
    assert "cancel requested" not in html[lease:html.index("</fieldset>", lease)].lower()


def test_a_running_run_shows_its_latest_progress_on_top(operator: Client) -> None:
    run = make_run(Status.RUNNING)
    add_events(run, 5)
    RunEvent.objects.create(run=run, seq=6, event_id="00000000-0000-0000-0000-000000000006",
                            type="run.renewed", payload={}, attempt=1)
    top = summary(operator, run)
    assert "Latest progress: <strong>step</strong> (#5," in top
    assert "{&quot;n&quot;: 5}" in top


def test_a_queued_run_no_live_worker_takes_says_so(operator: Client) -> None:
    run = make_run(Status.QUEUED, queue="reports")
    assert "no live worker serves queue &#x27;reports&#x27;" in summary(operator, run)
    workers.register(_Worker(["reports"]))
    assert "agentruns-no-worker" not in summary(operator, run)


class _Worker:
    def __init__(self, queues: list[str]) -> None:
        self.worker_id, self.queues, self.concurrency = "w", queues, 1
        self.agent_names = ["tests.noop"]


# --------------------------------------------------------------------------- ask first, warn


def test_retrying_not_retryable_runs_warns_on_every_confirmation(operator: Client) -> None:
    hopeless = make_run(Status.FAILED, reason=Reason.NOT_RETRYABLE, error_type="AuthError")
    transient = make_run(Status.FAILED, reason=Reason.RETRIES_EXHAUSTED, error_type="AuthError")
    single = operator.get(run_url(hopeless, "retry")).content.decode()
    assert "Warning: 1 of the 1 failed as <strong>not retryable</strong>" in single
    assert "will likely fail again" in single
    assert "agentruns-not-retryable" not in operator.get(
        run_url(transient, "retry")).content.decode()
    bulk = operator.post(changelist(), {"action": "retry_runs", "index": "0",
                                        "_selected_action": [hopeless.pk, transient.pk]})
    assert "Warning: 1 of the 2 failed as" in bulk.content.decode()
    group = operator.post(reverse(RETRY_CLASS), {"error_type": "AuthError", "agent": "tests.noop",
                                                 "reason": "not_retryable"})
    assert "Warning: 1 of the 1 failed as" in group.content.decode()
    assert (status_of(hopeless), status_of(transient)) == (Status.FAILED, Status.FAILED)


def test_retrying_a_group_retries_only_that_agent_and_reason(operator: Client) -> None:
    mine = make_run(Status.FAILED, agent="tests.noop", error_type="E",
                    reason=Reason.NOT_RETRYABLE)
    other_agent = make_run(Status.FAILED, agent="tests.steps", error_type="E",
                           reason=Reason.NOT_RETRYABLE)
    other_reason = make_run(Status.FAILED, agent="tests.noop", error_type="E",
                            reason=Reason.RETRIES_EXHAUSTED)
    data = {"error_type": "E", "agent": "tests.noop", "reason": "not_retryable"}
    confirm = operator.post(reverse(RETRY_CLASS), data)
    assert confirm.context["count"] == 1
    operator.post(reverse(RETRY_CLASS), {**data, "confirm": "yes",
                                         "up_to": confirm.context["up_to"]})
    assert [status_of(r) for r in (mine, other_agent, other_reason)] == [
        Status.QUEUED, Status.FAILED, Status.FAILED]


def test_retries_and_cancels_from_the_admin_are_in_its_history(operator: Client) -> None:
    failed, queued = make_run(Status.FAILED), make_run(Status.QUEUED)
    bulk = [make_run(Status.QUEUED) for _ in range(2)]
    finished = make_run(Status.SUCCEEDED)
    operator.post(run_url(failed, "retry"), {"post": "yes"})
    operator.post(run_url(queued, "cancel"), {"post": "yes"})
    operator.post(changelist(), {"action": "cancel_runs", "post": "yes",
                                 "_selected_action": [*(r.pk for r in bulk), finished.pk]})
    entries = {(int(e.object_id), e.get_change_message()) for e in LogEntry.objects.all()}
    assert entries == {(failed.pk, "Retried from the admin"),
                       (queued.pk, "Cancelled from the admin"),
                       *((r.pk, "Cancelled from the admin") for r in bulk)}
    assert {e.user.username for e in LogEntry.objects.all()} == {"operator"}
    history = operator.get(run_url(failed, "history"))
    assert history.status_code == 200
    assert "Retried from the admin" in history.content.decode()


# --------------------------------------------------------------------------- list, overview


def test_the_list_shows_the_start_of_a_failure_message(operator: Client) -> None:
    make_run(Status.FAILED, error_type="RateLimitError",
             error_message="Rate limit reached for gpt-4o in organization org-abc on tokens "
                           "per min (TPM): Limit 30000, Used 29000. " + "x" * 5000)
    make_run(Status.SUCCEEDED, error_message="an old error of an earlier attempt")
    html = operator.get(changelist()).content.decode()
    assert "Rate limit reached for gpt-4o in organization o…" in html
    assert "x" * 300 not in html
    assert "an old error of an earlier attempt" not in html


def test_the_overview_triages(operator: Client) -> None:
    now = timezone.now()
    make_run(Status.FAILED, error_type="TimeoutError", error_message="read timed out")
    make_run(Status.RUNNING, lease_expires=now - timedelta(seconds=40), claimed_by="gone:1:x")
    make_run(Status.QUEUED, queue="reports")
    response = operator.get(reverse(OVERVIEW) + "?window=1h")
    html = response.content.decode()
    assert response.context["window"] == "1h"
    assert '<svg id="agentruns-chart"' in html
    assert 'data-agent="tests.noop" data-error-type="TimeoutError"' in html
    assert "read timed out" in html
    assert "Stuck: lease lapsed, not yet taken back: 1" in html
    assert 'data-queue="reports" class="agentruns-alert"' in html  # due, and no worker
    assert 'id="agentruns-agents"' in html
    uncovered = [(u.queue, u.agent, u.due) for u in response.context["uncovered"]]
    assert uncovered == [("reports", "tests.noop", 1)]
    workers.register(_Worker(["reports"]))  # serves the queue, with tests.noop only
    assert operator.get(reverse(OVERVIEW)).context["uncovered"] == []
    make_run(Status.QUEUED, agent="tests.steps", queue="reports")  # an agent it lacks
    [gap] = operator.get(reverse(OVERVIEW)).context["uncovered"]
    assert (gap.queue, gap.agent) == ("reports", "tests.steps")
    assert "has agent 'tests.steps'" in gap.why
    assert operator.get(reverse(OVERVIEW) + "?window=bogus").context["window"] == "3h"


def test_the_workers_page_needs_the_view_permission(operator: Client) -> None:
    workers.register(_Worker(["default"]))
    url = reverse("admin:django_agentruns_workerrecord_changelist")
    html = operator.get(url).content.decode()
    assert ">live<" in html
    nobody = login(staff("nobody", "retry_agentrun"))
    assert nobody.get(url).status_code == 403
    record = workers.live().get()
    assert operator.post(reverse("admin:django_agentruns_workerrecord_change",
                                 args=[record.pk]), {"queues": "[]"}).status_code == 403
    assert workers.live().get().queues == ["default"]
