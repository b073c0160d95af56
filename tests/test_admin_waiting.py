"""Waiting runs in the admin: the wait in the run page's top box, forms that are not nested
in the admin's change form, the input form (deliver_agentrun), the overview's runs awaiting
approval, and the run list saying what each waiting run waits for."""

from __future__ import annotations

import re
from typing import Any

import pytest

from django_agentruns import enqueue
from django_agentruns.models import AgentRun, RunEvent, RunWait, Status
from tests.test_admin import changelist, login, messages_of, run_url, staff
from tests.test_approvals import burst, proposing

pytestmark = pytest.mark.django_db(transaction=True)

OVERVIEW = "/admin/django_agentruns/agentrun/overview/"


def change_form_of(page: str) -> str:
    """The admin's own change form, from its start tag to its end tag."""
    start = page.index('id="agentrun_form"')
    return page[start:page.index("</form>", start)]


def waiting_for_input(key: str = "answer", **extra: Any) -> AgentRun:
    run = enqueue("tests.waits", {"key": key, **extra})
    burst()
    assert AgentRun.objects.get(pk=run.pk).status == Status.WAITING
    return run


def test_no_form_is_nested_in_the_change_form() -> None:
    run = enqueue("tests.steps", {"steps": 3})
    from django_agentruns.runtime.worker import Worker

    Worker(queues=["default"], burst=True, reap_interval=0).run(install_signals=False)
    approval = proposing()
    waiting = waiting_for_input()
    client = login(staff("all", "view_agentrun", "approve_agentrun", "deliver_agentrun",
                         "retry_agentrun"))
    for pk, own in ((run.pk, "agentruns-fork"), (approval.pk, "agentruns-approval"),
                    (waiting.pk, "agentruns-deliver")):
        page = client.get(run_url(pk)).content.decode()
        assert f'id="{own}"' in page
        # A <form> inside another is dropped by the browser: its buttons would submit the
        # outer one. The buttons live in the change form and point at their own.
        assert "<form" not in change_form_of(page).removeprefix('id="agentrun_form"')
        assert f'form="{own}"' in change_form_of(page)


def test_the_top_box_says_what_an_approval_waits_for_and_offers_the_answer() -> None:
    run = proposing(42)
    wait = RunWait.objects.get(run=run)
    client = login(staff("approver", "view_agentrun", "approve_agentrun"))
    page = client.get(run_url(run)).content.decode()
    top = page[page.index('id="agentruns-summary"'):page.index("</fieldset>")] \
        if "</fieldset>" in page else page
    box = top[top.index('id="agentruns-wait"'):]
    assert "Waiting for approval of" in box
    assert ">refund</code>" in box
    assert wait.waited_at is not None
    assert wait.waited_at.strftime("%Y-%m-%d") in box
    assert "no deadline" in box
    assert "&quot;refund&quot;: 42" in box  # the proposal, editable
    assert 'id="agentruns-approve"' in box
    assert 'id="agentruns-reject"' in box
    assert 'id="agentruns-note"' in box


def test_the_top_box_shows_an_input_prompt_and_deadline() -> None:
    run = waiting_for_input(prompt={"question": "ship it?"}, timeout=3600)
    page = login(staff("viewer", "view_agentrun")).get(run_url(run)).content.decode()
    box = page[page.index('id="agentruns-wait"'):]
    assert "Waiting for input" in box
    assert ">answer</code>" in box
    assert "times out at" in box
    assert "&quot;question&quot;: &quot;ship it?&quot;" in box
    assert "agentruns-deliver-button" not in box  # no deliver_agentrun
    assert "deliver(" in box


def test_deliver_in_the_admin_needs_its_permission() -> None:
    run = waiting_for_input()
    form = {"key": "answer", "payload": '{"ok": true}'}
    assert login(staff("viewer", "view_agentrun")).post(
        run_url(run, "deliver"), form).status_code == 403
    assert login(staff("blind", "deliver_agentrun")).post(
        run_url(run, "deliver"), form).status_code == 403
    assert login(staff("approver", "view_agentrun", "approve_agentrun")).post(
        run_url(run, "deliver"), form).status_code == 403
    assert login(staff("getter", "view_agentrun", "deliver_agentrun")).get(
        run_url(run, "deliver")).status_code == 405
    assert RunWait.objects.get(run=run).delivered_at is None


def test_deliver_in_the_admin_resumes_the_run_and_bad_json_writes_nothing() -> None:
    run = waiting_for_input()
    client = login(staff("deliverer", "view_agentrun", "deliver_agentrun"))
    assert 'id="agentruns-deliver-button"' in client.get(run_url(run)).content.decode()
    events = RunEvent.objects.filter(run=run).count()
    bad = client.post(run_url(run, "deliver"), {"key": "answer", "payload": "{ok: yes"})
    assert bad.status_code == 302
    (text,) = messages_of(client, bad)
    assert text.startswith("Nothing was delivered: the payload is not JSON")
    assert RunWait.objects.get(run=run).delivered_at is None
    assert RunEvent.objects.filter(run=run).count() == events
    good = client.post(run_url(run, "deliver"), {"key": "answer", "payload": '{"ok": true}'})
    assert messages_of(client, good) == [f"Run #{run.pk}: input for 'answer' delivered; "
                                         "the run is queued again."]
    assert AgentRun.objects.get(pk=run.pk).status == Status.QUEUED
    assert RunEvent.objects.get(run=run, type="run.delivered").payload == {
        "key": "answer", "by": "deliverer"}
    burst()
    assert AgentRun.objects.get(pk=run.pk).output == {"got": {"ok": True}}


def test_the_admin_refuses_an_answer_to_a_key_never_proposed() -> None:
    run = proposing()
    client = login(staff("approver", "view_agentrun", "approve_agentrun"))
    response = client.post(run_url(run, "approval"), {"key": "refnd", "decision": "approve"})
    (text,) = messages_of(client, response)
    assert "has not asked for approval of 'refnd'" in text
    assert "'refund'" in text
    assert RunWait.objects.get(run=run).delivered_at is None
    assert AgentRun.objects.get(pk=run.pk).status == Status.WAITING


def test_the_overview_lists_runs_awaiting_approval_oldest_first() -> None:
    first, second = proposing(10), proposing(20)
    waiting_for_input()
    page = login(staff("viewer", "view_agentrun")).get(OVERVIEW).content.decode()
    section = page[page.index('id="agentruns-awaiting"'):]
    section = section[:section.index("</div>")]
    assert "Awaiting approval: 2" in section
    rows = re.findall(r'data-run="(\d+)"', section)
    assert rows == [str(first.pk), str(second.pk)]
    assert run_url(first) in section
    assert "&quot;refund&quot;: 10" in section  # the proposal's summary
    # The section comes first: before the chart and the dead letters.
    assert page.index('id="agentruns-awaiting"') < page.index("Dead letters by agent")


def test_the_overview_says_when_nobody_is_awaited() -> None:
    page = login(staff("viewer", "view_agentrun")).get(OVERVIEW).content.decode()
    assert "Awaiting approval: 0" in page


def test_the_run_list_says_what_each_run_waits_for(
        django_assert_max_num_queries: Any) -> None:
    approval = proposing()
    waiting = waiting_for_input()
    parent = enqueue("tests.parent", {"children": [{"n": i, "receive": True}
                                                    for i in range(3)]})
    burst()
    client = login(staff("viewer", "view_agentrun"))
    html = client.get(changelist("?status=waiting")).content.decode()
    rows = {pk: html[html.index(f'href="{run_url(pk)}'):] for pk in
            (approval.pk, waiting.pk, parent.pk)}
    assert rows[approval.pk].split("</tr>")[0].count(
        "waiting for approval of <code>refund</code>") == 1
    assert "waiting for input <code>answer</code>" in rows[waiting.pk].split("</tr>")[0]
    assert "waiting for 3 child runs" in rows[parent.pk].split("</tr>")[0]
    for _ in range(20):
        proposing()
    # session, user, permissions (2), count, page, date hierarchy, the queue filter's
    # queues, the live workers (for stuck badges): nothing per waiting row.
    with django_assert_max_num_queries(11):
        assert client.get(changelist("?status=waiting")).status_code == 200
