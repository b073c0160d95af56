"""Django `@task` functions the tasks-backend tests run on the engine.

Imported only where `django.tasks` (or the django-tasks backport) is available.
"""

from __future__ import annotations

import asyncio
from typing import Any

from django_agentruns import NotRetryable, Retryable
from django_agentruns.tasks.compat import TaskContext, task

from .models import SideEffect


@task
def add(a: int, b: int) -> int:
    return a + b


@task
def echo(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Returns a tuple inside: Django normalises return values to JSON (a list)."""
    return {"args": args, "kwargs": kwargs, "pair": (1, 2)}


@task(takes_context=True)
def note(context: TaskContext, label: str) -> str:
    """Records one SideEffect per execution, labelled, so tests see the order of runs."""
    SideEffect.objects.create(run_id=int(context.task_result.id), note=label,
                              attempt=context.attempt)
    return label


@task(takes_context=True)
def flaky(context: TaskContext, succeed_on: int = 2) -> dict[str, Any]:
    """Fails retryably until attempt `succeed_on`, then says which attempt it was."""
    if context.attempt < succeed_on:
        raise Retryable(f"transient failure on attempt {context.attempt}")
    return {"attempt": context.attempt, "worker_ids": context.task_result.worker_ids}


@task
def refuse() -> None:
    raise NotRetryable("bad request: the ticket does not exist")


@task
def explode() -> None:
    """An error nothing recognises: retried (UNKNOWN_ERRORS_RETRYABLE) until the budget ends."""
    raise ValueError("boom")


@task
def not_json() -> Any:
    return object()


@task
async def multiply(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a * b


@task(takes_context=True)
async def async_flaky(context: TaskContext) -> dict[str, Any]:
    await asyncio.sleep(0)
    if context.attempt < 2:
        raise Retryable("async transient failure")
    return {"attempt": context.attempt}


@task
async def sleep_long(seconds: float = 30) -> str:
    """Awaits for a long time: a cancel has to interrupt it for a test to end in time."""
    await asyncio.sleep(seconds)
    return "slept"


@task(takes_context=True)
def lose_lease(context: TaskContext) -> str:
    """Returns after another worker took its run over (as a reclaim after a lapsed lease
    would): the worker's write is fenced off, so nothing is recorded for this attempt."""
    from django_agentruns.models import AgentRun

    AgentRun.objects.filter(pk=int(context.task_result.id)).update(claimed_by="another-worker")
    return "too late"


def _unreachable() -> None:
    """Wrapped below under another name, so its module path does not lead to a task."""


misnamed = task(_unreachable)


@task
def exits(code: int = 3) -> None:
    """Calls sys.exit: the task's failure, as any exception (the worker goes on)."""
    raise SystemExit(code)


@task
def interrupted() -> None:
    raise KeyboardInterrupt
