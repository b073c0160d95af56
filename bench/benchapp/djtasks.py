"""Django tasks (run by django-tasks-db's `db_worker`) for the benchmark."""

from __future__ import annotations

import asyncio
import time
from typing import Any

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the django-tasks backport (django-tasks-db[compat])
    from django_tasks import task  # type: ignore[no-redef]

from .probe import record_start


@task()
def noop() -> None:
    return None


@task()
def sleep_sync() -> None:
    time.sleep(0.1)


@task()
async def sleep_async() -> None:
    await asyncio.sleep(0.1)


@task()
def latency(token: str, t0: float) -> None:
    record_start({"token": token, "t0": t0})


TASKS: dict[str, Any] = {"noop": noop, "sleep_sync": sleep_sync, "sleep_async": sleep_async,
                         "latency": latency}
