"""The operations console's actions: who may act, bulk retry and cancel, the run page's buttons, and
what bad requests get (stale buttons, unknown or malformed ids, forged posts). The run list,
run page and overview are in tests/test_admin.py, whose helpers these share.
"""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_agentruns import api
from django_agentruns.models import (
    AgentRun,
    Reason,
    RunEvent,
    Status,
)
from tests.test_admin import (
    OVERVIEW,
    RETRY_CLASS,
    changelist,
    listed,
    login,
    make_run,
    messages_of,
    run_url,
    staff,
    status_of,
)

pytestmark = pytest.mark.django_db


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
