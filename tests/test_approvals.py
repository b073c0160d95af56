"""Approvals: `ctx.request_approval`, `approve` / `reject`, and the console's form.

The form needs view_agentrun and approve_agentrun and a CSRF token; each answer is recorded
in the run's timeline with the user.
"""

from __future__ import annotations

import json

import pytest
from django.test import Client

from django_agentruns import DeliverResult, InvalidInputError, approve, enqueue, reject
from django_agentruns.models import AgentRun, RunEvent, RunWait, Status
from django_agentruns.runtime.worker import Worker
from tests.test_admin import changelist, login, run_url, staff
from tests.test_waiting import until_status, worker

pytestmark = pytest.mark.django_db(transaction=True)


def burst() -> None:
    Worker(queues=["waiting"], burst=True, reap_interval=0).run(install_signals=False)


def proposing(amount: int = 10) -> AgentRun:
    """A refund agent's run, waiting for its approval."""
    run = enqueue("tests.approves", {"amount": amount})
    burst()
    assert AgentRun.objects.get(pk=run.pk).status == Status.WAITING
    return run


def test_approve_with_an_edited_proposal_and_reject() -> None:
    approved, rejected = proposing(10), proposing(99)
    assert approve(approved.pk, "refund", by="ops", note="ok, less",
                   proposal={"refund": 5, "order": 1}) is DeliverResult.DELIVERED
    assert reject(rejected.pk, "refund", by="ops", note="too much") is DeliverResult.DELIVERED
    assert reject(rejected.pk, "refund", by="other") is DeliverResult.ALREADY_DELIVERED
    burst()
    assert AgentRun.objects.get(pk=approved.pk).output == {
        "approved": True, "by": "ops", "note": "ok, less", "proposal": {"refund": 5, "order": 1}}
    assert AgentRun.objects.get(pk=rejected.pk).output == {
        "approved": False, "by": "ops", "note": "too much",
        "proposal": {"refund": 99, "order": 1}}
    with pytest.raises(InvalidInputError):
        approve(approved.pk, "refund", by="")


def test_the_waiting_for_approval_filter_lists_runs_awaiting_an_answer() -> None:
    run = proposing()
    other = enqueue("tests.waits")
    burst()
    client = login(staff("viewer", "view_agentrun"))
    html = client.get(changelist("?waiting=approval")).content.decode()
    assert run_url(run) in html
    assert "waiting for &#x27;refund&#x27;" in html
    assert run_url(other) not in html
    assert run_url(other) in client.get(changelist("?waiting=input")).content.decode()


def test_approving_in_the_console_needs_the_permission() -> None:
    run = proposing()
    viewer = login(staff("viewer", "view_agentrun"))
    page = viewer.get(run_url(run)).content.decode()
    assert "&quot;refund&quot;: 10" in page
    assert "agentruns-approve" not in page
    answer = {"key": "refund", "decision": "approve", "note": "", "proposal": ""}
    assert viewer.post(run_url(run, "approval"), answer).status_code == 403
    only_approve = login(staff("approver-blind", "approve_agentrun"))
    assert only_approve.post(run_url(run, "approval"), answer).status_code == 403
    assert AgentRun.objects.get(pk=run.pk).status == Status.WAITING
    assert RunWait.objects.get(run=run).delivered_at is None


def test_approving_in_the_console_needs_a_csrf_token() -> None:
    run = proposing()
    client = login(staff("approver", "view_agentrun", "approve_agentrun"),
                   enforce_csrf_checks=True)
    response = client.post(run_url(run, "approval"), {"key": "refund", "decision": "approve"})
    assert response.status_code == 403
    assert RunWait.objects.get(run=run).delivered_at is None


def test_approve_and_reject_in_the_console_resume_the_run(worker_env: dict[str, str]) -> None:
    approved, rejected = proposing(10), proposing(20)
    client: Client = login(staff("approver", "view_agentrun", "approve_agentrun"))
    page = client.get(run_url(approved)).content.decode()
    assert "agentruns-approve" in page
    assert "agentruns-reject" in page
    edited = json.dumps({"refund": 7, "order": 1})
    response = client.post(run_url(approved, "approval"), {
        "key": "refund", "decision": "approve", "note": "fine", "proposal": edited})
    assert response.status_code == 302
    client.post(run_url(rejected, "approval"), {"key": "refund", "decision": "reject",
                                                "note": "no"})
    bad = client.post(run_url(rejected, "approval"), {"key": "refund", "decision": "maybe"})
    assert bad.status_code == 302
    with worker(worker_env) as w:
        until_status(approved.pk, Status.SUCCEEDED)
        until_status(rejected.pk, Status.SUCCEEDED)
        assert w.stop() == 0, w.output()
    assert AgentRun.objects.get(pk=approved.pk).output == {
        "approved": True, "by": "approver", "note": "fine", "proposal": {"refund": 7, "order": 1}}
    assert AgentRun.objects.get(pk=rejected.pk).output["approved"] is False
    delivered = RunEvent.objects.get(run=approved, type="run.delivered")
    assert delivered.payload == {"key": "refund", "by": "approver"}


def test_the_run_page_shows_parent_and_children() -> None:
    parent = enqueue("tests.parent", {"children": [{"n": 0}, {"n": 1}]})
    Worker(queues=["waiting"], burst=True, reap_interval=0).run(install_signals=False)
    assert AgentRun.objects.get(pk=parent.pk).status == Status.SUCCEEDED
    kids = list(AgentRun.objects.filter(parent=parent))
    client = login(staff("viewer", "view_agentrun"))
    page = client.get(run_url(parent)).content.decode()
    assert all(run_url(kid) in page for kid in kids)
    assert run_url(parent) in client.get(run_url(kids[0])).content.decode()
