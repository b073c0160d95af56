"""The operations console: the run list, the read-only run page, retry and cancel.

Laid out as Django lays out its own admin: `options` (the ModelAdmin and its URLs),
`filters` (list filters), `display` (rendering), `actions` (retry/cancel through the API,
bulk actions), `views` (buttons, overview). Django's admin autodiscovery imports this
package, which registers the run admin. Nobody adds, edits or deletes a run or an event
here; status changes only through `api`.
"""

from __future__ import annotations

from django.contrib import admin

from ..models import AgentLimit, AgentRun
from .limits import AgentLimitAdmin
from .options import AgentRunAdmin

admin.site.register(AgentRun, AgentRunAdmin)
admin.site.register(AgentLimit, AgentLimitAdmin)

__all__ = ["AgentLimitAdmin", "AgentRunAdmin"]
