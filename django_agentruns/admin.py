"""A read-only admin for runs and their events (the operations console builds on it)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from .models import AgentRun, RunEvent


class RunEventInline(admin.TabularInline):
    model = RunEvent
    fields = ("seq", "created_at", "type", "payload", "attempt")
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ("seq",)
    max_num = 0

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(AgentRun)
class AgentRunAdmin(admin.ModelAdmin):
    list_display = ("id", "agent", "scope", "status", "reason", "attempt", "requeue_count",
                    "queue", "created_at", "finished_at")
    list_filter = ("status", "reason", "queue")
    search_fields = ("=id", "scope", "agent")
    inlines = (RunEventInline,)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in AgentRun._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
