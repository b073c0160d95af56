"""The console's own pages: the run page's buttons (retry, cancel, fork from a checkpoint),
and the overview with its dead letters and its queues (pause, resume).

The buttons and the retry-a-class form are POST only, permission-checked and CSRF-checked
(the admin site wraps every view here); anything else gets 405 or 403. Every view needs
view_agentrun, an operation its own permission too: each page or message names runs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Max, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.translation import gettext_lazy as _
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from .. import api, queues
from ..exceptions import AgentRunsError, InvalidInputError, RunNotFoundError
from ..models import AgentRun, Reason, Status
from ..ops import replica, triage
from ..ops.workers import NOBODY_REAPS, Coverage, lapse, live_ids, rescuer
from ..runtime import reaper
from .actions import (
    MISSING,
    RETRY,
    Operation,
    confirmation,
    has_permission,
    log_changes,
    username,
)
from .approvals import awaiting_approval
from .budgets import posted_budget
from .chart import svg
from .limits import usage_totals

NO_CLASS = "(no error type)"


def _url(name: str, *args: Any) -> str:
    return reverse(f"admin:django_agentruns_agentrun_{name}", args=args)


def operate(model_admin: Any, op: Operation) -> Any:
    """The run page's Retry / Cancel: a confirmation page (GET, or a POST without `post=yes`),
    then the operation on one run through the API, and back to the run."""

    @require_http_methods(["GET", "POST"])
    def view(request: HttpRequest, run_id: int) -> HttpResponse:
        if not has_permission(model_admin, request, op):
            raise PermissionDenied
        if request.method == "GET" or request.POST.get("post") != "yes":
            runs = AgentRun.objects.filter(pk=run_id)
            if not runs.exists():
                model_admin.message_user(request, op.describe_one(run_id, MISSING)[0],
                                         messages.WARNING)
                return HttpResponseRedirect(_url("changelist"))
            return confirmation(model_admin, request, runs, op, single=_url("change", run_id))
        budget = posted_budget(request) if op is RETRY else None
        if isinstance(budget, str):  # a malformed budget: said, and nothing retried
            model_admin.message_user(request, budget, messages.ERROR)
            return HttpResponseRedirect(_url("retry", run_id))
        if budget is not None:
            outcome = retry_with_budget(request, run_id, budget)
        else:
            outcome = op.apply_logged(request, [run_id]).most_common(1)[0][0]
        model_admin.message_user(request, *op.describe_one(run_id, outcome))
        if outcome == MISSING:
            return HttpResponseRedirect(_url("changelist"))
        return HttpResponseRedirect(_url("change", run_id))

    return view


WINDOWS = {"1h": timedelta(hours=1), "3h": timedelta(hours=3), "24h": timedelta(hours=24)}
DEFAULT_WINDOW = "3h"


def overview(model_admin: Any) -> Any:
    """The triage page: agents over a window, queues now, stuck runs, dead letters, a chart."""

    @require_GET
    def view(request: HttpRequest) -> HttpResponse:
        if not model_admin.has_view_permission(request):
            raise PermissionDenied
        say_replica_lag(model_admin, request)
        at = timezone.now()
        window = request.GET.get("window", DEFAULT_WINDOW)
        window = window if window in WINDOWS else DEFAULT_WINDOW
        since = at - WINDOWS[window]
        counts = dict(AgentRun.objects.for_reading().order_by().values_list("status")
                      .annotate(n=Count("id")).values_list("status", "n"))
        coverage = Coverage.read(at)
        agents, sampled = triage.agent_stats(since)
        stuck, stuck_total = triage.stuck(at)
        live = live_ids(at)
        groups = triage.dead_letter_groups()
        awaiting, awaiting_total = awaiting_approval()
        context = {
            **model_admin.admin_site.each_context(request),
            "title": "Agent runs overview",
            "awaiting": awaiting,
            "awaiting_total": awaiting_total,
            "opts": AgentRun._meta,
            "statuses": [(s.value, s.label, counts.get(s.value, 0)) for s in Status],
            "total": sum(counts.values()),
            "window": window,
            "windows": list(WINDOWS),
            "agents": agents,
            "sampled": sampled,
            "sample_size": triage.SAMPLE,
            "queues": triage.queue_stats(coverage, at),
            "live_workers": coverage.workers,
            "uncovered": triage.uncovered(coverage, at),
            "stuck": [(run, lapse(run, live, at)) for run in stuck],
            "stuck_total": stuck_total,
            "stuck_rescuer": (rescuer(stuck[0], coverage) or NOBODY_REAPS) if stuck else "",
            "can_reap": has_permission(model_admin, request, RETRY),
            "groups": groups,
            "dead_letter_total": sum(g.count for g in groups),
            "chart": svg(triage.throughput(since, at)),
            "can_retry": has_permission(model_admin, request, RETRY),
            "can_pause": request.user.has_perm("django_agentruns.add_pausedqueue"),
            "can_resume": request.user.has_perm("django_agentruns.delete_pausedqueue"),
            **usage_totals(),
        }
        return TemplateResponse(request, "django_agentruns/admin/overview.html", context)

    return view


def say_replica_lag(model_admin: Any, request: HttpRequest) -> None:
    """A page read from a replica says so when the replica is over `LAG_SHOWN` behind."""
    note = replica.lag_note()
    if note:
        model_admin.message_user(request, note, messages.WARNING)


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
            model_admin.message_user(
                request, _("No valid failure class given: nothing was retried."), messages.ERROR)
            return HttpResponseRedirect(_url("overview"))
        agent, reason = request.POST.get("agent"), request.POST.get("reason")
        if "\x00" in (agent or "") + (reason or ""):
            agent = reason = None
        runs = _class_runs(error_type, agent, reason)
        if request.POST.get("confirm") != "yes":
            return _confirm_class(model_admin, request, error_type, runs, agent, reason)
        up_to = request.POST.get("up_to", "")
        if not (up_to.isascii() and up_to.isdigit() and len(up_to) < 19):
            model_admin.message_user(request, _("Malformed confirmation: nothing was retried."),
                                     messages.ERROR)
            return HttpResponseRedirect(_url("overview"))
        ids = runs.filter(pk__lte=int(up_to)).values_list("pk", flat=True).iterator()
        text, level = RETRY.describe(RETRY.apply_logged(request, ids))
        label = _label(error_type, agent, reason)
        model_admin.message_user(request, _("Dead letters of class %(label)s: %(text)s")
                                 % {"label": label, "text": text}, level)
        return HttpResponseRedirect(_url("overview"))

    return view


def _class_runs(error_type: str, agent: str | None = None,
                reason: str | None = None) -> QuerySet[AgentRun]:
    """The dead letters of a failure class, of one agent and reason if given (a group)."""
    runs = AgentRun.objects.dead_letters().order_by("pk").filter(error_type=error_type)
    if agent is not None:
        runs = runs.filter(agent=agent)
    return runs if reason is None else runs.filter(reason=reason)


def _label(error_type: str, agent: str | None, reason: str | None) -> str:
    label = error_type or NO_CLASS
    return label + "".join(f" ({what})" for what in (agent, reason) if what)


def _confirm_class(model_admin: Any, request: HttpRequest, error_type: str,
                   runs: QuerySet[AgentRun], agent: str | None,
                   reason: str | None) -> TemplateResponse:
    summary = runs.aggregate(n=Count("id"), up_to=Max("id"))
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"Retry {summary['n']} dead letter{'' if summary['n'] == 1 else 's'}?",
        "opts": AgentRun._meta,
        "error_type": error_type,
        "label": _label(error_type, agent, reason),
        "agent": agent,
        "reason": reason,
        "not_retryable_count": runs.filter(reason=Reason.NOT_RETRYABLE).count(),
        "count": summary["n"],
        "up_to": summary["up_to"] or 0,
        "sample": list(runs.only("id", "agent", "scope", "reason", "error_message")[:50]),
    }
    return TemplateResponse(request, "django_agentruns/admin/confirm_retry_class.html", context)


def fork_run(model_admin: Any) -> Any:
    """The run page's "fork from here": a new run from one of its checkpoints (retry
    permission, as replaying the tail of a failed run is a retry of sorts)."""

    @require_POST
    def view(request: HttpRequest, run_id: int) -> HttpResponse:
        if not has_permission(model_admin, request, RETRY):
            raise PermissionDenied
        number = request.POST.get("checkpoint", "")
        replay = request.POST.get("replay") == "1"
        agent = request.POST.get("agent") or None
        if replay and not number:
            return _replay(model_admin, request, run_id, agent)
        if not (number.isascii() and number.isdigit() and len(number) < 10):
            model_admin.message_user(request, _("Malformed checkpoint number: nothing was "
                                                "forked."), messages.ERROR)
            return HttpResponseRedirect(_url("change", run_id))
        try:
            run = api.fork(run_id, checkpoint=int(number), by=username(request))
        except RunNotFoundError:
            model_admin.message_user(request, _("Run #%(id)s no longer exists.")
                                     % {"id": run_id}, messages.ERROR)
            return HttpResponseRedirect(_url("changelist"))
        except AgentRunsError as exc:
            model_admin.message_user(request, _("Run #%(id)s was not forked: %(error)s")
                                     % {"id": run_id, "error": exc}, messages.ERROR)
            return HttpResponseRedirect(_url("change", run_id))
        model_admin.message_user(request, _("Run #%(id)s forked from run #%(source)s at "
                                           "checkpoint %(number)s.")
                                 % {"id": run.pk, "source": run_id, "number": number},
                                 messages.SUCCESS)
        return HttpResponseRedirect(_url("change", run.pk))

    return view


def _replay(model_admin: Any, request: HttpRequest, run_id: int,
            agent: str | None) -> HttpResponse:
    """"Replay with...": a fork from the start in which the run's completed steps return
    their recorded results, run by the chosen agent."""
    try:
        run = api.fork(run_id, replay=True, agent=agent, by=username(request))
    except RunNotFoundError:
        model_admin.message_user(request, _("Run #%(id)s no longer exists.") % {"id": run_id},
                                 messages.ERROR)
        return HttpResponseRedirect(_url("changelist"))
    except AgentRunsError as exc:
        model_admin.message_user(request, _("Run #%(id)s was not replayed: %(error)s")
                                 % {"id": run_id, "error": exc}, messages.ERROR)
        return HttpResponseRedirect(_url("change", run_id))
    model_admin.message_user(request, _("Run #%(id)s replays run #%(source)s with "
                                       "%(agent)r.")
                             % {"id": run.pk, "source": run_id, "agent": run.agent},
                             messages.SUCCESS)
    return HttpResponseRedirect(_url("change", run.pk))


def pause_or_resume(model_admin: Any, pause: bool) -> Any:
    """The overview's Pause / Resume buttons: the paused-queue model's add / delete
    permission."""

    @require_POST
    def view(request: HttpRequest) -> HttpResponse:
        action = "add" if pause else "delete"
        if not request.user.has_perm(f"django_agentruns.{action}_pausedqueue"):
            raise PermissionDenied
        name = request.POST.get("queue", "")
        try:
            call = queues.pause_queue if pause else queues.resume_queue
            done = call(name, by=username(request))
        except InvalidInputError as exc:
            model_admin.message_user(request, str(exc), messages.ERROR)
            return HttpResponseRedirect(_url("overview"))
        if done:
            text = _("Queue %(name)r paused.") if pause else _("Queue %(name)r resumed.")
        else:
            text = _("Queue %(name)r was paused already.") if pause \
                else _("Queue %(name)r was not paused.")
        model_admin.message_user(request, text % {"name": name},
                                 messages.SUCCESS if done else messages.WARNING)
        return HttpResponseRedirect(_url("overview"))

    return view



def reap_now(model_admin: Any) -> Any:
    """The run page's and the overview's "Reap now": take back one stuck run at once,
    through the reaper (requeued, or dead-lettered with no requeue left), when nothing
    else reaps. Retry permission: it puts the run back in the queue, as a retry does."""

    @require_POST
    def view(request: HttpRequest, run_id: int) -> HttpResponse:
        if not has_permission(model_admin, request, RETRY):
            raise PermissionDenied
        back = _url("overview") if request.POST.get("back") == "overview" \
            else _url("change", run_id)
        report = reaper.reap(run_ids=[run_id])
        done = {"requeued": report.requeued, "dead-lettered": report.dead_lettered,
                "cancelled": report.cancelled}
        what = next((name for name, ids in done.items() if run_id in ids), None)
        if what is None:
            model_admin.message_user(
                request, f"Run #{run_id} was not reaped: its lease holds (or it is no longer "
                "running).", messages.WARNING)
        else:
            model_admin.message_user(request, f"Run #{run_id} reaped: {what}.",
                                     messages.SUCCESS)
        return HttpResponseRedirect(back)

    return view


def retry_with_budget(request: HttpRequest, run_id: int, budget: dict[str, Any]) -> str:
    """`api.retry` with the raised budget; the outcome as `RETRY` names them."""
    try:
        retried = api.retry(run_id, by=username(request), budget=budget)
    except RunNotFoundError:
        return MISSING
    except InvalidInputError:  # its dedupe key is held by another unfinished run
        return "skipped"
    if retried:
        log_changes(request, [run_id], RETRY)
    return "retried" if retried else "skipped"
