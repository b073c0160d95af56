"""The live page (the chat): start a demo run, then watch its events and streamed text arrive
as the worker appends them. Its first agent, where Pydantic AI is installed, is the chat's
`demo.assistant` (assistant.py): a question box, the answer streamed live, and a link to
the admin when the agent's refund tool waits for approval.

The page is plain HTML and JavaScript (no build step): a POST with the CSRF token starts a
run, and an EventSource on `django_agentruns.urls`' event stream shows its steps and the
text the agent streams (`ctx.stream`), live. `?run=<id>` watches a run already started
(the page puts it in its address, so a reload shows the same run again). A worker
must be running (`python manage.py runworker`) for the run to start.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required, permission_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.views.decorators.http import require_http_methods

from django_agentruns import enqueue
from django_agentruns.models import AgentRun
from django_agentruns.registry import find_agent

DEMO_RUNS: dict[str, dict[str, Any]] = {
    "demo.chat_reply": {"question": "How does a run survive a crash?"},
    "demo.research": {"topic": "durable execution"},
    "demo.flaky_tool": {"city": "Lisbon"},
    "demo.async_summarise": {
        "text": "Workers claim runs with a lease. A dead worker's lease lapses, and the run "
                "is reclaimed. Retries are bounded, so a poisoned run ends as a dead letter.",
    },
}
"""The runs the page offers: agent name and the input it is started with."""

ASSISTANT = "demo.assistant"
ASSISTANT_INPUT = {
    "question": "My order 1042 arrived two weeks late. Can I have a refund of 20 EUR?"}
"""The chat's agent, a Pydantic AI agent (assistant.py), first on the page where installed."""


def offered_runs() -> dict[str, dict[str, Any]]:
    """The page's runs: the Pydantic AI assistant first (when its extra is installed)."""
    if find_agent(ASSISTANT) is None:
        return DEMO_RUNS
    return {ASSISTANT: ASSISTANT_INPUT, **DEMO_RUNS}


@require_http_methods(["GET", "POST"])
@login_required(login_url="admin:login")
@permission_required("django_agentruns.view_agentrun", raise_exception=True)
def live(request: HttpRequest, runs: dict[str, dict[str, Any]] | None = None) -> HttpResponse:
    """GET: the page. POST `agent=<name>`: start a run of it; answers its id and stream URL."""
    runs = offered_runs() if runs is None else runs
    if request.method == "POST":
        agent = request.POST.get("agent", "")
        if agent not in runs:
            return JsonResponse({"error": f"choose one of {sorted(runs)}"}, status=400)
        given = {**runs[agent]}
        question = request.POST.get("question", "").strip()
        if question and "question" in given:
            given["question"] = question[:2000]  # the chat's question, as the user typed it
        run = enqueue(agent, input=given)
        return JsonResponse(_watch(run.pk), status=201)
    watch = None
    run_id = request.GET.get("run", "")
    if run_id.isdigit() and AgentRun.objects.filter(pk=int(run_id)).exists():
        watch = _watch(int(run_id))
    questions = {name: given["question"] for name, given in runs.items() if "question" in given}
    return TemplateResponse(request, "demo/live.html", {"agents": list(runs), "watch": watch,
                                                        "questions": questions})


def _watch(run_id: int) -> dict[str, Any]:
    """What the page needs to watch a run."""
    return {
        "run": run_id,
        "events": reverse("agentruns:run-events", args=[run_id]),
        "admin": reverse("admin:django_agentruns_agentrun_change", args=[run_id]),
    }
