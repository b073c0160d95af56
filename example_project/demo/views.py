"""The live page: start a demo run, then watch its events arrive as the worker appends them.

The page is plain HTML and JavaScript (no build step): a POST with the CSRF token starts a
run, and an EventSource on `django_agentruns.urls`' event stream shows its steps. A worker
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

DEMO_RUNS: dict[str, dict[str, Any]] = {
    "demo.research": {"topic": "durable execution"},
    "demo.flaky_tool": {"city": "Lisbon"},
    "demo.async_summarise": {
        "text": "Workers claim runs with a lease. A dead worker's lease lapses, and the run "
                "is reclaimed. Retries are bounded, so a poisoned run ends as a dead letter.",
    },
}
"""The runs the page offers: agent name and the input it is started with."""


@require_http_methods(["GET", "POST"])
@login_required(login_url="admin:login")
@permission_required("django_agentruns.view_agentrun", raise_exception=True)
def live(request: HttpRequest, runs: dict[str, dict[str, Any]] | None = None) -> HttpResponse:
    """GET: the page. POST `agent=<name>`: start a run of it; answers its id and stream URL."""
    runs = DEMO_RUNS if runs is None else runs
    if request.method == "POST":
        agent = request.POST.get("agent", "")
        if agent not in runs:
            return JsonResponse({"error": f"choose one of {sorted(runs)}"}, status=400)
        run = enqueue(agent, input=runs[agent])
        return JsonResponse({
            "run": run.pk,
            "events": reverse("agentruns:run-events", args=[run.pk]),
            "admin": reverse("admin:django_agentruns_agentrun_change", args=[run.pk]),
        }, status=201)
    return TemplateResponse(request, "demo/live.html", {"agents": list(runs)})
