"""The Django side of the harness: enqueue runs for one engine, in a process of its own.

    python -m bench.client ENGINE ACTION ...    (DATABASE_URL names the database)

Actions (each prints one JSON object on stdout):
  prefill KIND N            queue N runs of KIND (noop, sleep_*, llm_sync, llm_async) in bulk
  enqueue-one N             N no-op runs, each in its own transaction (autocommit, as a view)
  enqueue-bulk N BATCH      N no-op runs, BATCH per transaction with the engine's bulk API
  produce RATE SECONDS WARM open-loop producer of latency runs at RATE per second

Engines: ours (django-agentruns), dtdb (django-tasks-db), procrastinate.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

import django

django.setup()

from django.db import transaction  # noqa: E402

PREFILL_BATCH = 1000


class Client:
    """How one engine enqueues: one run in its own transaction, and a batch in one."""

    def one(self, kind: str, payload: dict[str, Any] | None = None) -> None:
        raise NotImplementedError

    def many(self, kind: str, count: int) -> None:
        raise NotImplementedError


class Ours(Client):
    def one(self, kind: str, payload: dict[str, Any] | None = None) -> None:
        from django_agentruns import enqueue

        enqueue(f"bench.{kind}", input=payload)

    def many(self, kind: str, count: int) -> None:
        from django_agentruns import RunRequest, enqueue_many

        enqueue_many([RunRequest(f"bench.{kind}")] * count)


class DjangoTasksDB(Client):
    """Django's task API has no bulk enqueue: a loop inside one transaction."""

    def one(self, kind: str, payload: dict[str, Any] | None = None) -> None:
        from bench.benchapp.djtasks import TASKS

        TASKS[kind].enqueue(**(payload or {}))

    def prefill(self, kind: str, count: int) -> None:
        """Untimed set-up only: one task enqueued by the backend, its row copied in bulk
        (the enqueue loop takes a few ms a task, too slow to fill 5,000 between trials)."""
        import uuid

        from django_tasks_db.models import DBTaskResult

        from bench.benchapp.djtasks import TASKS

        first = TASKS[kind].enqueue().db_result  # type: ignore[attr-defined]
        fields = [f.attname for f in DBTaskResult._meta.concrete_fields if f.attname != "id"]
        values = {name: getattr(first, name) for name in fields}
        for done in range(1, count, PREFILL_BATCH):
            DBTaskResult.objects.bulk_create(
                [DBTaskResult(id=uuid.uuid4(), **values)
                 for _ in range(min(PREFILL_BATCH, count - done))])

    def many(self, kind: str, count: int) -> None:
        from bench.benchapp.djtasks import TASKS

        task = TASKS[kind]
        with transaction.atomic():
            for _ in range(count):
                task.enqueue()


class Procrastinate(Client):
    def one(self, kind: str, payload: dict[str, Any] | None = None) -> None:
        from bench.benchapp import tasks

        getattr(tasks, kind).defer(**(payload or {}))

    def many(self, kind: str, count: int) -> None:
        from bench.benchapp import tasks

        with transaction.atomic():
            getattr(tasks, kind).batch_defer(*([{}] * count))


CLIENTS: dict[str, Callable[[], Client]] = {
    "ours": Ours, "dtdb": DjangoTasksDB, "procrastinate": Procrastinate,
}


def prefill(client: Client, kind: str, count: int) -> dict[str, Any]:
    start = time.perf_counter()
    if isinstance(client, DjangoTasksDB):
        client.prefill(kind, count)
    else:
        for done in range(0, count, PREFILL_BATCH):
            client.many(kind, min(PREFILL_BATCH, count - done))
    return {"seconds": time.perf_counter() - start}


def enqueue_one(client: Client, count: int) -> dict[str, Any]:
    client.one("noop")  # warm up: connection, imports, first-query caches
    start = time.perf_counter()
    for _ in range(count):
        client.one("noop")
    return {"seconds": time.perf_counter() - start, "count": count}


def enqueue_bulk(client: Client, count: int, batch: int) -> dict[str, Any]:
    client.many("noop", 1)
    start = time.perf_counter()
    for done in range(0, count, batch):
        client.many("noop", min(batch, count - done))
    return {"seconds": time.perf_counter() - start, "count": count}


def produce(client: Client, rate: float, seconds: float, warm: float) -> dict[str, Any]:
    """Open loop: the i-th run is due at start + i/rate, whatever the worker is doing."""
    sent = 0
    total = int(rate * (seconds + warm))
    warm_count = int(rate * warm)
    start = time.monotonic()
    for i in range(total):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        token = f"w{i}" if i < warm_count else f"m{i}"
        client.one("latency", {"token": token, "t0": time.time()})
        sent += 1
    return {"sent": sent, "measured": total - warm_count}


def main(argv: Sequence[str]) -> int:
    engine, action, *args = argv
    client = CLIENTS[engine]()
    if action == "prefill":
        result = prefill(client, args[0], int(args[1]))
    elif action == "enqueue-one":
        result = enqueue_one(client, int(args[0]))
    elif action == "enqueue-bulk":
        result = enqueue_bulk(client, int(args[0]), int(args[1]))
    elif action == "produce":
        result = produce(client, float(args[0]), float(args[1]), float(args[2]))
    else:
        raise SystemExit(f"unknown action {action!r}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
