"""`manage.py why` on a waiting run: what it waits for, until when, what it asks, and how
to answer it (the call, and the admin page)."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command

from django_agentruns import enqueue
from tests.test_admin import run_url
from tests.test_approvals import burst, proposing

pytestmark = pytest.mark.django_db(transaction=True)


def why(run_id: int) -> str:
    out = StringIO()
    call_command("why", str(run_id), stdout=out)
    return out.getvalue()


def test_why_names_an_approval_its_proposal_and_how_to_answer() -> None:
    run = proposing(33)
    text = why(run.pk)
    assert f"run #{run.pk} (tests.approves) is waiting for approval of 'refund' since" in text
    assert "no deadline" in text
    assert '"refund": 33' in text
    assert f"approve({run.pk}, 'refund', by=" in text
    assert f"reject({run.pk}, 'refund', by=" in text
    assert run_url(run) in text


def test_why_names_an_input_wait_its_deadline_prompt_and_deliver() -> None:
    run = enqueue("tests.waits", {"key": "answer", "prompt": {"question": "ship?"},
                                  "timeout": 600})
    burst()
    text = why(run.pk)
    assert "is waiting for input 'answer'" in text
    assert "times out at" in text
    assert 'prompt: {"question": "ship?"}' in text
    assert f"deliver({run.pk}, 'answer', payload)" in text
    assert run_url(run) in text


def test_why_names_the_unfinished_children_of_a_parent() -> None:
    parent = enqueue("tests.parent", {"children": [{"n": 0, "receive": True}]})
    burst()
    from django_agentruns.models import AgentRun

    child = AgentRun.objects.get(parent=parent)
    text = why(parent.pk)
    assert "is waiting for its child runs" in text
    assert f"unfinished: #{child.pk}" in text
    assert "waiting for input 'go'" in why(child.pk)
