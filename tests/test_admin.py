"""The operations console: run list, run page, overview (permissions, retry/cancel actions
and bad requests: tests/test_admin_actions.py).

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
    # Session, user, the run, its input and output (payload rows), the event count and
    # page, children, checkpoints, steps, the stored live output and the live workers:
    # none grows with the 250 events.
    with django_assert_max_num_queries(11):
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
