"""`AgentRunsBackend`: Django's tasks framework on django-agentruns.

    TASKS = {"default": {"BACKEND": "django_agentruns.tasks.AgentRunsBackend"}}

Every `@task` then runs as a durable run: leases, retries, dead letters, cancellation.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from inspect import iscoroutinefunction
from typing import Any

from django.apps import apps
from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils import timezone

from . import compat
from .results import (
    ASYNC_AGENT,
    SYNC_AGENT,
    TASK_AGENTS,
    in_installed_app,
    read_result,
    task_input,
)

QUEUE_MAX = 100  # AgentRun.queue's length
E008_APP_NOT_INSTALLED = "agentruns.E008"


class AgentRunsBackend(compat.BaseTaskBackend):
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        if not compat.TASKS_AVAILABLE:
            raise ImproperlyConfigured(compat.UNAVAILABLE_REASON)
        super().__init__(alias, params)

    def check(self, **kwargs: Any) -> list[CheckMessage]:
        """The backend is configured but the app is not installed: no table, no worker."""
        messages = list(super().check(**kwargs))
        if not apps.is_installed("django_agentruns"):
            messages.append(Error(
                f"TASKS[{self.alias!r}] uses django_agentruns.tasks.AgentRunsBackend but "
                "'django_agentruns' is not in INSTALLED_APPS.",
                hint="Add 'django_agentruns' to INSTALLED_APPS and run migrate.",
                id=E008_APP_NOT_INSTALLED))
        return messages

    def validate_task(self, task: compat.Task[Any, Any]) -> None:
        super().validate_task(task)
        if not task.queue_name or len(task.queue_name) > QUEUE_MAX or "\x00" in task.queue_name:
            raise compat.InvalidTask(f"Queue name must be 1-{QUEUE_MAX} characters with no "
                                     f"NUL, not {task.queue_name[:50]!r}.")

    def enqueue(
        self, task: compat.Task[Any, Any], args: Any, kwargs: Any
    ) -> compat.TaskResult[Any, Any]:
        """Queue a run of the task in the caller's transaction: roll back and it never existed.

        `task_enqueued` is sent once that transaction commits (at once in autocommit).
        """
        from .. import api

        self.validate_task(task)
        _check_importable(task)
        result: compat.TaskResult[Any, Any] = compat.TaskResult(
            task=task, id="", status=compat.TaskResultStatus.READY, enqueued_at=None,
            started_at=None, last_attempted_at=None, finished_at=None,
            args=list(args), kwargs=dict(kwargs),  # normalised to JSON by TaskResult
            backend=self.alias, errors=[], worker_ids=[])
        run = api.enqueue(
            ASYNC_AGENT if iscoroutinefunction(task.func) else SYNC_AGENT,
            input=task_input(task, result.args, result.kwargs, self.alias),
            queue=task.queue_name, priority=task.priority, run_after=_due(task.run_after))
        object.__setattr__(result, "id", str(run.pk))
        object.__setattr__(result, "enqueued_at", run.created_at)
        sender = type(self)
        transaction.on_commit(lambda: compat.task_enqueued.send(sender, task_result=result))
        return result

    def get_result(self, result_id: str) -> compat.TaskResult[Any, Any]:
        """The task's result as it stands. TaskResultDoesNotExist for any id not a task's."""
        from ..models import AgentRun

        run_id = _run_id(result_id)
        run = None if run_id is None else \
            AgentRun.objects.filter(pk=run_id, agent__in=TASK_AGENTS).first()
        if run is None:
            raise compat.TaskResultDoesNotExist(result_id)
        return read_result(run)


def _check_importable(task: compat.Task[Any, Any]) -> None:
    """The worker imports the task by its path: refuse now, not there, if that will fail."""
    from django.utils.module_loading import import_string

    if not in_installed_app(task.func.__module__):
        raise compat.InvalidTask(
            f"Task {task.module_path!r} is not in an installed app: workers run only tasks "
            "defined in the modules of INSTALLED_APPS.")
    try:
        found = import_string(task.module_path)
    except ImportError:
        found = None
    if getattr(found, "func", None) is not task.func:
        raise compat.InvalidTask(
            f"Task {task.module_path!r} cannot be imported by that path: define it at module "
            "level with @task under its function's own name.")


def _due(run_after: datetime | None) -> datetime | timedelta | None:
    if run_after is None or timezone.is_aware(run_after):
        return run_after
    # Naive only when USE_TZ is False (Django refuses it otherwise): local wall time.
    return run_after - timezone.now()


def _run_id(result_id: Any) -> int | None:
    text = str(result_id)
    if not text.isascii() or not text.isdigit():
        return None
    value = int(text)
    return value if 0 < value < 2**63 else None
