"""What a waiting run waits for, and how to answer it: the words of `manage.py why`.

Shared wording with the admin's run page (which shows the same wait with its forms): the
kind, the key, since when, the deadline, the prompt, and the call that answers it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from django.urls import NoReverseMatch, reverse
from django.utils import timezone

from ..models import TERMINAL, AgentRun, RunWait, Status

PROMPT_CHARS = 300
CHILDREN_NAMED = 10


@dataclass(frozen=True)
class WaitReport:
    headline: str
    lines: list[str]


def _when(value: object) -> str:
    from datetime import datetime

    if not isinstance(value, datetime):
        return "-"
    return timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S %Z")


def _json(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= PROMPT_CHARS else text[:PROMPT_CHARS - 1] + "…"


def admin_path(run_id: int) -> str | None:
    """The run page's path on the default admin site, if the admin is mounted."""
    try:
        return reverse("admin:django_agentruns_agentrun_change", args=[run_id])
    except NoReverseMatch:
        return None


def explain_wait(run: AgentRun) -> WaitReport | None:
    """The wait of a waiting run, and how to end it; None for a run that does not wait."""
    if run.status != Status.WAITING:
        return None
    wait = RunWait.objects.filter(run=run, key=run.wait_key).first()
    kind = wait.kind if wait is not None else RunWait.Kind.INPUT
    since = _when(wait.waited_at) if wait is not None else "-"
    deadline = (f"times out at {_when(run.wait_until)}" if run.wait_until is not None
                else "no deadline")
    page = admin_path(run.pk)
    in_admin = [f"or on its admin page: {page}"] if page else []
    name = f"run #{run.pk} ({run.agent})"
    if kind == RunWait.Kind.RUNS:
        left = list(AgentRun.objects.filter(parent=run).exclude(status__in=TERMINAL)
                    .order_by("pk").values_list("pk", flat=True)[:CHILDREN_NAMED + 1])
        named = ", ".join(f"#{pk}" for pk in left[:CHILDREN_NAMED])
        more = ", …" if len(left) > CHILDREN_NAMED else ""
        return WaitReport(f"{name} is waiting for its child runs since {since}; {deadline}",
                          [f"unfinished: {named}{more}" if left else "unfinished: none "
                           "(the reaper resumes it: manage.py reap)",
                           "it resumes by itself when the last one finishes "
                           "(ask about one with manage.py why <id>)"])
    prompt = wait.prompt if wait is not None else None
    key = run.wait_key
    if kind == RunWait.Kind.APPROVAL:
        proposal = (prompt or {}).get("proposal") if isinstance(prompt, dict) else prompt
        return WaitReport(
            f"{name} is waiting for approval of {key!r} since {since}; {deadline}",
            [f"proposal: {_json(proposal)}",
             f"answer it: django_agentruns.approve({run.pk}, {key!r}, by=\"you\", note=\"\") "
             f"(proposal=... to approve an edited one) or "
             f"django_agentruns.reject({run.pk}, {key!r}, by=\"you\", note=\"why\")",
             *in_admin])
    return WaitReport(
        f"{name} is waiting for input {key!r} since {since}; {deadline}",
        [f"prompt: {_json(prompt)}" if prompt is not None else "prompt: none given",
         f"answer it: django_agentruns.deliver({run.pk}, {key!r}, payload) (any JSON value)",
         *in_admin])
