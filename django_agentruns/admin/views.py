"""The console's own pages: the run page's buttons, and the overview with its dead letters.

The buttons and the retry-a-class form are POST only, permission-checked and CSRF-checked
(the admin site wraps every view here); anything else gets 405 or 403. Every view needs
view_agentrun, an operation its own permission too: each page or message names runs.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Max, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from ..models import AgentRun, Status
from .actions import MISSING, RETRY, Operation, has_permission, username
from .limits import usage_totals

NO_CLASS = "(no error type)"


def _url(name: str, *args: Any) -> str:
    return reverse(f"admin:django_agentruns_agentrun_{name}", args=args)


def operate(model_admin: Any, op: Operation) -> Any:
    """The run page's Retry / Cancel button: one run, through the API, then back to it."""

    @require_POST
    def view(request: HttpRequest, run_id: int) -> HttpResponse:
        if not has_permission(model_admin, request, op):
            raise PermissionDenied
        outcome = op.apply_one(run_id, username(request))
        model_admin.message_user(request, *op.describe_one(run_id, outcome))
        if outcome == MISSING:
            return HttpResponseRedirect(_url("changelist"))
        return HttpResponseRedirect(_url("change", run_id))

    return view


def overview(model_admin: Any) -> Any:
    """Counts by status, and the dead letters grouped by failure class."""

    @require_GET
    def view(request: HttpRequest) -> HttpResponse:
        if not model_admin.has_view_permission(request):
            raise PermissionDenied
        counts = dict(AgentRun.objects.order_by().values_list("status")
                      .annotate(n=Count("id")).values_list("status", "n"))
        classes = [{**row, "label": row["error_type"] or NO_CLASS}
                   for row in AgentRun.objects.dead_letters().order_by().values("error_type")
                   .annotate(n=Count("id"), last=Max("finished_at")).order_by("-n")]
        context = {
            **model_admin.admin_site.each_context(request),
            "title": "Agent runs overview",
            "opts": AgentRun._meta,
            "statuses": [(s.value, s.label, counts.get(s.value, 0)) for s in Status],
            "total": sum(counts.values()),
            "classes": classes,
            "dead_letter_total": sum(row["n"] for row in classes),
            "can_retry": has_permission(model_admin, request, RETRY),
            **usage_totals(),
        }
        return TemplateResponse(request, "django_agentruns/admin/overview.html", context)

    return view


def retry_class(model_admin: Any) -> Any:
    """Retry every dead letter of one failure class: a confirmation page, then the retries.

    The confirmation names the newest run id it counted; the retry stops there, so dead
    letters that arrive while the operator reads the page are not retried unseen.
    """

    @require_POST
    def view(request: HttpRequest) -> HttpResponse:
        if not has_permission(model_admin, request, RETRY):
            raise PermissionDenied
        error_type = request.POST.get("error_type")
        if error_type is None or "\x00" in error_type:
            model_admin.message_user(request, "No valid failure class given: nothing was retried.",
                                     messages.ERROR)
            return HttpResponseRedirect(_url("overview"))
        runs = _class_runs(error_type)
        if request.POST.get("confirm") != "yes":
            return _confirm_class(model_admin, request, error_type, runs)
        up_to = request.POST.get("up_to", "")
        if not (up_to.isascii() and up_to.isdigit() and len(up_to) < 19):
            model_admin.message_user(request, "Malformed confirmation: nothing was retried.",
                                     messages.ERROR)
            return HttpResponseRedirect(_url("overview"))
        ids = runs.filter(pk__lte=int(up_to)).values_list("pk", flat=True).iterator()
        text, level = RETRY.describe(RETRY.apply(ids, username(request)))
        label = error_type or NO_CLASS
        model_admin.message_user(request, f"Dead letters of class {label}: {text}", level)
        return HttpResponseRedirect(_url("overview"))

    return view


def _class_runs(error_type: str) -> QuerySet[AgentRun]:
    return AgentRun.objects.dead_letters().order_by("pk").filter(error_type=error_type)


def _confirm_class(model_admin: Any, request: HttpRequest, error_type: str,
                   runs: QuerySet[AgentRun]) -> TemplateResponse:
    summary = runs.aggregate(n=Count("id"), up_to=Max("id"))
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"Retry {summary['n']} dead letter{'' if summary['n'] == 1 else 's'}?",
        "opts": AgentRun._meta,
        "error_type": error_type,
        "label": error_type or NO_CLASS,
        "count": summary["n"],
        "up_to": summary["up_to"] or 0,
        "sample": list(runs.only("id", "agent", "scope", "reason", "error_message")[:50]),
    }
    return TemplateResponse(request, "django_agentruns/admin/confirm_retry_class.html", context)
