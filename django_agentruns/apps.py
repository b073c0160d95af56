from __future__ import annotations

from importlib import import_module

from django.apps import AppConfig
from django.conf import settings
from django.utils.module_loading import autodiscover_modules

TASKS_BACKEND_MODULE = "django_agentruns.tasks"


class AgentRunsConfig(AppConfig):
    name = "django_agentruns"
    verbose_name = "Agent runs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401 - registers the system checks
        from .ops import pooling, replica  # noqa: F401 - registers theirs

        # Like admin.py: every installed app's agents module registers its agents.
        autodiscover_modules("agents")
        if uses_tasks_backend():
            # Registers the agents that run @task functions. A worker never builds a task
            # backend, so nothing else would import it before the worker lists its agents.
            import_module(TASKS_BACKEND_MODULE)


def uses_tasks_backend() -> bool:
    """Whether settings.TASKS names django_agentruns.tasks.AgentRunsBackend."""
    tasks = getattr(settings, "TASKS", None)
    return isinstance(tasks, dict) and any(
        isinstance(conf, dict) and str(conf.get("BACKEND", "")).startswith(TASKS_BACKEND_MODULE)
        for conf in tasks.values())
