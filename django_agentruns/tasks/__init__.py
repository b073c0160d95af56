"""A backend for Django's tasks framework: any `@task` function runs as a durable run.

    TASKS = {"default": {"BACKEND": "django_agentruns.tasks.AgentRunsBackend"}}

Importing this package registers the internal agents that run the tasks; the app config
imports it when TASKS names this backend, so `runworker` runs tasks with no other setup.
Works with `django.tasks` (Django >= 6.0) or the `django-tasks` backport (Django 5.2); with
neither, this package imports but `AgentRunsBackend` refuses to be built
(`TASKS_AVAILABLE` is False).
"""

from __future__ import annotations

from .backend import AgentRunsBackend
from .compat import TASKS_AVAILABLE, UNAVAILABLE_REASON
from .results import ASYNC_AGENT, SYNC_AGENT, TASK_AGENTS
from .runner import run_async_task, run_task

__all__ = [
    "ASYNC_AGENT",
    "SYNC_AGENT",
    "TASKS_AVAILABLE",
    "TASK_AGENTS",
    "UNAVAILABLE_REASON",
    "AgentRunsBackend",
    "run_async_task",
    "run_task",
]
