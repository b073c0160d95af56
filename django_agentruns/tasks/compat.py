"""Django's tasks framework, from `django.tasks` (Django >= 6.0) or the `django-tasks` backport.

With neither importable this module still imports: `TASKS_AVAILABLE` is False, the names
below are None, and the backend refuses to be built, saying why.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import TYPE_CHECKING, Any


def _importable(name: str) -> bool:
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):  # a parent missing, or a module stubbed out as None
        return False


if TYPE_CHECKING:
    from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus, task, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json

    SOURCE: str | None
elif _importable("django.tasks"):
    from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus, task, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json

    SOURCE = "django.tasks"
elif _importable("django_tasks"):
    from django_tasks import task_backends
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus, task
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
    from django_tasks.signals import task_enqueued, task_finished, task_started
    from django_tasks.utils import normalize_json

    SOURCE = "django_tasks"
else:
    Task = TaskContext = TaskResult = TaskResultStatus = TaskError = None
    task = task_backends = normalize_json = None
    task_enqueued = task_finished = task_started = None
    InvalidTask = TaskResultDoesNotExist = TaskResultMismatch = None

    class BaseTaskBackend:
        """Stands in for Django's base class so the backend class can still be defined."""

        def __init__(self, alias: str, params: dict[str, Any]) -> None:
            self.alias = alias

    SOURCE = None

TASKS_AVAILABLE = SOURCE is not None
UNAVAILABLE_REASON = (
    "django.tasks is not available: it needs Django >= 6.0, or the django-tasks backport "
    "(pip install django-tasks) on Django 5.2"
)

__all__ = [
    "SOURCE",
    "TASKS_AVAILABLE",
    "UNAVAILABLE_REASON",
    "BaseTaskBackend",
    "InvalidTask",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultMismatch",
    "TaskResultStatus",
    "normalize_json",
    "task",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]
