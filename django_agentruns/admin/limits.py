"""Flow control in the console: the limits of keys (a small model an operator edits), a
run's usage and key, and the overview's usage totals.

Limits are written through `set_limit` (the API), never by the form's own save: a closed
key shows until when, and why; the running count is what the claim counts.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin
from django.db.models import Count, F, Sum
from django.db.models.functions import TruncDate
from django.http import HttpRequest
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from ..api import set_limit
from ..exceptions import InvalidInputError
from ..limits import check_limit_key, check_max_running, effective_limit
from ..models import AgentLimit, AgentRun, Status

USAGE_DAYS = 14  # the overview's usage by day: the last two weeks (the created_at index)

if TYPE_CHECKING:
    LimitAdminBase = admin.ModelAdmin[AgentLimit]
else:
    LimitAdminBase = admin.ModelAdmin


class LimitForm(forms.ModelForm):  # type: ignore[type-arg]
    """The key and the limit checked as `set_limit` checks them, so that a bad one is a
    form error, not a failed save."""

    class Meta:
        model = AgentLimit
        fields = ("key", "max_running")

    def clean_key(self) -> str:
        key = self.cleaned_data.get("key")
        try:
            return check_limit_key(key, "key")
        except InvalidInputError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean_max_running(self) -> int | None:
        try:
            return check_max_running(self.cleaned_data.get("max_running"))
        except InvalidInputError as exc:
            raise forms.ValidationError(str(exc)) from None


class AgentLimitAdmin(LimitAdminBase):
    form = LimitForm
    list_display = ("key", "max_running", "effective", "running", "closed")
    fields = ("key", "max_running", "effective", "running", "closed")
    readonly_fields = ("effective", "running", "closed")
    search_fields = ("key",)
    ordering = ("key",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return (*self.readonly_fields, "key") if obj is not None else self.readonly_fields

    @admin.display(description=_("limit in force"))
    def effective(self, row: AgentLimit) -> str:
        cap = effective_limit(row.key, row.max_running) if row.key else None
        if cap is None:
            return "unlimited"
        return f"{cap}" + ("" if row.max_running is not None else " (LIMITS setting)")

    @admin.display(description=_("running now"))
    def running(self, row: AgentLimit) -> int:
        return AgentRun.objects.filter(status=Status.RUNNING, limit_key=row.key).count()

    @admin.display(description=_("closed"))
    def closed(self, row: AgentLimit) -> str:
        if row.closed_until is None or row.closed_until <= timezone.now():
            return "open"
        why = f" ({row.closed_reason})" if row.closed_reason else ""
        return f"until {row.closed_until.isoformat(timespec='seconds')}{why}"

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # clear a limit instead (empty: the setting's, else unlimited)

    def save_model(self, request: HttpRequest, obj: AgentLimit, form: Any, change: bool) -> None:
        set_limit(obj.key, obj.max_running)  # through the API, which checks it


def usage_totals() -> dict[str, Any]:
    """Tokens and cost per agent and per day over the last USAGE_DAYS days (by creation)."""
    since = timezone.now() - timedelta(days=USAGE_DAYS)
    recent = AgentRun.objects.filter(created_at__gte=since).order_by()
    spent = {"tokens": Sum(F("input_tokens") + F("output_tokens")), "cost": Sum("cost"),
             "runs": Count("id")}
    # Any: django-stubs types values() rows without the annotations added after it.
    by_agent: Any = recent.values("agent").annotate(**spent).order_by("-cost")
    by_day: Any = recent.annotate(day=TruncDate("created_at")).values("day").annotate(
        **spent).order_by("-day")
    return {"usage_days": USAGE_DAYS,
            "usage_by_agent": [r for r in by_agent if r["tokens"] or r["cost"]],
            "usage_by_day": [r for r in by_day if r["tokens"] or r["cost"]]}


def usage(run: AgentRun) -> str:
    """A run's recorded usage, for the list and the run page."""
    tokens = run.input_tokens + run.output_tokens
    if not tokens and not run.cost:
        return "—"
    return f"{tokens:,} tokens, {run.cost:.4g}"
