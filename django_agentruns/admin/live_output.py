"""The run page's output panel: what the agent streamed (`ctx.stream`).

A queued or running run's panel follows the run's event stream (the app's SSE endpoint,
if the project includes `django_agentruns.urls`): its stored `stream` events, then the
live chunks they do not cover yet, as they are written. Live chunks are not kept (on
PostgreSQL they travel by NOTIFY): the panel shows those written since it opened, and the
whole text once the run stores it (at each step boundary, and at its end). A finished
run's panel shows the stored `stream` events, read here: the newest OUTPUT_EVENTS of
them, at most OUTPUT_CHARS characters.
"""

from __future__ import annotations

from typing import Any

from django.urls import NoReverseMatch, reverse

from ..models import AgentRun, RunEvent, Status

STREAM = "stream"
OUTPUT_EVENTS = 500
OUTPUT_CHARS = 20_000
FOLLOWED = (Status.QUEUED, Status.RUNNING)


def events_url(run: AgentRun) -> str | None:
    """The run's SSE URL; None when the project did not include the app's URLs."""
    try:
        return reverse("agentruns:run-events", args=[run.pk])
    except NoReverseMatch:
        return None


def stored_output(run: AgentRun) -> tuple[str, bool]:
    """The stored streamed text, oldest first, and whether older text was left out."""
    rows = list(RunEvent.objects.filter(run=run, type=STREAM).order_by("-seq")
                .values_list("payload", flat=True)[:OUTPUT_EVENTS + 1])
    cut = len(rows) > OUTPUT_EVENTS
    text = "".join(str((p or {}).get("text", "")) for p in reversed(rows[:OUTPUT_EVENTS]))
    if len(text) > OUTPUT_CHARS:
        text, cut = text[-OUTPUT_CHARS:], True
    return text, cut


def page_context(run: AgentRun) -> dict[str, Any]:
    url = events_url(run)
    if run.status in FOLLOWED and url is not None:
        return {"live_output": {"follow": url, "text": "", "cut": False}}
    text, cut = stored_output(run)
    if not text:
        return {"live_output": None}
    return {"live_output": {"follow": None, "text": text, "cut": cut}}
