"""An operation's permission alone shows no run data: every console page needs view too.

A user with only `retry_agentrun` (or only `cancel_agentrun`) can see no run list or run
page, so no page, confirmation or message of an operation may show them runs either.
"""

from __future__ import annotations

import pytest
from django.urls import reverse

from django_agentruns.models import AgentRun, Status
from tests.test_admin import (
    OVERVIEW,
    RETRY_CLASS,
    changelist,
    login,
    make_run,
    run_url,
    staff,
    status_of,
)

pytestmark = pytest.mark.django_db

SCOPE = "tenant-7/secret-scope"
MESSAGE = "token sk-leaked-in-error-message rejected"


def secret_run(status: str = Status.FAILED) -> AgentRun:
    return make_run(status, scope=SCOPE, error_message=MESSAGE)


def shows_no_run_data(content: bytes, *runs: AgentRun) -> bool:
    html = content.decode()
    return SCOPE not in html and MESSAGE not in html and not any(
        run_url(run) in html for run in runs)


@pytest.mark.parametrize("codename", ["retry_agentrun", "cancel_agentrun"])
def test_an_operation_permission_alone_is_forbidden_everywhere(codename: str) -> None:
    client = login(staff("operation-only", codename))
    failed, queued = secret_run(), secret_run(Status.QUEUED)
    requests = [
        ("post", reverse(RETRY_CLASS), {"error_type": "PermissionError"}),
        ("post", reverse(RETRY_CLASS), {"error_type": "PermissionError", "confirm": "yes",
                                        "up_to": str(failed.pk)}),
        ("post", run_url(failed, "retry"), {}),
        ("post", run_url(queued, "cancel"), {}),
        ("get", run_url(failed, "retry"), {}),
        ("post", run_url(failed, "retry"), {"post": "yes"}),
        ("post", run_url(queued, "cancel"), {"post": "yes"}),
        ("post", changelist(), {"action": "retry_runs", "_selected_action": [failed.pk]}),
        ("post", changelist(), {"action": "cancel_runs", "_selected_action": [queued.pk]}),
        ("post", changelist(), {"action": "retry_runs", "_selected_action": [failed.pk],
                                "post": "yes"}),
        ("get", reverse(OVERVIEW), {}),
        ("get", changelist(), {}),
        ("get", run_url(failed), {}),
    ]
    for method, url, data in requests:
        response = getattr(client, method)(url, data)
        assert response.status_code == 403, (method, url, data)
        assert shows_no_run_data(response.content, failed, queued), (method, url, data)
    assert (status_of(failed), status_of(queued)) == (Status.FAILED, Status.QUEUED)
    assert AgentRun.objects.get(pk=queued.pk).cancel_requested_at is None


def test_view_and_retry_still_confirm_and_retry_a_class() -> None:
    client = login(staff("retrier", "view_agentrun", "retry_agentrun"))
    failed = secret_run()
    confirm = client.post(reverse(RETRY_CLASS), {"error_type": "PermissionError"})
    assert confirm.status_code == 200
    assert SCOPE in (html := confirm.content.decode())
    assert MESSAGE in html
    done = client.post(reverse(RETRY_CLASS), {"error_type": "PermissionError", "confirm": "yes",
                                              "up_to": confirm.context["up_to"]})
    assert done.status_code == 302
    assert status_of(failed) == Status.QUEUED


def test_view_and_one_operation_get_that_operation_only() -> None:
    client = login(staff("retrier", "view_agentrun", "retry_agentrun"))
    failed, queued = secret_run(), secret_run(Status.QUEUED)
    assert 'id="agentruns-retry"' in client.get(run_url(failed)).content.decode()
    assert client.post(run_url(queued, "cancel")).status_code == 403
    assert client.get(run_url(queued, "cancel")).status_code == 403
    assert client.post(run_url(failed, "retry"), {"post": "yes"}).status_code == 302
    assert (status_of(failed), status_of(queued)) == (Status.QUEUED, Status.QUEUED)


def test_the_retry_class_confirmation_needs_a_csrf_token() -> None:
    user = staff("csrf-retrier", "view_agentrun", "retry_agentrun")
    failed = secret_run()
    response = login(user, enforce_csrf_checks=True).post(
        reverse(RETRY_CLASS), {"error_type": "PermissionError"})
    assert response.status_code == 403
    assert shows_no_run_data(response.content, failed)
