"""Who may watch a run's event stream (and its live output): the decision of the view.

A stream is allowed when any of these says yes, in this order:
1. the user holds the global `view_agentrun` (staff: every run);
2. `user.has_perm("django_agentruns.view_agentrun", run)` (an object-permission backend
   such as django-guardian grants this one run);
3. the `STREAM_ACCESS` setting's callable `(request, run) -> bool` (the app's own rule,
   e.g. "the run's input names this user");
4. a valid signed link (`stream_url`).
Anyone else gets 403 with a short reason, the same for a run that does not exist, so the
answer does not tell which run ids exist. Only those who may see every run (1) or hold a
link made for that id (4) are told 404 for a missing run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.utils.module_loading import import_string

from ..conf import app_settings
from ..models import AgentRun
from .signing import Signed, check

VIEW_PERMISSION = "django_agentruns.view_agentrun"

NOT_ALLOWED = "You may not watch this run's events."
EXPIRED = "This stream link has expired: ask for a new one."
INVALID = "This stream link is not valid for this run."


def stream_access_rule() -> Callable[[HttpRequest, AgentRun], bool] | None:
    """The STREAM_ACCESS callable, or None when the setting is not set."""
    path = app_settings.STREAM_ACCESS
    return import_string(path) if path else None


def refusal(request: HttpRequest, run_id: int) -> HttpResponse | None:
    """None if the request may watch run `run_id`; else the answer to send (403 or 404)."""
    user: Any = request.user
    if user.has_perm(VIEW_PERMISSION):
        return None if _exists(run_id) else _not_found(run_id)
    signed = check(request.GET, run_id)
    if signed is Signed.VALID:
        return None if _exists(run_id) else _not_found(run_id)
    run = AgentRun.objects.filter(pk=run_id).first()
    if run is not None:
        if user.has_perm(VIEW_PERMISSION, run):
            return None
        rule = stream_access_rule()
        if rule is not None and rule(request, run):
            return None
    reason = {Signed.EXPIRED: EXPIRED, Signed.INVALID: INVALID}.get(signed) or \
        f"{NOT_ALLOWED} {_who(user)}"
    return HttpResponse(reason + "\n", status=403, content_type="text/plain")


def _who(user: Any) -> str:
    """Why a plain request was refused, in words: an EventSource only sees "error", so
    the body is for the person who opens the URL to find out."""
    if not user.is_authenticated:
        return (f"You are not logged in: log in (with {VIEW_PERMISSION}), or use a signed "
                "link (stream_url).")
    return f"User {user.get_username()!r} lacks {VIEW_PERMISSION} for it."


def _exists(run_id: int) -> bool:
    return AgentRun.objects.filter(pk=run_id).exists()


def _not_found(run_id: int) -> HttpResponse:
    return HttpResponse(f"No run with id {run_id}.\n", status=404, content_type="text/plain")
