"""What the tests of Django's tasks framework on the engine share: the backend setting and
small helpers (the `tasks` and `received` fixtures are in tests/conftest.py)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.test import override_settings

from django_agentruns.models import AgentRun
from django_agentruns.runtime.worker import Worker, WorkerStats

BACKEND = "django_agentruns.tasks.AgentRunsBackend"
TASKS = {"default": {"BACKEND": BACKEND}}


def work(**options: Any) -> WorkerStats:
    """Run everything due in this process, then return."""
    return Worker(burst=True, **options).run(install_signals=False)


def run_of(result: Any) -> AgentRun:
    return AgentRun.objects.get(pk=int(result.id))


def agentruns(**overrides: Any) -> override_settings:
    return override_settings(AGENTRUNS={**settings.AGENTRUNS, **overrides})
