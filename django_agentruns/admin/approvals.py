"""Waiting runs in the console: the "waiting" filter, the run page's approval form, and
its parent and children.

Approve / Reject is a POST (CSRF-checked by the admin site's wrapper) that needs
view_agentrun and approve_agentrun; it answers through `waiting.approve` / `reject`, which
record the user in the run's timeline. Nothing here writes a run itself.
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.views.decorators.http import require_POST

from ..exceptions import InvalidInputError
from ..models import AgentRun, RunWait, Status
from ..wait_results import DeliverResult
from .actions import username

PERMISSION = f"{AgentRun._meta.app_label}.approve_agentrun"
CHILDREN_SHOWN = 50


class WaitingFilter(admin.SimpleListFilter):
    """Waiting runs by what they wait for: an approval, input, or child runs."""

    title = "waiting for"
    parameter_name = "waiting"
    kinds = {RunWait.Kind.APPROVAL: "Waiting for approval", RunWait.Kind.INPUT: "Input",
             RunWait.Kind.RUNS: "Child runs"}

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(str(kind), label) for kind, label in self.kinds.items()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
        kind = self.value()
        if kind not in self.kinds:
            return queryset
        # The awaited key's wait row is the one of this kind (a run waits for one key).
        awaited = RunWait.objects.filter(kind=kind).values("run_id")
        return queryset.filter(status=Status.WAITING, pk__in=awaited)


def can_approve(model_admin: Any, request: HttpRequest) -> bool:
    return bool(model_admin.has_view_permission(request) and request.user.has_perm(PERMISSION))


def pending_approval(run: AgentRun) -> RunWait | None:
    """The approval the run waits for now, if any."""
    if run.status != Status.WAITING or not run.wait_key:
        return None
    return RunWait.objects.filter(run=run, key=run.wait_key, kind=RunWait.Kind.APPROVAL,
                                  delivered_at__isnull=True).first()


def page_context(model_admin: Any, request: HttpRequest, run: AgentRun) -> dict[str, Any]:
    """What the run page shows of waiting: the wait, the approval form, parent, children."""
    wait = None
    if run.status == Status.WAITING and run.wait_key:
        wait = RunWait.objects.filter(run=run, key=run.wait_key).first()
    approval = pending_approval(run)
    proposal = (approval.prompt or {}).get("proposal") if approval is not None else None
    children = list(AgentRun.objects.filter(parent=run).order_by("id")
                    .only("id", "agent", "status", "spawn_key")[:CHILDREN_SHOWN])
    return {
        "run_wait": wait,
        "approval": approval,
        "proposal_json": json.dumps(proposal, indent=2),
        "can_approve": approval is not None and can_approve(model_admin, request),
        "parent_run": run.parent,
        "child_runs": children,
        "more_children": AgentRun.objects.filter(parent=run).count() > CHILDREN_SHOWN
        if len(children) == CHILDREN_SHOWN else False,
    }


def answer(model_admin: Any) -> Any:
    """The run page's Approve / Reject form: one answer, through the API, back to the run."""
    from .. import waiting

    @require_POST
    def view(request: HttpRequest, run_id: int) -> HttpResponse:
        if not can_approve(model_admin, request):
            raise PermissionDenied
        back = HttpResponseRedirect(reverse(
            f"{model_admin.admin_site.name}:django_agentruns_agentrun_change", args=[run_id]))
        key, decision = request.POST.get("key", ""), request.POST.get("decision")
        note = request.POST.get("note", "")
        try:
            if decision == "approve":
                edited = _edited(request.POST.get("proposal", ""), run_id, key)
                result = waiting.approve(run_id, key, by=username(request), note=note,
                                         proposal=edited)
            elif decision == "reject":
                result = waiting.reject(run_id, key, by=username(request), note=note)
            else:
                raise InvalidInputError("decision must be approve or reject")
        except InvalidInputError as exc:
            model_admin.message_user(request, f"Nothing was recorded: {exc}", messages.ERROR)
            return back
        text = {DeliverResult.DELIVERED: "recorded; the run is queued again",
                DeliverResult.STORED: "recorded",
                DeliverResult.ALREADY_DELIVERED: "not recorded: it was already answered",
                DeliverResult.FINISHED: "not recorded: the run is finished",
                DeliverResult.NOT_FOUND: "not recorded: no such run"}[result]
        ok = result in (DeliverResult.DELIVERED, DeliverResult.STORED)
        model_admin.message_user(request, f"Run #{run_id}: {decision} of {key!r} {text}.",
                                 messages.SUCCESS if ok else messages.WARNING)
        return back

    return view


def _edited(text: str, run_id: int, key: str) -> Any:
    """The proposal as the approver left it: None when unchanged (the agent keeps its own)."""
    if not text.strip():
        return None
    try:
        edited = json.loads(text)
    except ValueError as exc:
        raise InvalidInputError(f"the edited proposal is not JSON: {exc}") from None
    original = RunWait.objects.filter(run_id=run_id, key=key).values_list(
        "prompt", flat=True).first() or {}
    return None if edited == original.get("proposal") else edited
