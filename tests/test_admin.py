"""The operations console: run list, run page, retry/cancel, overview, bad requests.

Runs are set up in the state each test needs; every change the admin makes goes through
`api.retry` / `api.cancel`, so the assertions read the rows and events they wrote.
"""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.db import connection
from django.http import HttpResponse
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import NoReverseMatch, reverse
from django.utils import timezone

from django_agentruns import api
from django_agentruns.models import (
    AgentRun,
    Reason,
    RunCheckpoint,
    RunEvent,
    RunPayload,
    Status,
)

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:django_agentruns_agentrun_changelist"
OVERVIEW = "admin:django_agentruns_agentrun_overview"
RETRY_CLASS = "admin:django_agentruns_agentrun_retry_class"


# --------------------------------------------------------------------------- fixtures


def make_run(status: str = Status.QUEUED, agent: str = "tests.noop", **fields: Any) -> AgentRun:
    """A run row in the state a test needs (test setup; the admin never writes status)."""
    now = timezone.now()
    defaults: dict[str, Any] = {"queue": "default", "input": {"n": 1}}
    if status == Status.RUNNING:
        defaults.update(attempt=1, claimed_by="host:1:abc", started_at=now,
                        lease_expires=now + timedelta(seconds=60))
    elif status in (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED):
        defaults.update(attempt=1, created_at=now - timedelta(seconds=3),
                        started_at=now - timedelta(seconds=2), finished_at=now,
                        reason={Status.SUCCEEDED: Reason.COMPLETED, Status.FAILED:
                                Reason.NOT_RETRYABLE, Status.CANCELLED: Reason.CANCELLED}[status])
    if status == Status.FAILED:
        defaults.update(error_type="PermissionError", error_message="bad credentials",
                        error_traceback="Traceback (most recent call last):\n  boom")
    defaults.update(fields)
    traceback = defaults.pop("error_traceback", "")
    run = AgentRun.objects.create(agent=agent, status=status, **defaults)
    if traceback:  # kept out of the run row, as settling writes it
        RunPayload.objects.create(run=run, kind=RunPayload.TRACEBACK, value=traceback)
    return run


def add_events(run: AgentRun, count: int, type_: str = "step") -> None:
    RunEvent.objects.bulk_create(
        RunEvent(run=run, seq=i, event_id=uuid.uuid4(), type=type_, payload={"n": i},
                 attempt=1) for i in range(1, count + 1))


def staff(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(
        content_type__app_label="django_agentruns", codename__in=codenames))
    return user


def login(user: User, **client_options: Any) -> Client:
    client = Client(**client_options)
    client.force_login(user)
    return client


@pytest.fixture
def viewer() -> Client:
    return login(staff("viewer", "view_agentrun"))


@pytest.fixture
def operator() -> Client:
    return login(staff("operator", "view_agentrun", "retry_agentrun", "cancel_agentrun"))


def listed(response: HttpResponse) -> list[int]:
    assert response.status_code == 200, response.status_code
    return [run.pk for run in response.context["cl"].result_list]


def messages_of(client: Client, response: HttpResponse) -> list[str]:
    """The messages a response left for the next page; then forget them, as that page would."""
    found = [str(m) for m in get_messages(response.wsgi_request)]
    client.cookies.pop("messages", None)
    return found


def status_of(run: AgentRun) -> str:
    return AgentRun.objects.values_list("status", flat=True).get(pk=run.pk)


def changelist(query: str = "") -> str:
    return reverse(CHANGELIST) + query


def run_url(run: AgentRun | int, name: str = "change") -> str:
    return reverse(f"admin:django_agentruns_agentrun_{name}", args=[getattr(run, "pk", run)])


# --------------------------------------------------------------------------- run list


def test_list_shows_a_row_per_run_with_badge_reason_and_age(admin_client: Client) -> None:
    failed = make_run(Status.FAILED, scope="ticket-7")
    queued = make_run(Status.QUEUED, scope="ticket-8")
    response = admin_client.get(changelist())
    assert listed(response) == [queued.pk, failed.pk]
    html = response.content.decode()
    assert f"#{failed.pk}" in html
    assert "ticket-7" in html
    assert 'class="agentruns-badge"' in html
    assert "Failed (dead letter)" in html
    assert "Not retryable" in html
    assert "PermissionError" in html
    assert "waiting " in html  # the queued run's age
    assert "took 3.0 s" in html  # the failed run's enqueue-to-settle time


@pytest.mark.parametrize(("query", "expected"), [
    ("?attention=dead_letter", {"dead", "exhausted", "dead_head"}),
    ("?attention=stuck", {"stuck"}),
    ("?attention=blocked", {"behind", "behind_dead"}),
    ("?status=cancelled", {"cancelled"}),
    ("?reason=retries_exhausted", {"exhausted"}),
    ("?agent=tests.ordered", {"head", "behind"}),
    ("?queue=other", {"other_queue"}),
])
def test_filters_pick_exactly_their_runs(admin_client: Client, query: str,
                                         expected: set[str]) -> None:
    past = timezone.now() - timedelta(seconds=5)
    runs = {
        "dead": make_run(Status.FAILED),
        "exhausted": make_run(Status.FAILED, reason=Reason.RETRIES_EXHAUSTED),
        "interactive_error": make_run(Status.FAILED, reason=Reason.ERROR),
        "cancelled": make_run(Status.CANCELLED),
        "stuck": make_run(Status.RUNNING, lease_expires=past),
        "alive": make_run(Status.RUNNING),
        "head": make_run(Status.QUEUED, agent="tests.ordered", scope="s1", fired_seq=1),
        "behind": make_run(Status.QUEUED, agent="tests.ordered", scope="s1", fired_seq=2),
        # A dead letter blocks its scope only for an agent that says so.
        "dead_head": make_run(Status.FAILED, agent="tests.ordered_blocking", scope="s2",
                              fired_seq=1),
        "behind_dead": make_run(Status.QUEUED, agent="tests.ordered_blocking", scope="s2",
                                fired_seq=2),
        "unordered_second": make_run(Status.QUEUED, agent="tests.noop", scope="s1",
                                     fired_seq=3),
        "other_queue": make_run(Status.QUEUED, queue="other"),
    }
    names = {run.pk: name for name, run in runs.items()}
    assert {names[pk] for pk in listed(admin_client.get(changelist(query)))} == expected


def test_agent_and_queue_filters_offer_registered_names_without_a_query(
        admin_client: Client) -> None:
    response = admin_client.get(changelist())
    choices = {spec.title: [c["display"] for c in spec.choices(response.context["cl"])]
               for spec in response.context["cl"].filter_specs}
    assert "tests.heartbeats" in choices["agent"]
    assert "default" in choices["queue"]


def test_search_by_id_scope_and_agent(admin_client: Client) -> None:
    a = make_run(scope="ticket-alpha", agent="tests.noop")
    b = make_run(scope="order-beta", agent="tests.steps")
    assert listed(admin_client.get(changelist(f"?q={b.pk}"))) == [b.pk]
    assert listed(admin_client.get(changelist(f"?q=%23{a.pk}"))) == [a.pk]
    assert listed(admin_client.get(changelist("?q=ticket"))) == [a.pk]
    assert listed(admin_client.get(changelist("?q=steps"))) == [b.pk]
    assert listed(admin_client.get(changelist("?q=99999999999999999999999"))) == []


def test_list_queries_do_not_grow_with_the_page(viewer: Client,
                                                django_assert_max_num_queries: Any) -> None:
    for i in range(120):
        run = make_run([Status.QUEUED, Status.FAILED, Status.RUNNING][i % 3],
                       agent="tests.ordered" if i % 2 else "tests.noop", scope=f"s{i % 7}",
                       fired_seq=i)
        add_events(run, 2)
    # session, user, permissions (2), count, page, date hierarchy, the queue filter's
    # queues, the live workers (for stuck badges): and nothing per row.
    for query in ("", "?attention=dead_letter", "?attention=stuck", "?attention=blocked",
                  "?status=failed&agent=tests.noop", "?q=s3", "?o=3"):
        with django_assert_max_num_queries(11):
            response = viewer.get(changelist(query))
        assert response.status_code == 200


def test_filtered_list_runs_no_count_of_the_whole_table(admin_client: Client) -> None:
    make_run(Status.FAILED)
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(changelist("?status=failed"))
    assert response.status_code == 200
    counts = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
    assert counts
    assert all("WHERE" in sql.upper() for sql in counts), counts


def test_list_loads_no_heavy_columns(admin_client: Client) -> None:
    make_run(Status.FAILED, input={"big": "x" * 1000})
    with CaptureQueriesContext(connection) as queries:
        admin_client.get(changelist())
    page = [q["sql"] for q in queries.captured_queries
            if '"django_agentruns_agentrun"."agent"' in q["sql"]]
    assert page
    assert not any('"error_traceback"' in sql for sql in page)
    # The input is read only for django.tasks runs, and only its task's path.
    loads_input = [sql for sql in page if re.sub(
        r"WHEN .{0,120}?'django\.tasks'.{0,400}?\bEND\b", "", sql, flags=re.S).count('"input"')]
    assert loads_input == []


# --------------------------------------------------------------------------- run page


def test_run_page_shows_everything_read_only(admin_client: Client) -> None:
    run = make_run(Status.FAILED, input={"ticket": 42, "text": "<script>"},
                   output=None, checkpoint_count=2)
    RunCheckpoint.objects.create(run=run, number=2, state={"step": 2})
    add_events(run, 3)
    response = admin_client.get(run_url(run))
    html = response.content.decode()
    assert response.status_code == 200
    assert "&quot;ticket&quot;: 42" in html
    assert "&lt;script&gt;" in html
    assert "<script>\"" not in html
    assert "&quot;step&quot;: 2" in html
    assert "PermissionError" in html
    assert "Traceback (most recent call last):" in html
    assert "Event timeline: 3 events" in html
    assert "<code>{&quot;n&quot;: 3}</code>" in html  # payloads as compact JSON
    assert 'name="_save"' not in html
    assert "<textarea" not in html


def test_run_page_shows_the_lease_owner_and_time_left(admin_client: Client) -> None:
    alive = make_run(Status.RUNNING, claimed_by="host-a:12:ff")
    stuck = make_run(Status.RUNNING, claimed_by="host-b:13:ee",
                     lease_expires=timezone.now() - timedelta(seconds=30))
    assert "held by host-a:12:ff;" in (html := admin_client.get(run_url(alive)).content.decode())
    assert " left" in html
    html = admin_client.get(run_url(stuck)).content.decode()
    assert "held by host-b:13:ee; lapsed 3" in html
    assert "stuck" in html


def test_event_timeline_is_paginated(admin_client: Client,
                                     django_assert_max_num_queries: Any) -> None:
    run = make_run(Status.SUCCEEDED)
    add_events(run, 250)
    # Session, user, the run, the event count and page, children, checkpoints, steps, the
    # stored live output and the live workers: none grows with the 250 events.
    with django_assert_max_num_queries(10):
        first = admin_client.get(run_url(run))
    # Newest first: the events that explain how it ended are on the first page.
    assert [e.seq for e, _ in first.context["event_rows"]] == list(range(250, 150, -1))
    last = admin_client.get(run_url(run) + "?events_page=3")
    assert [e.seq for e, _ in last.context["event_rows"]] == list(range(50, 0, -1))
    assert "Events 201\u2013250 of 250" in last.content.decode()
    oldest = admin_client.get(run_url(run) + "?events_order=oldest&events_page=3")
    assert [e.seq for e, _ in oldest.context["event_rows"]] == list(range(201, 251))
    for bogus in ("abc", "-1", "999", "1e9"):
        assert admin_client.get(run_url(run) + f"?events_page={bogus}").status_code == 200


@pytest.fixture
def visibility_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("django_agentruns.admin.options.why_not_started",
                        lambda run: f"run #{run.pk} waits behind run #1")


def test_queued_run_page_says_why_it_has_not_started(admin_client: Client,
                                                     visibility_module: Any) -> None:
    queued = make_run(Status.QUEUED)
    html = admin_client.get(run_url(queued)).content.decode()
    assert "Why it has not started" in html
    assert f"run #{queued.pk} waits behind run #1" in html
    done = make_run(Status.SUCCEEDED)
    assert "Why it has not started" not in admin_client.get(run_url(done)).content.decode()


def test_a_blocked_run_page_links_the_run_holding_its_scope(admin_client: Client) -> None:
    head = make_run(Status.FAILED, agent="tests.ordered_blocking", scope="s", fired_seq=1)
    behind = make_run(Status.QUEUED, agent="tests.ordered_blocking", scope="s", fired_seq=2)
    html = admin_client.get(run_url(behind)).content.decode()
    assert f"blocked by run #{head.pk}" in html
    assert f'(<a href="{run_url(head)}">#{head.pk}</a>)' in html
    free = make_run(Status.QUEUED, agent="tests.noop")
    assert "nothing holds it back" in admin_client.get(run_url(free)).content.decode()


def test_nobody_adds_edits_or_deletes_runs_or_events(admin_client: Client) -> None:
    run = make_run(Status.FAILED)
    before = AgentRun.objects.values().get(pk=run.pk)
    assert admin_client.post(run_url(run), {"status": "queued", "scope": "x"}).status_code == 403
    assert admin_client.get(reverse("admin:django_agentruns_agentrun_add")).status_code == 403
    assert admin_client.post(run_url(run, "delete"), {"post": "yes"}).status_code == 403
    choices = admin_client.get(changelist()).context["action_form"].fields["action"].choices
    assert "delete_selected" not in [name for name, _ in choices]
    assert AgentRun.objects.values().get(pk=run.pk) == before
    with pytest.raises(NoReverseMatch):
        reverse("admin:django_agentruns_runevent_changelist")


# --------------------------------------------------------------------------- permissions


def test_staff_without_the_permissions_see_runs_but_no_actions(viewer: Client) -> None:
    failed, running = make_run(Status.FAILED), make_run(Status.RUNNING)
    response = viewer.get(changelist())
    assert listed(response) == [running.pk, failed.pk]
    assert response.context["action_form"] is None  # no actions, no checkboxes
    for run in (failed, running):
        html = viewer.get(run_url(run)).content.decode()
        assert 'id="agentruns-retry"' not in html
        assert 'id="agentruns-cancel"' not in html
    assert "Retry all" not in viewer.get(reverse(OVERVIEW)).content.decode()


def test_operator_sees_the_actions_and_the_buttons_that_apply(operator: Client) -> None:
    failed, running = make_run(Status.FAILED), make_run(Status.RUNNING)
    response = operator.get(changelist())
    names = [name for name, _ in response.context["action_form"].fields["action"].choices]
    assert names[1:] == ["retry_runs", "cancel_runs"]
    html = operator.get(run_url(failed)).content.decode()
    assert 'id="agentruns-retry"' in html
    assert 'id="agentruns-cancel"' not in html
    html = operator.get(run_url(running)).content.decode()
    assert 'id="agentruns-cancel"' in html
    assert 'id="agentruns-retry"' not in html
    assert "Retry 1…" in operator.get(reverse(OVERVIEW)).content.decode()


def test_forged_posts_without_the_permissions_are_forbidden(viewer: Client) -> None:
    failed, running = make_run(Status.FAILED), make_run(Status.RUNNING)
    posts = [
        (run_url(failed, "retry"), {}),
        (run_url(running, "cancel"), {}),
        (changelist(), {"action": "retry_runs", "_selected_action": [failed.pk],
                        "post": "yes"}),
        (changelist(), {"action": "cancel_runs", "_selected_action": [running.pk],
                        "index": "0"}),
        (reverse(RETRY_CLASS), {"error_type": "PermissionError", "confirm": "yes",
                                "up_to": str(failed.pk)}),
    ]
    for url, data in posts:
        assert viewer.post(url, data).status_code == 403, url
    assert (status_of(failed), status_of(running)) == (Status.FAILED, Status.RUNNING)
    assert AgentRun.objects.get(pk=running.pk).cancel_requested_at is None


def test_anonymous_users_are_sent_to_log_in() -> None:
    failed = make_run(Status.FAILED)
    response = Client().post(run_url(failed, "retry"))
    assert response.status_code == 302
    assert "/login/" in response["Location"]
    assert status_of(failed) == Status.FAILED


# --------------------------------------------------------------------------- bulk actions


def test_bulk_retry_confirms_then_requeues_the_eligible_and_reports_the_rest(
        operator: Client) -> None:
    failed = make_run(Status.FAILED, requeue_count=3)
    cancelled = make_run(Status.CANCELLED)
    succeeded, queued = make_run(Status.SUCCEEDED), make_run(Status.QUEUED)
    selection = [failed.pk, cancelled.pk, succeeded.pk, queued.pk]
    confirm = operator.post(changelist(), {"action": "retry_runs", "index": "0",
                                           "_selected_action": selection})
    assert confirm.status_code == 200
    html = confirm.content.decode()
    assert "Retry <strong>2</strong> failed or cancelled runs?" in html
    assert "2 runs not failed or cancelled" in html
    assert status_of(failed) == Status.FAILED  # nothing happens before the confirmation

    done = operator.post(changelist(), {"action": "retry_runs", "post": "yes",
                                        "_selected_action": selection})
    assert done.status_code == 302
    assert messages_of(operator, done) == [
        "Retry: 2 runs queued again with a fresh retry budget; "
        "2 skipped (not failed or cancelled)."]
    for run in (failed, cancelled):
        run.refresh_from_db()
        assert (run.status, run.reason, run.requeue_count) == (Status.QUEUED, "", 0)
        event = RunEvent.objects.filter(run=run).latest("seq")
        assert (event.type, event.payload["by"]) == ("run.retried", "operator")
    assert (status_of(succeeded), status_of(queued)) == (Status.SUCCEEDED, Status.QUEUED)


def test_bulk_cancel_cancels_queued_and_asks_running_runs_to_stop(operator: Client) -> None:
    queued, running = make_run(Status.QUEUED), make_run(Status.RUNNING)
    asked = make_run(Status.RUNNING, cancel_requested_at=timezone.now())
    finished = make_run(Status.SUCCEEDED)
    selection = [queued.pk, running.pk, asked.pk, finished.pk]
    confirm = operator.post(changelist(), {"action": "cancel_runs", "index": "0",
                                           "_selected_action": selection})
    assert "Cancel <strong>3</strong> queued, running or waiting runs?" in confirm.content.decode()
    done = operator.post(changelist(), {"action": "cancel_runs", "post": "yes",
                                        "_selected_action": selection})
    assert messages_of(operator, done) == [
        "Cancel: 1 queued run cancelled; 1 running run asked to stop (cancelled once its "
        "worker notices); 1 skipped (already asked to stop); 1 skipped (already finished)."]
    assert status_of(queued) == Status.CANCELLED
    running.refresh_from_db()
    assert running.status == Status.RUNNING
    assert running.cancel_requested_at is not None
    assert "operator" in running.cancel_reason
    assert status_of(finished) == Status.SUCCEEDED


def test_select_across_retries_every_run_the_filter_matches(operator: Client) -> None:
    dead = [make_run(Status.FAILED) for _ in range(3)]
    other = make_run(Status.FAILED, reason=Reason.ERROR)  # failed, but no dead letter
    url = changelist("?attention=dead_letter")
    data = {"action": "retry_runs", "select_across": "1", "_selected_action": [dead[0].pk]}
    confirm = operator.post(url, {**data, "index": "0"})
    assert "Retry <strong>3</strong>" in confirm.content.decode()
    operator.post(url, {**data, "post": "yes"})
    assert [status_of(run) for run in dead] == [Status.QUEUED] * 3
    assert status_of(other) == Status.FAILED


# --------------------------------------------------------------------------- run-page buttons


def test_run_page_retry_button_requeues_a_failed_run(operator: Client) -> None:
    failed = make_run(Status.FAILED)
    response = operator.post(run_url(failed, "retry"), {"post": "yes"})
    assert response.status_code == 302
    assert response["Location"] == run_url(failed)
    assert status_of(failed) == Status.QUEUED
    assert messages_of(operator, response) == [
        f"Run #{failed.pk} is queued again, with a fresh retry budget."]


def test_run_page_cancel_button_cancels_a_queued_run(operator: Client) -> None:
    queued = make_run(Status.QUEUED)
    response = operator.post(run_url(queued, "cancel"), {"post": "yes"})
    assert response.status_code == 302
    assert status_of(queued) == Status.CANCELLED
    event = RunEvent.objects.get(run=queued)
    assert event.type == "run.cancelled"
    assert "operator" in event.payload["reason"]


def test_run_page_buttons_ask_first(operator: Client) -> None:
    failed, queued = make_run(Status.FAILED), make_run(Status.QUEUED)
    for url in (run_url(failed, "retry"), run_url(queued, "cancel")):
        for response in (operator.get(url), operator.post(url)):
            assert response.status_code == 200
            assert 'id="agentruns-confirm"' in response.content.decode()
    assert "Retry <strong>1</strong> failed or cancelled run?" in operator.get(
        run_url(failed, "retry")).content.decode()
    assert operator.put(run_url(failed, "retry")).status_code == 405
    assert (status_of(failed), status_of(queued)) == (Status.FAILED, Status.QUEUED)


# --------------------------------------------------------------------------- bad requests


def test_a_stale_button_gets_a_message_and_no_transition(operator: Client) -> None:
    succeeded = make_run(Status.SUCCEEDED)
    cancelled = make_run(Status.CANCELLED)
    response = operator.post(run_url(succeeded, "retry"), {"post": "yes"})
    assert response.status_code == 302
    assert messages_of(operator, response) == [
        f"Run #{succeeded.pk} was not retried: it is not failed or cancelled."]
    response = operator.post(run_url(cancelled, "cancel"), {"post": "yes"})
    assert messages_of(operator, response) == [
        f"Run #{cancelled.pk} was not cancelled: it has already finished."]
    assert (status_of(succeeded), status_of(cancelled)) == (Status.SUCCEEDED, Status.CANCELLED)


def test_unknown_run_ids_get_a_message_not_an_error(operator: Client) -> None:
    response = operator.post(run_url(987654, "retry"), {"post": "yes"})
    assert response.status_code == 302
    assert response["Location"] == changelist()
    assert messages_of(operator, response) == ["Run #987654 does not exist: nothing was changed."]
    assert operator.post("/admin/django_agentruns/agentrun/abc/retry/").status_code in (302, 404)
    failed = make_run(Status.FAILED)
    done = operator.post(changelist(), {"action": "retry_runs", "post": "yes",
                                        "_selected_action": [failed.pk, 987654, 987655]})
    assert messages_of(operator, done) == [
        "Retry: 1 run queued again with a fresh retry budget; 2 skipped (no such run)."]


def test_malformed_selection_changes_nothing(operator: Client) -> None:
    failed = make_run(Status.FAILED)
    for bogus in (["abc"], [str(failed.pk), "1; DROP TABLE"], ["\uff19"], ["1" * 30]):
        response = operator.post(changelist(), {"action": "retry_runs", "post": "yes",
                                                "_selected_action": bogus})
        assert response.status_code == 302
        assert messages_of(operator, response) == [
            "Malformed selection (run ids are integers): nothing was changed."]
    assert status_of(failed) == Status.FAILED


def test_list_filters_no_database_can_hold_are_dropped(operator: Client) -> None:
    for query in ("?error_type=%00", "?scope=a%00b", "?agent=%00", "?q=x&%00=1"):
        response = operator.get(changelist(query))
        assert response.status_code == 302
        assert response["Location"] == changelist()
        assert messages_of(operator, response) == [
            "Malformed filter (it contained a NUL character): showing all runs."]
    response = operator.post(reverse(RETRY_CLASS), {"error_type": "a\x00"})
    assert messages_of(operator, response) == ["No valid failure class given: nothing was retried."]


def test_huge_run_ids_are_unknown_runs(operator: Client) -> None:
    response = operator.post(run_url(10**20, "retry"), {"post": "yes"})
    assert response.status_code == 302
    assert messages_of(operator, response) == [
        f"Run #{10**20} does not exist: nothing was changed."]
    assert operator.get(run_url(10**20)).status_code == 302  # the admin's "no such object"


def test_unknown_action_is_forbidden(operator: Client) -> None:
    failed = make_run(Status.FAILED)
    response = operator.post(changelist(), {"action": "delete_selected", "post": "yes",
                                            "_selected_action": [failed.pk]})
    assert response.status_code == 403
    assert AgentRun.objects.filter(pk=failed.pk).exists()


def test_runs_that_changed_state_after_confirmation_are_skipped(operator: Client) -> None:
    failed = make_run(Status.FAILED)
    running = make_run(Status.RUNNING)
    confirm = operator.post(changelist(), {"action": "retry_runs", "index": "0",
                                           "_selected_action": [failed.pk]})
    assert "Retry <strong>1</strong>" in confirm.content.decode()
    assert api.retry(failed.pk, by="someone-else")  # meanwhile, another operator retried it
    done = operator.post(changelist(), {"action": "retry_runs", "post": "yes",
                                        "_selected_action": [failed.pk]})
    assert messages_of(operator, done) == ["Retry: 1 skipped (not failed or cancelled)."]
    assert RunEvent.objects.filter(run=failed, type="run.retried").count() == 1

    operator.post(changelist(), {"action": "cancel_runs", "index": "0",
                                 "_selected_action": [running.pk]})
    AgentRun.objects.filter(pk=running.pk).update(status=Status.SUCCEEDED)  # it finished
    done = operator.post(changelist(), {"action": "cancel_runs", "post": "yes",
                                        "_selected_action": [running.pk]})
    assert messages_of(operator, done) == ["Cancel: 1 skipped (already finished)."]
    assert AgentRun.objects.get(pk=running.pk).cancel_requested_at is None


def test_posts_without_a_csrf_token_are_forbidden() -> None:
    user = staff("csrf", "view_agentrun", "retry_agentrun", "cancel_agentrun")
    client = login(user, enforce_csrf_checks=True)
    failed, queued = make_run(Status.FAILED), make_run(Status.QUEUED)
    posts = [
        (run_url(failed, "retry"), {}),
        (run_url(queued, "cancel"), {}),
        (changelist(), {"action": "retry_runs", "post": "yes", "_selected_action": [failed.pk]}),
        (reverse(RETRY_CLASS), {"error_type": "PermissionError", "confirm": "yes",
                                "up_to": str(failed.pk)}),
    ]
    for url, data in posts:
        assert client.post(url, data).status_code == 403, url
    assert (status_of(failed), status_of(queued)) == (Status.FAILED, Status.QUEUED)


# --------------------------------------------------------------------------- overview


def test_overview_counts_runs_and_groups_dead_letters_by_class(viewer: Client) -> None:
    for _ in range(2):
        make_run(Status.FAILED, error_type="TimeoutError")
    make_run(Status.FAILED, error_type="PermissionError", reason=Reason.RETRIES_EXHAUSTED)
    make_run(Status.FAILED, error_type="ValueError", reason=Reason.ERROR)  # not a dead letter
    make_run(Status.QUEUED)
    response = viewer.get(reverse(OVERVIEW))
    assert response.status_code == 200
    counts = {value: n for value, _, n in response.context["statuses"]}
    assert counts == {"queued": 1, "running": 0, "waiting": 0, "succeeded": 0, "failed": 4,
                      "cancelled": 0}
    groups = [(g.agent, g.error_type, g.reason, g.count) for g in response.context["groups"]]
    assert groups == [("tests.noop", "TimeoutError", "not_retryable", 2),
                      ("tests.noop", "PermissionError", "retries_exhausted", 1)]


def test_overview_links_list_the_dead_letters_of_a_class(viewer: Client) -> None:
    timeout = make_run(Status.FAILED, error_type="TimeoutError")
    make_run(Status.FAILED, error_type="PermissionError")
    make_run(Status.SUCCEEDED, error_type="TimeoutError")  # an old error of a later success
    html = viewer.get(reverse(OVERVIEW)).content.decode()
    link = ("?attention=dead_letter&amp;agent=tests.noop&amp;error_type=TimeoutError"
            "&amp;reason=not_retryable")
    assert link in html
    assert listed(viewer.get(changelist(link.replace("&amp;", "&")))) == [timeout.pk]


def test_retry_a_failure_class_after_confirmation(operator: Client) -> None:
    timeouts = [make_run(Status.FAILED, error_type="TimeoutError") for _ in range(2)]
    auth = make_run(Status.FAILED, error_type="PermissionError")
    confirm = operator.post(reverse(RETRY_CLASS), {"error_type": "TimeoutError"})
    assert confirm.status_code == 200
    assert "Retry all <strong>2</strong> dead letters of class" in confirm.content.decode()
    assert [status_of(r) for r in timeouts] == [Status.FAILED] * 2
    late = make_run(Status.FAILED, error_type="TimeoutError")  # arrives after the page
    done = operator.post(reverse(RETRY_CLASS), {"error_type": "TimeoutError", "confirm": "yes",
                                                "up_to": confirm.context["up_to"]})
    assert done.status_code == 302
    assert messages_of(operator, done) == [
        "Dead letters of class TimeoutError: Retry: 2 runs queued again with a fresh retry budget."]
    assert [status_of(r) for r in timeouts] == [Status.QUEUED] * 2
    assert (status_of(auth), status_of(late)) == (Status.FAILED, Status.FAILED)


def test_malformed_retry_class_posts_get_a_message(operator: Client) -> None:
    failed = make_run(Status.FAILED, error_type="TimeoutError")
    url = reverse(RETRY_CLASS)
    assert operator.get(url).status_code == 405
    for data, message in [
        ({}, "No valid failure class given: nothing was retried."),
        ({"error_type": "TimeoutError", "confirm": "yes", "up_to": "x"},
         "Malformed confirmation: nothing was retried."),
        ({"error_type": "TimeoutError", "confirm": "yes"},
         "Malformed confirmation: nothing was retried."),
        ({"error_type": "NoSuchError", "confirm": "yes", "up_to": str(failed.pk)},
         "Dead letters of class NoSuchError: Retry: no runs selected; nothing was changed."),
    ]:
        response = operator.post(url, data)
        assert response.status_code == 302
        assert messages_of(operator, response) == [message]
    assert status_of(failed) == Status.FAILED
    empty = operator.post(url, {"error_type": "NoSuchError"})
    assert "nothing to retry" in empty.content.decode()
