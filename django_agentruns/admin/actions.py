"""The operator's operations, retry, cancel and erase: tallied, and offered as bulk actions.

Every status change goes through `api.retry` / `api.cancel`, whose guarded UPDATEs decide
what is eligible *now*: a run that changed state since the operator looked is skipped and
counted, never forced; erasing goes through `retention.erase`, which refuses an unfinished
run. Nothing here writes a run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.db import router
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.text import capfirst
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext_lazy

from .. import api
from ..exceptions import InvalidInputError, RunNotFinishedError, RunNotFoundError
from ..models import TERMINAL, AgentRun, Reason, Status
from ..ops import retention
from .budgets import confirmation_context

CONFIRM_SAMPLE = 50
LOG_BATCH = 500
MISSING = "missing"


def _retry(run_id: int, user: str) -> str:
    try:
        return "retried" if api.retry(run_id, by=user) else "skipped"
    except InvalidInputError:  # its dedupe key is held by another unfinished run
        return "skipped"


def _cancel(run_id: int, user: str) -> str:
    return api.cancel(run_id, reason=f"cancelled by {user} in the admin").value


def _erase(run_id: int, user: str) -> str:
    try:
        retention.erase(run_id, by=user)
    except RunNotFinishedError:  # it was retried since the operator looked
        return "skipped"
    return "erased"


@dataclass(frozen=True)
class Operation:
    name: str  # also the permission (django_agentruns.<name>_agentrun) unless `permission`
    eligible: tuple[str, ...]
    eligible_text: str
    call: Callable[[int, str], str]
    outcomes: dict[str, Any]  # outcome -> how a bulk message counts it ("%(count)d ...")
    single: dict[str, Any]  # outcome -> the message about one run ("{run} ...")
    changed: tuple[str, ...]  # the outcomes that changed a run
    permission: str = ""  # the permission's action, when it is not `name`
    removes: bool = False  # the run is gone afterwards: its history entry is a deletion

    @property
    def past(self) -> str:
        return {"retry": "Retried", "cancel": "Cancelled", "erase": "Erased"}.get(
            self.name, self.title)

    @property
    def codename(self) -> str:
        return f"{self.permission or self.name}_agentrun"

    @property
    def title(self) -> str:
        return capfirst(self.name)

    def apply_one(self, run_id: int, user: str) -> str:
        """Call the API for one run, in a short transaction of its own; say what came of it."""
        try:
            return self.call(run_id, user)
        except RunNotFoundError:
            return MISSING

    def apply(self, run_ids: Iterable[int], user: str) -> Counter[str]:
        return Counter(self.apply_one(run_id, user) for run_id in run_ids)

    def apply_logged(self, request: HttpRequest, run_ids: Iterable[int]) -> Counter[str]:
        """`apply`, and a `LogEntry` (the admin's History) for each run it changed."""
        tally: Counter[str] = Counter()
        changed: list[int] = []
        for run_id in run_ids:
            # What the history entry names, read before the run may be gone.
            before = AgentRun.objects.only("id", "agent", "status").filter(pk=run_id).first() \
                if self.removes else None
            outcome = self.apply_one(run_id, username(request))
            tally[outcome] += 1
            if before is not None and outcome in self.changed:
                LogEntry.objects.log_actions(int(request.user.pk or 0), [before], DELETION,
                                             f"{self.past} from the admin")
            elif outcome in self.changed:
                changed.append(run_id)
            if len(changed) >= LOG_BATCH:
                log_changes(request, changed, self)
                changed = []
        log_changes(request, changed, self)
        return tally

    def describe_one(self, run_id: int, outcome: str) -> tuple[str, int]:
        level = messages.SUCCESS if outcome in self.changed else messages.WARNING
        return str(self.single[outcome]).format(run=_("Run #%(id)s") % {"id": run_id}), level

    def describe(self, tally: Counter[str]) -> tuple[str, int]:
        """The operator's message, and its level: success if anything happened."""
        parts = [text % {"count": tally[key]}
                 for key, text in self.outcomes.items() if tally[key]]
        if not parts:
            return (_("%(title)s: no runs selected; nothing was changed.")
                    % {"title": self.title}, messages.WARNING)
        changed = any(tally[key] for key in self.changed)
        return (_("%(title)s: %(parts)s.") % {"title": self.title, "parts": "; ".join(parts)},
                messages.SUCCESS if changed else messages.WARNING)


RETRY = Operation(
    name="retry",
    eligible=(Status.FAILED, Status.CANCELLED),
    eligible_text="failed or cancelled",
    call=_retry,
    outcomes={
        "retried": ngettext_lazy(
            "%(count)d run queued again with a fresh retry budget",
            "%(count)d runs queued again with a fresh retry budget", "count"),
        "skipped": ngettext_lazy(
            "%(count)d skipped (not failed or cancelled)",
            "%(count)d skipped (not failed or cancelled)", "count"),
        MISSING: ngettext_lazy(
            "%(count)d skipped (no such run)",
            "%(count)d skipped (no such run)", "count"),
    },
    single={
        "retried": _("{run} is queued again, with a fresh retry budget."),
        "skipped": _("{run} was not retried: it is not failed or cancelled."),
        MISSING: _("{run} does not exist: nothing was changed."),
    },
    changed=("retried",),
)
CANCEL = Operation(
    name="cancel",
    eligible=(Status.QUEUED, Status.RUNNING, Status.WAITING),
    eligible_text="queued, running or waiting",
    call=_cancel,
    outcomes={
        "cancelled": ngettext_lazy(
            "%(count)d queued run cancelled",
            "%(count)d queued runs cancelled", "count"),
        "requested": ngettext_lazy(
            "%(count)d running run asked to stop (cancelled once its worker notices)",
            "%(count)d running runs asked to stop (cancelled once its worker notices)", "count"),
        "already_requested": ngettext_lazy(
            "%(count)d skipped (already asked to stop)",
            "%(count)d skipped (already asked to stop)", "count"),
        "not_cancellable": ngettext_lazy(
            "%(count)d skipped (already finished)",
            "%(count)d skipped (already finished)", "count"),
        MISSING: ngettext_lazy(
            "%(count)d skipped (no such run)",
            "%(count)d skipped (no such run)", "count"),
    },
    single={
        "cancelled": _("{run} is cancelled."),
        "requested": _("{run} was asked to stop: it is cancelled once its worker notices."),
        "already_requested": _("{run} was already asked to stop."),
        "not_cancellable": _("{run} was not cancelled: it has already finished."),
        MISSING: _("{run} does not exist: nothing was changed."),
    },
    changed=("cancelled", "requested"),
)
ERASE = Operation(
    name="erase",
    eligible=TERMINAL,
    eligible_text="finished or cancelled",
    call=_erase,
    outcomes={
        "erased": ngettext_lazy(
            "%(count)d run erased, stored rows and all",
            "%(count)d runs erased, stored rows and all", "count"),
        "skipped": ngettext_lazy(
            "%(count)d skipped (not finished)",
            "%(count)d skipped (not finished)", "count"),
        MISSING: ngettext_lazy(
            "%(count)d skipped (no such run)",
            "%(count)d skipped (no such run)", "count"),
    },
    single={
        "erased": _("{run} is erased, with everything it stored."),
        "skipped": _("{run} was not erased: it is not finished."),
        MISSING: _("{run} does not exist: nothing was changed."),
    },
    changed=("erased",),
    permission="delete",
    removes=True,
)
OPERATIONS = {op.name: op for op in (RETRY, CANCEL, ERASE)}


def log_changes(request: HttpRequest, run_ids: list[int], op: Operation) -> None:
    """History entries for runs an operation changed: who did what, from the admin."""
    if not run_ids:
        return
    runs = AgentRun.objects.filter(pk__in=run_ids).only("id", "agent", "status")
    LogEntry.objects.log_actions(int(request.user.pk or 0), runs, CHANGE,
                                 f"{op.past} from the admin")


def username(request: HttpRequest) -> str:
    return str(request.user.get_username())


def has_permission(model_admin: Any, request: HttpRequest, op: Operation) -> bool:
    """The operation's own permission, and view: its confirmations and messages show runs."""
    return bool(model_admin.has_view_permission(request) and
                request.user.has_perm(f"{AgentRun._meta.app_label}.{op.codename}"))


def selected_ids(request: HttpRequest) -> list[int] | None:
    """The posted selection as run ids; None if any of them is not an integer id."""
    raw = request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)
    if not all(value.isascii() and value.isdigit() and len(value) < 19 for value in raw):
        return None
    return sorted({int(value) for value in raw})


def bulk(model_admin: Any, request: HttpRequest, queryset: QuerySet[AgentRun],
         op: Operation, action: str) -> TemplateResponse | None:
    """First POST: a confirmation page. Its "yes" POST: apply, then report with counts.

    The selection is read again on the primary (the list read it from READ_DATABASE, which
    may lag): what the page counts and what is applied is the runs' state now, and each
    operation's guarded UPDATE checks it once more."""
    queryset = queryset.using(router.db_for_write(AgentRun))
    selected = selected_ids(request) or []
    across = request.POST.get("select_across") == "1"
    if request.POST.get("post") != "yes":
        return confirmation(model_admin, request, queryset, op, action=action,
                            selected=selected, across=across)
    found = list(queryset.values_list("pk", flat=True).iterator())
    tally = op.apply_logged(request, found)
    if not across:
        tally[MISSING] += len(set(selected) - set(found))
    model_admin.message_user(request, *op.describe(tally))
    return None


def confirmation(model_admin: Any, request: HttpRequest, queryset: QuerySet[AgentRun],
                 op: Operation, *, action: str = "", selected: list[int] | None = None,
                 across: bool = False, single: str | None = None) -> TemplateResponse:
    """The page that asks first: for a bulk action, or (`single`: the run page's URL) for
    the run page's button, whose form then posts back to the button's own URL."""
    selected = selected or []
    eligible = queryset.filter(status__in=op.eligible)
    total, count = queryset.count(), eligible.count()
    sample = list(eligible.only("id", "agent", "scope", "status", "reason", "error_type",
                                "cancel_requested_at")[:CONFIRM_SAMPLE])
    hopeless = eligible.filter(reason=Reason.NOT_RETRYABLE).count() if op is RETRY else 0
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"{op.title} {count} run{'' if count == 1 else 's'}?",
        "opts": model_admin.model._meta,
        "op": op,
        "action": action,
        "selected": selected,
        "select_across": across,
        "eligible_count": count,
        "ineligible_count": total - count,
        # The run page's button selects no ids: nothing can be missing from its one run.
        "missing_count": 0 if across or single else max(0, len(selected) - total),
        "sample": sample,
        "more": max(0, count - len(sample)),
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "not_retryable_count": hopeless,
        "single": single,
        **(confirmation_context(eligible, single is not None) if op is RETRY else {}),
    }
    return TemplateResponse(request, "django_agentruns/admin/confirm_action.html", context)


@admin.action(permissions=["retry"], description=_("Retry selected runs (failed or cancelled)"))
def retry_runs(model_admin: Any, request: HttpRequest,
               queryset: QuerySet[AgentRun]) -> TemplateResponse | None:
    return bulk(model_admin, request, queryset, RETRY, "retry_runs")


@admin.action(permissions=["cancel"], description=_("Cancel selected runs (queued or running)"))
def cancel_runs(model_admin: Any, request: HttpRequest,
                queryset: QuerySet[AgentRun]) -> TemplateResponse | None:
    return bulk(model_admin, request, queryset, CANCEL, "cancel_runs")


@admin.action(permissions=["erase"],
              description=_("Erase selected runs and everything they stored (finished only)"))
def erase_runs(model_admin: Any, request: HttpRequest,
               queryset: QuerySet[AgentRun]) -> TemplateResponse | None:
    return bulk(model_admin, request, queryset, ERASE, "erase_runs")
