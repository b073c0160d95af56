"""The schedules admin: list with the next tick, edit, pause (untick `enabled`), delete.

A schedule declared on an agent (`@agent(schedule=...)`) can be paused here, but its timing
belongs to the code: those fields are read-only on its page, and it cannot be deleted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from ..exceptions import AgentRunsError
from ..models import Schedule
from ..registry import get_agent
from ..rules.ticks import check_timing
from ..schedules import check_schedule_input, next_tick, timing_of
from . import display as show

if TYPE_CHECKING:
    ScheduleAdminBase = admin.ModelAdmin[Schedule]
else:  # ModelAdmin is generic only in django-stubs
    ScheduleAdminBase = admin.ModelAdmin

CODE_FIELDS = ("name", "agent", "cron", "every", "tz", "catch_up", "input")


class ScheduleForm(forms.ModelForm):  # type: ignore[type-arg]
    """Checks what `add_schedule` checks: a known agent, one valid timing, an input its
    runs can be enqueued with."""

    class Meta:
        model = Schedule
        fields = ("name", "agent", "cron", "every", "tz", "input", "catch_up", "enabled")

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.instance.pk and self.instance.origin == Schedule.Origin.CODE:
            return data
        if not isinstance(data.get("input"), dict):
            raise forms.ValidationError("Input must be a JSON object.")
        try:
            if "agent" in data:
                check_schedule_input(get_agent(data["agent"]).name, data["input"], "Input")
            check_timing(data.get("cron") or None, data.get("every"), data.get("tz") or None,
                         "This schedule")
        except AgentRunsError as exc:
            raise forms.ValidationError(str(exc)) from None
        return data


@admin.action(permissions=["change"], description=_("Pause the selected schedules"))
def pause_schedules(modeladmin: Any, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
    for row in queryset.filter(enabled=True):
        row.enabled = False
        row.save(update_fields=["enabled", "updated_at"])  # updated_at: tickers re-read
    modeladmin.message_user(request, _("Paused."), messages.SUCCESS)


@admin.action(permissions=["change"], description=_("Resume the selected schedules"))
def resume_schedules(modeladmin: Any, request: HttpRequest,
                     queryset: QuerySet[Schedule]) -> None:
    for row in queryset.filter(enabled=False):
        row.enabled = True
        row.last_tick = timing_of(row).latest(timezone.now())  # the pause's ticks are skipped
        row.failures, row.retry_at = 0, None
        row.save(update_fields=["enabled", "last_tick", "failures", "retry_at", "updated_at"])
    modeladmin.message_user(request, _("Resumed: each runs from its next tick."),
                            messages.SUCCESS)


class ScheduleAdmin(ScheduleAdminBase):
    form = ScheduleForm
    list_display = ("name", "agent", "timing", "enabled", "catch_up", "last_ticked",
                    "upcoming", "origin")
    list_filter = ("enabled", "origin")
    search_fields = ("name", "agent")
    actions = (pause_schedules, resume_schedules)
    change_list_template = "django_agentruns/admin/plain_change_list.html"
    change_form_template = "django_agentruns/admin/plain_change_form.html"

    @admin.display(description="last tick", ordering="last_tick")
    def last_ticked(self, row: Schedule) -> str:
        return show.timestamp(row.last_tick) or "—"

    @admin.display(description=_("when"))
    def timing(self, row: Schedule) -> str:
        if row.cron:
            return f"cron {row.cron}" + (f" ({row.tz})" if row.tz else "")
        return f"every {row.every} s"

    @admin.display(description=_("next tick"))
    def upcoming(self, row: Schedule) -> str:
        if not row.enabled:
            return "paused"
        if row.failures and row.retry_at:
            return (f"retrying at {timezone.localtime(row.retry_at):%Y-%m-%d %H:%M:%S %Z} "
                    f"({row.failures} failed: {row.last_error[:200]})")
        try:
            return show.timestamp(next_tick(row))
        except Exception as exc:  # a row edited into nonsense: say so, show the others
            return f"cannot tick: {exc}"

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is not None and obj.origin == Schedule.Origin.CODE:
            return CODE_FIELDS
        return ()

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and obj.origin == Schedule.Origin.CODE:
            return False
        return super().has_delete_permission(request, obj)

    def save_model(self, request: HttpRequest, obj: Schedule, form: Any, change: bool) -> None:
        """A new schedule, one whose timing changed or one resumed first ticks at its next
        tick (the ticks of a pause are skipped, not caught up)."""
        before = Schedule.objects.filter(pk=obj.pk).first() if change else None
        if before is None or timing_of(before) != timing_of(obj) or \
                (obj.enabled and not before.enabled):
            obj.last_tick = timing_of(obj).latest(timezone.now())
        obj.failures, obj.retry_at, obj.last_error = 0, None, ""  # edited: try it again
        super().save_model(request, obj, form, change)
