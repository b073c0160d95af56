"""Waiting runs in the console: the "waiting" filter, the run page's approval and input
forms, the overview's runs awaiting approval, and a run's parent and children.

Approve / Reject is a POST (CSRF-checked by the admin site's wrapper) that needs
view_agentrun and approve_agentrun; it answers through `waiting.approve` / `reject`, which
record the user in the run's timeline. Deliver (an input wait's JSON) needs
deliver_agentrun and calls `waiting.deliver`. Nothing here writes a run itself.

The forms sit outside the admin's own change form (their controls point at them with
`form=`): a form nested in another is dropped by the browser's parser, and its buttons
would submit the outer one.
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Case, Count, F, OuterRef, Q, QuerySet, Subquery, Value, When
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext_lazy as _
from django.views.decorators.http import require_POST

from ..exceptions import InvalidInputError
from ..models import TERMINAL, AgentRun, RunWait, Status
from ..outcomes import RESERVED_PREFIX, DeliverResult
from ..queries import reading
from .actions import username

PERMISSION = f"{AgentRun._meta.app_label}.approve_agentrun"
DELIVER_PERMISSION = f"{AgentRun._meta.app_label}.deliver_agentrun"
CHILDREN_SHOWN = 50
AWAITING_SHOWN = 20
PROPOSAL_SUMMARY = 120


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


def wait_columns() -> dict[str, Any]:
    """Annotations for the run list: what each waiting run waits for (its wait's kind) and,
    for child runs, how many are left. Subqueries on indexed columns, evaluated for waiting
    rows only: a page of 100 runs costs one query, not one per row."""
    waiting = Q(status=Status.WAITING)
    kind = RunWait.objects.filter(run=OuterRef("pk"), key=OuterRef("wait_key")).values("kind")
    left = (AgentRun.objects.filter(parent=OuterRef("pk")).exclude(status__in=TERMINAL)
            .order_by().values("parent").annotate(n=Count("pk")).values("n"))
    return {
        "wait_kind": Case(When(waiting, then=Subquery(kind[:1])), default=Value("")),
        "children_left": Case(When(waiting & Q(wait_key__startswith=RESERVED_PREFIX),
                                   then=Subquery(left)), default=Value(0)),
    }


def waiting_label(run: AgentRun) -> SafeString:
    """"waiting for approval of `refund`", "waiting for input `go`", "waiting for 3 child
    runs": from `wait_columns`' annotations ("" for a run that does not wait)."""
    if run.status != Status.WAITING:
        return mark_safe("")
    kind = getattr(run, "wait_kind", None) or ""
    if kind == RunWait.Kind.APPROVAL:
        return format_html('waiting for approval of <code>{}</code>', run.wait_key)
    if kind == RunWait.Kind.RUNS or run.wait_key.startswith(RESERVED_PREFIX):
        n = getattr(run, "children_left", None) or 0
        return format_html("waiting for {} child run{}", n, "" if n == 1 else "s")
    return format_html('waiting for input <code>{}</code>', run.wait_key)


def can_approve(model_admin: Any, request: HttpRequest) -> bool:
    return bool(model_admin.has_view_permission(request) and request.user.has_perm(PERMISSION))


def can_deliver(model_admin: Any, request: HttpRequest) -> bool:
    return bool(model_admin.has_view_permission(request)
                and request.user.has_perm(DELIVER_PERMISSION))


def page_context(model_admin: Any, request: HttpRequest, run: AgentRun) -> dict[str, Any]:
    """What the run page shows of waiting: the wait, the approval form, parent, children."""
    wait = None
    if run.status == Status.WAITING and run.wait_key:
        wait = RunWait.objects.filter(run=run, key=run.wait_key).first()
    approval = wait if wait is not None and wait.kind == RunWait.Kind.APPROVAL \
        and wait.delivered_at is None else None
    proposal = (approval.prompt or {}).get("proposal") if approval is not None else None
    input_wait = wait if wait is not None and wait.kind == RunWait.Kind.INPUT \
        and wait.delivered_at is None else None
    children = list(AgentRun.objects.filter(parent=run).order_by("id")
                    .only("id", "agent", "status", "spawn_key")[:CHILDREN_SHOWN])
    return {
        "run_wait": wait,
        "wait_prompt_json": json.dumps(wait.prompt, indent=2, ensure_ascii=False)
        if wait is not None and wait.prompt is not None and approval is None else "",
        "approval": approval,
        "proposal_json": json.dumps(proposal, indent=2, ensure_ascii=False),
        "can_approve": approval is not None and can_approve(model_admin, request),
        "input_wait": input_wait,
        "can_deliver": input_wait is not None and can_deliver(model_admin, request),
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
            model_admin.message_user(request, _("Nothing was recorded: %(error)s")
                                     % {"error": exc}, messages.ERROR)
            return back
        text = {DeliverResult.DELIVERED: _("recorded; the run is queued again"),
                DeliverResult.STORED: _("recorded"),
                DeliverResult.ALREADY_DELIVERED: _("not recorded: it was already answered"),
                DeliverResult.FINISHED: _("not recorded: the run is finished"),
                DeliverResult.NOT_FOUND: _("not recorded: no such run")}[result]
        ok = result in (DeliverResult.DELIVERED, DeliverResult.STORED)
        model_admin.message_user(request, _("Run #%(id)s: %(decision)s of %(key)r %(text)s.")
                                 % {"id": run_id, "decision": decision, "key": key,
                                    "text": text},
                                 messages.SUCCESS if ok else messages.WARNING)
        return back

    return view


def deliver_input(model_admin: Any) -> Any:
    """The run page's Deliver form: a JSON payload for the key an input wait waits for."""
    from .. import waiting

    @require_POST
    def view(request: HttpRequest, run_id: int) -> HttpResponse:
        if not can_deliver(model_admin, request):
            raise PermissionDenied
        back = HttpResponseRedirect(reverse(
            f"{model_admin.admin_site.name}:django_agentruns_agentrun_change", args=[run_id]))
        key, text = request.POST.get("key", ""), request.POST.get("payload", "")
        try:
            try:
                payload = json.loads(text)
            except ValueError as exc:
                raise InvalidInputError(f"the payload is not JSON ({exc}); write a JSON "
                                        f"value, e.g. \"yes\" or {{\"ok\": true}}") from None
            result = waiting.deliver(run_id, key, payload, by=username(request))
        except InvalidInputError as exc:
            model_admin.message_user(request, _("Nothing was delivered: %(error)s")
                                     % {"error": exc}, messages.ERROR)
            return back
        answer = {DeliverResult.DELIVERED: _("delivered; the run is queued again"),
                  DeliverResult.STORED: _("stored; the run reads it when it asks for it"),
                  DeliverResult.ALREADY_DELIVERED: _("not delivered: it was already answered"),
                  DeliverResult.FINISHED: _("not delivered: the run is finished"),
                  DeliverResult.NOT_FOUND: _("not delivered: no such run")}[result]
        ok = result in (DeliverResult.DELIVERED, DeliverResult.STORED)
        model_admin.message_user(request, _("Run #%(id)s: input for %(key)r %(answer)s.")
                                 % {"id": run_id, "key": key, "answer": answer},
                                 messages.SUCCESS if ok else messages.WARNING)
        return back

    return view


def awaiting_approval(limit: int = AWAITING_SHOWN) -> tuple[list[dict[str, Any]], int]:
    """Runs waiting for an approval now, oldest wait first, each with its proposal's first
    words; and how many there are. One query for the rows, one for the count."""
    waits = reading(RunWait.objects.filter(
        kind=RunWait.Kind.APPROVAL, delivered_at__isnull=True, run__status=Status.WAITING,
        run__wait_key=F("key")))
    rows: list[dict[str, Any]] = [dict(row) for row in waits.order_by("waited_at", "id").values(
        "run_id", "key", "prompt", "waited_at", "deadline", "run__agent")[:limit]]
    for row in rows:
        proposal = (row.pop("prompt") or {}).get("proposal")
        text = json.dumps(proposal, ensure_ascii=False, separators=(", ", ": "))
        row["summary"] = text if len(text) <= PROPOSAL_SUMMARY \
            else text[:PROPOSAL_SUMMARY - 1] + "…"
    return rows, waits.count() if len(rows) == limit else len(rows)


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
