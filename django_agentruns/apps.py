from __future__ import annotations

from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class AgentRunsConfig(AppConfig):
    name = "django_agentruns"
    verbose_name = "Agent runs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401 - registers the system checks

        # Like admin.py: every installed app's agents module registers its agents.
        autodiscover_modules("agents")
