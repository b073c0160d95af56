"""The run admin: the run list, the read-only run page, and the console's URLs.

Registered on the default admin site by the package's `__init__`. Nobody adds, edits or
deletes a run or an event here; status changes only through `api` (see `actions`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Case, OuterRef, QuerySet, Subquery, When
from django.db.models.fields.json import KT
from django.db.models.functions import Substr
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext_lazy as _

from ..models import AgentRun, RunEvent, RunPayload, Status
from ..ops.diagnosis import short_error
from ..ops.visibility import why_not_started
from ..ops.workers import live_ids
from ..queries import reading
from ..registry import all_agents
from ..tasks.results import TASK_AGENTS
from . import approvals, live_output, views
from . import display as show
from . import limits as flow
from .actions import (
    CANCEL,
    ERASE,
    RETRY,
    cancel_runs,
    erase_runs,
    has_permission,
    retry_runs,
    selected_ids,
)
from .filters import AgentFilter, AttentionFilter, QueueFilter
from .summary import summary

EVENTS_PER_PAGE = 100
ERROR_HEAD = 200  # characters of the error message the list loads
ERROR_SHOWN = 48  # and shows (the rest on hover)
TASK_PATH_SHOWN = 120
# Never loaded for the list: a page of 100 runs would otherwise carry 100 inputs,
# outputs and tracebacks.
HEAVY_FIELDS = ("error_message", "cancel_reason")  # input, output: no columns (RunPayload)


if TYPE_CHECKING:
    ModelAdminBase = admin.ModelAdmin[AgentRun]
else:  # ModelAdmin is generic only in django-stubs
    ModelAdminBase = admin.ModelAdmin


class RunChangeList(ChangeList):
    def get_queryset(self, request: HttpRequest, *args: Any, **kwargs: Any) -> QuerySet[AgentRun]:
        # The list shows the error's first words: a prefix, never the whole message. Read
        # from READ_DATABASE (a replica): an action on the selection re-reads on the primary.
        runs: QuerySet[AgentRun] = super().get_queryset(request, *args, **kwargs)
        return reading(runs).defer(*HEAVY_FIELDS).annotate(
            error_head=Substr("error_message", 1, ERROR_HEAD), **approvals.wait_columns(),
            # A django.tasks run is named by its task's path: the one key read from the
            # input, of task runs only (the CASE spares every other run's input).
            task_path=Case(When(agent__in=TASK_AGENTS, then=Subquery(
                RunPayload.objects.filter(run_id=OuterRef("pk"), kind=RunPayload.INPUT)
                .order_by("-id").values_list(Substr(KT("value__task"), 1, TASK_PATH_SHOWN))
                [:1]))))

    def get_results(self, request: HttpRequest) -> None:
        """The page's rows, each told which workers are live (one read for the page), so a
        stuck run's badge says so."""
        super().get_results(request)
        live = live_ids()
        rows = list(self.result_list)
        for run in rows:
            run.live_workers = live
        self.result_list = rows


class AgentRunAdmin(ModelAdminBase):
    # Sized for a 1400 px laptop screen with the sidebar and the filters open (about 750 px
    # for the table): related values share a cell, one above the other.
    list_display = ("short_id", "run_name", "state", "attempts", "queue", "usage", "when")
    list_display_links = ("short_id",)
    list_filter = ("status", "reason", AttentionFilter, approvals.WaitingFilter, AgentFilter,
                   QueueFilter)
    search_fields = ("scope", "agent")  # and the run id: see get_search_results
    search_help_text = "A run id, or part of a scope or an agent name."
    date_hierarchy = "created_at"
    show_full_result_count = False  # no second COUNT(*) over the whole table
    show_facets = admin.ShowFacets.NEVER  # facets count every filter choice: a scan each
    list_per_page = 100
    actions = (retry_runs, cancel_runs, erase_runs)
    change_list_template = "django_agentruns/admin/change_list.html"
    change_form_template = "django_agentruns/admin/change_form.html"
    fieldsets = (
        (None, {"fields": (("status_badge", "reason_text", "cancel_request"),
                           ("agent", "queue", "priority"),
                           ("scope", "fired_seq"), ("attempt", "requeues"),
                           ("created", "available"),
                           ("started", "finished", "duration"))}),
        ("Lease", {"fields": ("lease",)}),
        ("Flow control", {"fields": (("limit_key", "snooze_count"), ("usage", "budget"))}),
        ("Data", {"fields": (("input_json", "output_json"),
                             ("checkpoint_count", "checkpoint_json"),
                             ("dedupe_key", "forked_from_link"))}),
        ("Last error", {"fields": ("last_error",)}),
    )
    readonly_fields = ("status_badge", "reason_text", "agent", "queue", "priority", "scope",
                       "fired_seq", "attempt", "requeues", "created", "available",
                       "started", "finished", "duration", "lease", "cancel_request",
                       "input_json", "output_json", "checkpoint_count", "checkpoint_json",
                       "last_error", "waiting_for", "dedupe_key", "forked_from_link",
                       "limit_key", "snooze_count", "usage", "budget")

    # ------------------------------------------------------------------ permissions

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # the run page is read-only for everyone; operators act by buttons

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return has_permission(self, request, RETRY)

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return has_permission(self, request, CANCEL)

    def has_erase_permission(self, request: HttpRequest) -> bool:
        """The delete permission: erasing is the one deletion the admin offers (Django's
        own delete stays off: it would load every payload and miss the rows a run owns)."""
        return has_permission(self, request, ERASE)

    # ------------------------------------------------------------------ list

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return RunChangeList

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[AgentRun],
                           search_term: str) -> tuple[QuerySet[AgentRun], bool]:
        """Scope and agent by substring; a number (or #number) is also a run id, by index."""
        found, duplicates = super().get_search_results(request, queryset, search_term)
        term = search_term.strip().removeprefix("#")
        if term.isascii() and term.isdigit() and len(term) < 19:
            found = found | queryset.filter(pk=int(term))
        return found, duplicates

    def changelist_view(self, request: HttpRequest,
                        extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """A POSTed action this user may not run is forbidden, not silently ignored; a query
        the database cannot even hold (a NUL byte: PostgreSQL refuses it) is dropped."""
        if any("\x00" in key + "".join(values) for key, values in request.GET.lists()):
            self.message_user(request, _("Malformed filter (it contained a NUL character): "
                                       "showing all runs."), messages.ERROR)
            return HttpResponseRedirect(request.path)
        if request.method == "POST" and "action" in request.POST:
            allowed = self.get_actions(request)
            if any(name and name not in allowed for name in request.POST.getlist("action")):
                raise PermissionDenied
        else:
            views.say_replica_lag(self, request)
        return super().changelist_view(request, extra_context)

    def response_action(self, request: HttpRequest, queryset: QuerySet[AgentRun],
                        *args: Any, **kwargs: Any) -> HttpResponse | None:
        if selected_ids(request) is None:
            self.message_user(request, _("Malformed selection (run ids are integers): "
                                       "nothing was changed."), messages.ERROR)
            return None
        return super().response_action(request, queryset, *args, **kwargs)

    @admin.display(description=_("id"), ordering="id")
    def short_id(self, run: AgentRun) -> str:
        return f"#{run.pk}"

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, run: AgentRun) -> SafeString:
        live = live_ids() if run.status == Status.RUNNING else None
        return show.status_badge(run, live)

    @admin.display(description=_("reason"), ordering="reason")
    def reason_text(self, run: AgentRun) -> SafeString:
        return show.reason(run)

    @admin.display(description=_("attempts"), ordering="attempt")
    def attempts(self, run: AgentRun) -> str:
        """Attempts started, and the requeues they took if any: "3 (2 requeues)"."""
        if not run.requeue_count:
            return str(run.attempt)
        return f"{run.attempt} ({run.requeue_count} req.)"

    @admin.display(description=_("agent / scope"), ordering="agent")
    def run_name(self, run: AgentRun) -> SafeString:
        task = getattr(run, "task_path", None) if run.agent in TASK_AGENTS else None
        if task:  # every task run has the same agent: its task says what it is
            return format_html('{}<br><span class="agentruns-task" title="{}">{}</span>',
                               run.agent, task, task)
        return format_html('{}<br><span class="agentruns-muted">{}</span>', run.agent,
                           run.scope)

    @admin.display(description=_("status / reason / error"), ordering="status")
    def state(self, run: AgentRun) -> SafeString:
        """The badge; under it the reason (and error class), then the error's first words."""
        head = getattr(run, "error_head", "") or ""
        error = format_html('<br><span class="agentruns-error-short" title="{}">{}</span>',
                            head, short_error(head, ERROR_SHOWN)) \
            if head and run.status == Status.FAILED else mark_safe("")
        reason = show.reason(run)
        waiting = approvals.waiting_label(run)
        return format_html("{}{}{}{}", show.status_badge(run, getattr(run, "live_workers", None)),
                           format_html("<br>{}", reason) if reason else "", error,
                           format_html("<br>{}", waiting) if waiting else "")

    @admin.display(description=_("created / duration"), ordering="created_at")
    def when(self, run: AgentRun) -> SafeString:
        return format_html('{}<br><span class="agentruns-muted">{}</span>',
                           show.timestamp(run.created_at), show.duration_or_age(run))

    @admin.display(description=_("created"), ordering="created_at")
    def created(self, run: AgentRun) -> str:
        return show.timestamp(run.created_at)

    @admin.display(description=_("available at"))
    def available(self, run: AgentRun) -> str:
        return show.timestamp(run.available_at)

    @admin.display(description=_("started"))
    def started(self, run: AgentRun) -> str:
        return show.timestamp(run.started_at) or "—"

    @admin.display(description=_("finished"))
    def finished(self, run: AgentRun) -> str:
        return show.timestamp(run.finished_at) or "—"

    @admin.display(description=_("usage"), ordering="cost")
    def usage(self, run: AgentRun) -> str:
        return flow.usage(run)

    @admin.display(description=_("duration / age"))
    def duration(self, run: AgentRun) -> str:
        return show.duration_or_age(run)

    # ------------------------------------------------------------------ run page

    @admin.display(description=_("requeues"))
    def requeues(self, run: AgentRun) -> str:
        return show.requeues(run)

    @admin.display(description=_("lease"))
    def lease(self, run: AgentRun) -> str:
        return show.lease(run)

    @admin.display(description=_("cancel requested"))
    def cancel_request(self, run: AgentRun) -> str:
        return show.cancel_request(run)

    @admin.display(description=_("input"))
    def input_json(self, run: AgentRun) -> SafeString:
        return show.pretty_json(run.input)

    @admin.display(description=_("output"))
    def output_json(self, run: AgentRun) -> SafeString:
        return show.pretty_json(run.output)

    @admin.display(description=_("checkpoint state"))
    def checkpoint_json(self, run: AgentRun) -> SafeString:
        return show.pretty_json(run.checkpoint_state)

    @admin.display(description=_("forked from"))
    def forked_from_link(self, run: AgentRun) -> SafeString:
        return show.run_link(run.forked_from_id, self._run_url)

    @admin.display(description=_("error"))
    def last_error(self, run: AgentRun) -> SafeString:
        return show.last_error(run)

    @admin.display(description=_("why it has not started"))
    def waiting_for(self, run: AgentRun) -> SafeString:
        return show.explanation(why_not_started(run), self._run_url)

    def _run_url(self, run_id: int) -> str:
        return reverse(f"{self.admin_site.name}:django_agentruns_agentrun_change", args=[run_id])

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = list(super().get_fieldsets(request, obj))
        if obj is not None and obj.status == Status.QUEUED:
            fieldsets.insert(1, ("Waiting", {"fields": ("waiting_for",)}))
        return fieldsets

    def render_change_form(self, request: HttpRequest, context: dict[str, Any],
                           add: bool = False, change: bool = False, form_url: str = "",
                           obj: Any = None) -> HttpResponse:
        if obj is not None:
            # Newest first by default: the event that explains a dead letter, or a running
            # run's latest progress, is on screen without paging.
            oldest_first = request.GET.get("events_order") == "oldest"
            events = Paginator(RunEvent.objects.filter(run=obj).order_by(
                "seq" if oldest_first else "-seq"), EVENTS_PER_PAGE).get_page(
                request.GET.get("events_page"))
            context.update(
                summary=summary(obj),
                oldest_first=oldest_first,
                events=events,
                event_rows=[(e, show.compact_json(e.payload)) for e in events],
                can_retry=obj.status in RETRY.eligible and self.has_retry_permission(request),
                can_cancel=obj.status in CANCEL.eligible and obj.cancel_requested_at is None
                and self.has_cancel_permission(request),
                **approvals.page_context(self, request, obj),
                # The checkpoint history, each one a "fork from here"
                checkpoints=show.checkpoints(obj),
                can_fork=self.has_retry_permission(request),
                # Durable steps, "Replay with..." (any registered agent), and for a fork
                # its origin's outputs and steps beside its own
                steps=show.steps(obj),
                replay_agents=sorted(all_agents()),
                compare_output=show.compared_outputs(obj),
                can_reap=obj.status == Status.RUNNING and self.has_retry_permission(request),
                **live_output.page_context(obj),
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    # ------------------------------------------------------------------ urls

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        name = "django_agentruns_agentrun"
        own = [
            path("overview/", wrap(views.overview(self)), name=f"{name}_overview"),
            path("overview/retry-class/", wrap(views.retry_class(self)),
                 name=f"{name}_retry_class"),
            path("<int:run_id>/retry/", wrap(views.operate(self, RETRY)),
                 name=f"{name}_retry"),
            path("<int:run_id>/cancel/", wrap(views.operate(self, CANCEL)),
                 name=f"{name}_cancel"),
            path("<int:run_id>/approval/", wrap(approvals.answer(self)),
                 name=f"{name}_approval"),
            path("<int:run_id>/deliver/", wrap(approvals.deliver_input(self)),
                 name=f"{name}_deliver"),
            path("<int:run_id>/fork/", wrap(views.fork_run(self)), name=f"{name}_fork"),
            path("<int:run_id>/reap/", wrap(views.reap_now(self)), name=f"{name}_reap"),
            path("queues/pause/", wrap(views.pause_or_resume(self, True)),
                 name=f"{name}_pause_queue"),
            path("queues/resume/", wrap(views.pause_or_resume(self, False)),
                 name=f"{name}_resume_queue"),
        ]
        return own + super().get_urls()
