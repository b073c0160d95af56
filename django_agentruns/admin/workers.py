"""The workers page: each worker's record of itself, live or gone. Read-only.

Seeing workers is seeing runs' owners, so it takes the same permission as the run list
(`view_agentrun`); nobody adds, edits or deletes a record here (workers write their own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _

from ..models import AgentRun, WorkerRecord
from ..ops import workers
from . import display as show

if TYPE_CHECKING:
    WorkerAdminBase = admin.ModelAdmin[WorkerRecord]
else:  # ModelAdmin is generic only in django-stubs
    WorkerAdminBase = admin.ModelAdmin

VIEW = f"{AgentRun._meta.app_label}.view_agentrun"


class WorkerRecordAdmin(WorkerAdminBase):
    list_display = ("worker_id", "state", "queue_list", "concurrency", "agent_count", "version",
                    "started", "last_seen")
    search_fields = ("worker_id", "host")
    list_per_page = 100
    show_full_result_count = False
    readonly_fields = ("worker_id", "state", "host", "pid", "queue_list", "concurrency",
                       "agent_list", "version", "started", "last_seen")
    fields = readonly_fields
    change_list_template = "django_agentruns/admin/plain_change_list.html"
    change_form_template = "django_agentruns/admin/plain_change_form.html"

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.has_perm(VIEW))

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description=_("state"))
    def state(self, record: WorkerRecord) -> SafeString:
        if workers.is_live(record):
            return format_html('<span class="agentruns-badge" style="background:{}">{}</span>',
                               "#2e7d32", "live")
        return format_html('<span class="agentruns-badge" style="background:{}">{}</span>',
                           "#c62828", "gone (stopped beating)")

    @admin.display(description=_("queues"))
    def queue_list(self, record: WorkerRecord) -> str:
        return ", ".join(record.queues)

    @admin.display(description=_("agents"))
    def agent_count(self, record: WorkerRecord) -> int:
        return len(record.agents)

    @admin.display(description=_("agents"))
    def agent_list(self, record: WorkerRecord) -> str:
        return ", ".join(record.agents)

    @admin.display(description=_("started"), ordering="started_at")
    def started(self, record: WorkerRecord) -> str:
        return show.timestamp(record.started_at)

    @admin.display(description=_("last seen"), ordering="last_seen_at")
    def last_seen(self, record: WorkerRecord) -> str:
        ago = (timezone.now() - record.last_seen_at).total_seconds()
        return f"{show.short_duration(ago)} ago"
