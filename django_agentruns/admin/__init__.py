"""The operations console: the run list, the read-only run page, retry and cancel.

Laid out as Django lays out its own admin: `options` (the ModelAdmin and its URLs),
`filters` (list filters), `display` (rendering), `actions` (retry/cancel through the API,
bulk actions), `views` (buttons, overview, fork, queue pause), `chart` (the overview's SVG),
`workers` (the workers page), `schedules` (the schedules' own admin), `limits` (the
limits per key, written through `set_limit`, and usage totals). Django's admin
autodiscovery imports this
package, which registers the run admin. Nobody adds, edits or deletes a run or an event
here; status changes only through `api`.
"""

from __future__ import annotations

from django.contrib import admin

from ..models import AgentLimit, AgentRun, Schedule, WorkerRecord
from .limits import AgentLimitAdmin
from .options import AgentRunAdmin
from .schedules import ScheduleAdmin
from .workers import WorkerRecordAdmin

admin.site.register(AgentRun, AgentRunAdmin)
admin.site.register(WorkerRecord, WorkerRecordAdmin)
admin.site.register(Schedule, ScheduleAdmin)
admin.site.register(AgentLimit, AgentLimitAdmin)

__all__ = ["AgentLimitAdmin", "AgentRunAdmin", "ScheduleAdmin", "WorkerRecordAdmin"]
