"""How a Django task is kept in a run, and read back as Django's `TaskResult`.

A task is a run of one of two internal agents (sync and async functions), whose input
names the task by module path with its JSON args and kwargs. Everything a `TaskResult`
shows is read from the run and its lifecycle events; nothing is stored twice.

| run status | TaskResultStatus |
| --- | --- |
| queued (new, backing off, retried by an operator) | READY |
| running | RUNNING |
| succeeded | SUCCESSFUL |
| failed (dead letter) | FAILED |
| cancelled | FAILED, the cancellation (with its reason) the last of `errors` |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from . import compat

if TYPE_CHECKING:
    from ..models import AgentRun

SYNC_AGENT = "django.tasks"
"""Runs sync `@task` functions."""
ASYNC_AGENT = "django.tasks.async"
"""Runs `async def` `@task` functions on the worker's event loop, so a cancel interrupts them."""
TASK_AGENTS = (SYNC_AGENT, ASYNC_AGENT)

CANCELLED_ERROR_PATH = "django_agentruns.exceptions.RunCancelledError"
# An abandoned attempt (its worker died or stopped) has no exception of its own.
ABANDONED_ERROR_PATH = "django_agentruns.exceptions.AttemptStopped"


def task_input(
    task: compat.Task[Any, Any], args: list[Any], kwargs: dict[str, Any], alias: str
) -> dict[str, Any]:
    """The run's input: enough to import the task and call it as it was enqueued."""
    return {
        "task": task.module_path,
        "args": args,
        "kwargs": kwargs,
        "backend": alias,
        "run_after": task.run_after.isoformat() if task.run_after is not None else None,
    }


def load_task(path: Any) -> compat.Task[Any, Any]:
    """The `Task` at `path`. ImproperlyConfigured (never retried) if there is none here.

    The path comes from the run's input, which is data: only a module of an installed app is
    imported, so a crafted run cannot make a worker (or `get_result`) import anything else.
    """
    if not compat.TASKS_AVAILABLE:
        raise ImproperlyConfigured(compat.UNAVAILABLE_REASON)
    module, _, name = str(path).rpartition(".")
    if not name or not in_installed_app(module):
        raise ImproperlyConfigured(
            f"Task {str(path)[:300]!r} is not in an installed app: only tasks defined in the "
            "modules of INSTALLED_APPS are run")
    try:
        found = import_string(str(path))
    except Exception as exc:  # ImportError, or the task module failing as it imports
        raise ImproperlyConfigured(
            f"Task {path!r} cannot be imported in this process: "
            f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(found, compat.Task):
        raise ImproperlyConfigured(f"{path!r} is not a task: decorate it with @task")
    return found


def in_installed_app(module: str) -> bool:
    """Whether `module` is an installed app's package or inside one (checked, not imported)."""
    return any(module == config.name or module.startswith(f"{config.name}.")
               for config in apps.get_app_configs())


def as_enqueued(task: compat.Task[Any, Any], run: AgentRun) -> compat.Task[Any, Any]:
    """The task with the priority, queue, run_after and backend it was enqueued with."""
    payload = run.input if isinstance(run.input, dict) else {}
    run_after = payload.get("run_after")
    try:
        return task.using(
            priority=run.priority, queue_name=run.queue,
            run_after=datetime.fromisoformat(run_after) if run_after else None,
            backend=str(payload.get("backend") or task.backend))
    except (compat.InvalidTask, ImproperlyConfigured, ValueError):
        # This process's TASKS cannot validate it as enqueued (a worker without TASKS, or
        # an alias since removed): the task as its module defines it still runs.
        return task


def task_status(status: str) -> compat.TaskResultStatus:
    from ..models import Status

    statuses = compat.TaskResultStatus
    mapping: dict[str, compat.TaskResultStatus] = {
        Status.QUEUED: statuses.READY,
        Status.RUNNING: statuses.RUNNING,
        Status.SUCCEEDED: statuses.SUCCESSFUL,
        Status.FAILED: statuses.FAILED,
        Status.CANCELLED: statuses.FAILED,
    }
    return mapping[status]


@dataclass
class History:
    """What the run's lifecycle events say about its attempts."""

    worker_ids: list[str] = field(default_factory=list)
    first_started: datetime | None = None
    errors: list[compat.TaskError] = field(default_factory=list)


def history(run: AgentRun) -> History:
    """Worker ids (one per attempt, so `TaskContext.attempt` is the attempt number), the
    first start, and one error per failed attempt, then the cancellation if any.

    Events keep an error's class and message; the latest error's traceback is on the run.
    """
    from .. import transitions
    from ..models import RunEvent

    events = RunEvent.objects.filter(
        run_id=run.pk, type__in=(transitions.STARTED, transitions.RETRYING,
                                 transitions.DEAD_LETTERED, transitions.CANCELLED),
    ).order_by("seq").values_list("type", "payload", "attempt", "created_at")
    workers: dict[int, str] = {}
    result = History()
    last_failure: tuple[int, str] | None = None
    for type_, payload, attempt, created_at in events:
        payload = payload if isinstance(payload, dict) else {}
        if type_ == transitions.STARTED:
            workers[attempt] = str(payload.get("worker", ""))
            result.first_started = result.first_started or created_at
        elif type_ == transitions.CANCELLED:
            result.errors.append(cancelled_error(str(payload.get("reason", ""))))
        elif payload.get("error_type"):
            error_type = str(payload["error_type"])
            last_failure = (len(result.errors), error_type)
            result.errors.append(compat.TaskError(
                exception_class_path=exception_path(error_type),
                traceback=f"{error_type}: {payload.get('message', '')}"))
    if last_failure is not None and run.error_traceback and run.error_type == last_failure[1]:
        index, _ = last_failure
        result.errors[index] = compat.TaskError(
            exception_class_path=result.errors[index].exception_class_path,
            traceback=run.error_traceback)
    result.worker_ids = [workers.get(n, "") for n in range(1, run.attempt + 1)]
    return result


def exception_path(error_type: str) -> str:
    """A dotted path `TaskError.exception_class` can import, from a run's error type."""
    if error_type == "AbandonedAttempt":
        return ABANDONED_ERROR_PATH
    return error_type if "." in error_type else f"builtins.{error_type}"


def cancelled_error(reason: str) -> compat.TaskError:
    detail = f": {reason}" if reason else ""
    return compat.TaskError(exception_class_path=CANCELLED_ERROR_PATH,
                            traceback=f"{CANCELLED_ERROR_PATH}: the run was cancelled{detail}")


def read_result(run: AgentRun, task: compat.Task[Any, Any] | None = None) -> compat.TaskResult[
        Any, Any]:
    """The run as Django's TaskResult: one query (its events), plus importing the task
    unless the caller has it."""
    from ..models import TERMINAL, Status

    payload = run.input if isinstance(run.input, dict) else {}
    if task is None:
        task = as_enqueued(load_task(payload.get("task")), run)
    past = history(run)
    finished = run.status in TERMINAL
    result: compat.TaskResult[Any, Any] = compat.TaskResult(
        task=task,
        id=str(run.pk),
        status=task_status(run.status),
        enqueued_at=run.created_at,
        started_at=past.first_started or run.started_at,
        last_attempted_at=run.started_at,
        finished_at=run.finished_at if finished else None,
        args=list(payload.get("args") or []),
        kwargs=dict(payload.get("kwargs") or {}),
        backend=str(payload.get("backend") or task.backend),
        errors=past.errors,
        worker_ids=past.worker_ids,
    )
    if run.status == Status.SUCCEEDED:
        object.__setattr__(result, "_return_value", run.output)
    return result
