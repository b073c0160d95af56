"""`run_waiting`: sent once a run's wait has committed, for every kind of wait, from sync
and async agents, with what a receiver needs to tell a person (run, kind, key, prompt)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from django_agentruns import deliver, enqueue
from django_agentruns.models import AgentRun, RunWait, Status
from django_agentruns.signals import run_waiting
from tests.test_approvals import burst

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def heard() -> Iterator[list[dict[str, Any]]]:
    got: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        # After the commit: the wait is there for anyone who looks, e.g. a mail's link.
        kwargs["committed_status"] = AgentRun.objects.get(pk=kwargs["run_id"]).status
        kwargs["in_transaction"] = connection.in_atomic_block
        kwargs["sender"] = sender
        got.append(kwargs)

    run_waiting.connect(receiver)
    yield got
    run_waiting.disconnect(receiver)


def test_an_approval_wait_is_announced_after_commit_with_its_proposal(
        heard: list[dict[str, Any]]) -> None:
    run = enqueue("tests.approves", {"amount": 12})
    burst()
    (signal,) = heard
    assert signal["sender"] is AgentRun
    assert signal["run"].pk == run.pk
    assert signal["run"].status == Status.WAITING
    assert signal["committed_status"] == Status.WAITING
    assert signal["in_transaction"] is False
    assert (signal["kind"], signal["key"]) == ("approval", "refund")
    assert signal["prompt"] == {"proposal": {"refund": 12, "order": 1}}
    assert (signal["agent"], signal["attempt"]) == ("tests.approves", 1)


def test_input_waits_of_sync_and_async_agents_are_announced(
        heard: list[dict[str, Any]]) -> None:
    sync = enqueue("tests.waits", {"key": "answer", "prompt": {"question": "ok?"}})
    asynchronous = enqueue("tests.async_waits")
    burst()
    by_run = {s["run"].pk: s for s in heard}
    assert set(by_run) == {sync.pk, asynchronous.pk}
    assert (by_run[sync.pk]["kind"], by_run[sync.pk]["key"]) == ("input", "answer")
    assert by_run[sync.pk]["prompt"] == {"question": "ok?"}
    assert (by_run[asynchronous.pk]["kind"], by_run[asynchronous.pk]["key"]) == ("input", "go")


def test_a_wait_for_child_runs_is_announced(heard: list[dict[str, Any]]) -> None:
    parent = enqueue("tests.parent", {"children": [{"n": 0, "receive": True}]})
    burst()
    (signal,) = [s for s in heard if s["run"].pk == parent.pk]
    assert signal["kind"] == "runs"
    child = AgentRun.objects.get(parent=parent)
    assert signal["prompt"] == {"runs": [child.pk]}


def test_a_wait_answered_in_advance_is_not_announced(heard: list[dict[str, Any]]) -> None:
    run = enqueue("tests.waits", {"key": "hook"})
    deliver(run.pk, "hook", 1)
    burst()
    assert AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED
    assert heard == []


def test_a_raising_receiver_does_not_undo_the_wait(heard: list[dict[str, Any]]) -> None:
    def broken(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("mail server down")

    run_waiting.connect(broken)
    try:
        run = enqueue("tests.approves")
        burst()
    finally:
        run_waiting.disconnect(broken)
    assert AgentRun.objects.get(pk=run.pk).status == Status.WAITING
    assert RunWait.objects.get(run=run).kind == "approval"
    assert len(heard) == 1


def test_the_documented_mail_to_the_approvers_is_sent() -> None:
    """The receiver in docs/waits-and-approvals.md, run as written (the test runner's mail
    backend keeps the mail in `mail.outbox`)."""
    import re

    from django.core import mail

    from tests.helpers import REPO_ROOT
    from tests.test_admin import staff

    doc = (REPO_ROOT / "docs/waits-and-approvals.md").read_text()
    (code,) = [block for block in re.findall(r"```python(?: skip)?\n(.*?)```", doc, re.S)
               if "mail_the_approvers" in block]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/waits-and-approvals.md", "exec"), namespace)
    try:
        approver = staff("alice", "view_agentrun", "approve_agentrun")
        approver.email = "alice@example.com"
        approver.save()
        bystander = staff("bob", "view_agentrun")
        bystander.email = "bob@example.com"
        bystander.save()
        run = enqueue("tests.approves", {"amount": 70})
        enqueue("tests.waits")  # an input wait: no mail
        burst()
    finally:
        run_waiting.disconnect(namespace["mail_the_approvers"])
    (message,) = mail.outbox
    assert message.to == ["alice@example.com"]
    assert message.subject == f"Approval needed: tests.approves #{run.pk} (refund)"
    assert f"/admin/django_agentruns/agentrun/{run.pk}/change/" in message.body
    assert "'refund': 70" in message.body
