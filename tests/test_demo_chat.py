"""The example project's chat page runs a real Pydantic AI agent (`demo.assistant`) against the
demo's canned model server: a question typed on the page starts it, its answer streams, its
refund tool waits for approval on the run's admin page, and once approved the tool runs once
and the run finishes with the provider's usage recorded."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client

pytest.importorskip("pydantic_ai")

from django_agentruns import approve
from django_agentruns.models import AgentRun, RunEvent, RunStep, RunWait, Status
from django_agentruns.registry import find_agent, unregister
from django_agentruns.runtime.worker import Worker
from tests.test_admin_browser import make_user
from tests.test_stream import demo_templates  # noqa: F401 (fixture)

CHAT_PAGE = "/demo/chat/"  # tests/urls.py: the live page with the example's own agents
ASSISTANT = "demo.assistant"


@pytest.fixture
def assistant(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """demo.assistant registered (the example app is not installed in the tests), talking to
    the canned model server whatever this machine's environment says."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    module = sys.modules.get("example_project.demo.assistant")
    if module is None:
        importlib.import_module("example_project.demo.assistant")
    else:
        importlib.reload(module)  # registers it again, after an earlier test's teardown
    yield
    unregister(ASSISTANT)


def burst() -> None:
    Worker(["default"], burst=True, reap_interval=0).run(install_signals=False)


def streamed(run_id: int) -> str:
    return "".join(p["text"] for p in RunEvent.objects.filter(
        run_id=run_id, type="stream").order_by("seq").values_list("payload", flat=True))


def test_a_question_on_the_chat_page_runs_the_pydantic_ai_agent_to_an_approved_tool_call(
        transactional_db: None, demo_templates: None, assistant: None) -> None:  # noqa: F811
    client = Client()
    client.force_login(make_user("chatter", "view_agentrun", "approve_agentrun"))
    page = client.get(CHAT_PAGE)
    assert page.status_code == 200
    html = page.content.decode()
    # The assistant is the page's first choice, with a question box and an example question.
    assert html.index("<option") == html.index(f'<option value="{ASSISTANT}">')
    assert "Can I have a refund of 20 EUR?" in html
    assert 'id="question"' in html

    started = client.post(CHAT_PAGE, {"agent": ASSISTANT,
                                      "question": "Order 1077 broke. A refund of 35, please."})
    assert started.status_code == 201
    run = AgentRun.objects.get(pk=started.json()["run"])
    assert run.input == {"question": "Order 1077 broke. A refund of 35, please."}

    burst()
    run.refresh_from_db()
    assert run.status == Status.WAITING, run.error_message
    wait = RunWait.objects.get(run=run, key=run.wait_key)
    assert wait.kind == RunWait.Kind.APPROVAL
    assert wait.prompt == {"proposal": {"tool": "refund", "args": {"order": 1077, "amount": 35}}}
    assert streamed(run.pk) == "I will ask for a refund of 35 EUR on order 1077."
    assert not RunStep.objects.filter(run=run, name__contains=".tool.refund.").exists()
    # The approval shows on the run's admin page, with its buttons.
    admin_page = client.get(started.json()["admin"]).content.decode()
    assert "Waiting for approval of" in admin_page
    assert 'id="agentruns-approve"' in admin_page
    assert "1077" in admin_page

    approve(run.pk, run.wait_key, by="chatter")
    burst()
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED, run.error_message
    assert run.output == {"question": "Order 1077 broke. A refund of 35, please.",
                          "answer": "All set: refunded 35 EUR on order 1077. Anything else?",
                          "model": "demo-model"}
    tool_steps = RunStep.objects.filter(run=run, name__contains=".tool.refund.")
    assert list(tool_steps.values_list("status", flat=True)) == ["done"]  # ran once
    assert streamed(run.pk).endswith("All set: refunded 35 EUR on order 1077. Anything else?")
    # Two model calls, each with the usage the canned server reported (words as tokens).
    assert run.input_tokens > 0
    assert run.output_tokens == 12 + 10  # the two answers' words


def test_without_the_assistant_the_page_offers_the_other_demo_agents(
        db: None, demo_templates: None) -> None:  # noqa: F811
    assert find_agent(ASSISTANT) is None
    client = Client()
    client.force_login(make_user("chatter", "view_agentrun"))
    html = client.get(CHAT_PAGE).content.decode()
    assert f'<option value="{ASSISTANT}">' not in html
    assert '<option value="demo.chat_reply">' in html


def test_the_canned_model_answers_by_rule() -> None:
    from example_project.demo import model_server

    tools = [{"type": "function", "function": {"name": "refund"}}]
    ask: dict[str, Any] = {"messages": [{"role": "user", "content": "refund 30 on 2001?"}],
                           "tools": tools}
    text, calls = model_server.answer(ask)
    assert text == "I will ask for a refund of 30 EUR on order 2001."
    assert calls[0]["function"] == {"name": "refund",
                                    "arguments": '{"order": 2001, "amount": 30}'}
    refused = {"messages": [*ask["messages"], {"role": "tool", "content": "rejected: no"}]}
    assert model_server.answer(refused) == ("I could not do that. rejected: no", [])
    assert model_server.answer({"messages": [{"role": "user", "content": "hi"}]}) == (
        model_server.GENERAL_ANSWER, [])
