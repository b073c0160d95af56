"""Flow control in the console: the limits of keys (a small model an operator edits), a
run's usage and key, and the overview's usage totals.

Limits are written through `set_limit` (the API), never by the form's own save: a closed
key shows until when, and why; the running count is what the claim counts.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Count, F, QuerySet, Sum
from django.db.models.functions import TruncDate
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.translation import gettext_lazy as _
from django.views.decorators.http import require_POST

from .. import transitions
from ..api import open_key, set_limit
from ..exceptions import InvalidInputError
from ..models import AgentLimit, AgentRun, Status
from ..ops.visibility import key_limits
from ..rules.limits import check_limit_key
from ..rules.windows import FIELDS, check_field, effective_limit, is_pattern
from . import display as show

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
        fields = ("key", "max_running", "per_minute", "tokens_per_minute", "cost_per_day")

    def clean_key(self) -> str:
        key = self.cleaned_data.get("key")
        try:
            return check_limit_key(key, "key")
        except InvalidInputError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        for name in FIELDS:
            try:
                cleaned[name] = check_field(name, cleaned.get(name))
            except InvalidInputError as exc:
                self.add_error(name, str(exc))
        return cleaned


@admin.action(permissions=["change"], description="Reopen the selected keys now")
def reopen_keys(model_admin: Any, request: HttpRequest, queryset: QuerySet[AgentLimit]) -> None:
    opened = [key for key in queryset.values_list("key", flat=True) if open_key(key)]
    model_admin.message_user(request, f"Reopened {len(opened)} key{'' if len(opened) == 1 else 's'}"
                             f"{': ' + ', '.join(opened) if opened else ' (none was closed)'}.",
                             messages.SUCCESS if opened else messages.WARNING)


class AgentLimitAdmin(LimitAdminBase):
    form = LimitForm
    list_display = ("key", "max_running", "effective", "running", "queued", "windows",
                    "spend_per_day", "closed")
    fields = ("key", "max_running", "per_minute", "tokens_per_minute", "cost_per_day",
              "effective", "running", "queued", "windows", "spend_per_day", "closed")
    readonly_fields = ("effective", "running", "queued", "windows", "spend_per_day", "closed")
    search_fields = ("key",)
    ordering = ("key",)
    actions = (reopen_keys,)
    change_list_template = "django_agentruns/admin/plain_change_list.html"
    change_form_template = "django_agentruns/admin/limit_change_form.html"

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return (*self.readonly_fields, "key") if obj is not None else self.readonly_fields

    @admin.display(description=_("running limit in force"))
    def effective(self, row: AgentLimit) -> str:
        cap = effective_limit(row.key, row.max_running) if row.key else None
        if row.key and not is_pattern(row.key):
            cap = key_limits(row).max_running
        if cap is None:
            return "unlimited"
        if cap == 0:
            return "paused (limit 0)"
        return f"{cap}" + ("" if row.max_running is not None else " (LIMITS setting)")

    @admin.display(description=_("windows now"))
    def windows(self, row: AgentLimit) -> str:
        """Each window's use against its size (reservations of running attempts included)."""
        if not row.key or is_pattern(row.key):
            return "—"
        limits = key_limits(row)
        if not limits.windowed:
            return "—"
        use = transitions.window_use([row.key], timezone.now()).get(row.key,
                                                                     transitions.WindowUse())
        parts = []
        if limits.per_minute is not None:
            parts.append(f"{use.starts}/{limits.per_minute} started per minute")
        if limits.tokens_per_minute is not None:
            parts.append(f"{use.tokens:,.0f}/{limits.tokens_per_minute:,} tokens per minute")
        if limits.cost_per_day is not None:
            parts.append(f"{use.cost:.4g}/{limits.cost_per_day:g} per day")
        return "; ".join(parts)

    @admin.display(description=_("spend, last 24 h"))
    def spend_per_day(self, row: AgentLimit) -> str:
        """Cost recorded by the key's runs created in the last day (a pattern: all of its
        keys')."""
        since = timezone.now() - timedelta(days=1)
        runs = AgentRun.objects.filter(created_at__gte=since)
        runs = runs.filter(limit_key__startswith=row.key[:-1]) if is_pattern(row.key) \
            else runs.filter(limit_key=row.key)
        spent = runs.aggregate(cost=Sum("cost"), tokens=Sum(F("input_tokens") +
                                                            F("output_tokens")))
        return f"{spent['cost'] or 0:.4g} ({spent['tokens'] or 0:,} tokens)"

    @admin.display(description=_("running now"))
    def running(self, row: AgentLimit) -> int:
        return AgentRun.objects.filter(status=Status.RUNNING, limit_key=row.key).count()

    @admin.display(description=_("queued now"))
    def queued(self, row: AgentLimit) -> int:
        return AgentRun.objects.filter(status=Status.QUEUED, limit_key=row.key).count()

    @admin.display(description=_("closed"))
    def closed(self, row: AgentLimit) -> str:
        if not is_closed(row):
            return "open"
        why = f" ({row.closed_reason})" if row.closed_reason else ""
        return f"until {show.timestamp(row.closed_until)}{why}"

    def render_change_form(self, request: HttpRequest, context: dict[str, Any],
                           add: bool = False, change: bool = False, form_url: str = "",
                           obj: Any = None) -> HttpResponse:
        context["can_reopen"] = obj is not None and is_closed(obj) and \
            self.has_change_permission(request, obj)
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_urls(self) -> list[URLPattern]:
        reopen = self.admin_site.admin_view(require_POST(self.reopen_view))
        return [path("<path:key>/reopen/", reopen, name="django_agentruns_agentlimit_reopen"),
                *super().get_urls()]

    def reopen_view(self, request: HttpRequest, key: str) -> HttpResponse:
        """The key page's "Reopen now": `open_key`, for a key closed by a 429 whose provider
        is back before the closure ends."""
        if not self.has_change_permission(request):
            raise PermissionDenied
        opened = open_key(key)
        self.message_user(request, f"Key {key!r} reopened: its runs may start now." if opened
                          else f"Key {key!r} was not closed.",
                          messages.SUCCESS if opened else messages.WARNING)
        page = reverse(f"{self.admin_site.name}:django_agentruns_agentlimit_change", args=[key])
        return HttpResponseRedirect(page)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # clear a limit instead (empty: the setting's, else unlimited)

    def save_model(self, request: HttpRequest, obj: AgentLimit, form: Any, change: bool) -> None:
        set_limit(obj.key, obj.max_running, per_minute=obj.per_minute,  # the API checks them
                  tokens_per_minute=obj.tokens_per_minute, cost_per_day=obj.cost_per_day)


def is_closed(row: AgentLimit) -> bool:
    return row.closed_until is not None and row.closed_until > timezone.now()


def usage_totals() -> dict[str, Any]:
    """Tokens and cost per agent and per day over the last USAGE_DAYS days (by creation)."""
    since = timezone.now() - timedelta(days=USAGE_DAYS)
    recent = AgentRun.objects.for_reading().filter(created_at__gte=since).order_by()
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
