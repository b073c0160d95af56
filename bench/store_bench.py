"""Micro-benchmark of the attempt store: attempts' writes through a few writer connections
(group commit) against today's path, a thread and a connection per attempt.

    python -m bench.store_bench [--attempts 1000] [--writes 5] [--threads 48] [--runs 3000]
                                [--writers 2]

PostgreSQL: DATABASE_URL names the database, else BENCH_PG_URL the server (database
`agentruns_store_bench`, created and migrated on first use). Three figures:

- `store`: N coroutines on one event loop, each `await store.acall(EmitWrite)` W times;
- `threads`: the same writes through `transitions.emit`, each attempt on a pool thread
  holding its own connection (today's path for an async attempt), T threads;
- `agent`: an LLM-shaped agent, R runs at concurrency N through the store: three
  0.4 s model waits, an emit after each, one checkpoint, then its success.

Connections are the peak of the database's sessions while a figure is taken (the store's
writers stay open throughout, so `threads` counts them too).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import django
import psycopg
from django.conf import settings

WORKER = "store-bench:1:0000"


def configure() -> str:
    import environ

    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        server = os.environ.get("BENCH_PG_URL", "postgres://postgres@127.0.0.1:5432")
        url = f"{server.rstrip('/')}/agentruns_store_bench"
    db = environ.Env.db_url_config(url)
    db["CONN_MAX_AGE"] = None
    admin = psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True)
    if not admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db["NAME"]]).fetchone():
        admin.execute(f'CREATE DATABASE "{db["NAME"]}"')
    admin.close()
    settings.configure(
        DATABASES={"default": db}, USE_TZ=True, SECRET_KEY="store-bench",
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth",
                        "django_agentruns"],
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField", AGENTRUNS={"LEASE_TTL": 600.0})
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return str(db["NAME"])


class Connections:
    """Peak count of the benchmark database's sessions, sampled from outside it."""

    def __init__(self, name: str) -> None:
        self.name, self.peak, self._stop = name, 0, threading.Event()
        url = settings.DATABASES["default"]
        self._conn = psycopg.connect(host=url["HOST"], port=url["PORT"] or 5432,
                                     user=url["USER"], dbname="postgres", autocommit=True)
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Connections:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._conn.close()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            row = self._conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s",
                                     [self.name]).fetchone()
            self.peak = max(self.peak, row[0] if row else 0)


def claimed(count: int) -> list[Any]:
    from django.db import connection

    from django_agentruns import transitions
    from django_agentruns.models import AgentRun, RunEvent
    from django_agentruns.transitions import AttemptRef, NewRun, ScopePolicy

    with connection.cursor() as cursor:  # a fresh table each time: no dead rows to skip
        cursor.execute(f"TRUNCATE {RunEvent._meta.db_table}, {AgentRun._meta.db_table}")
    at = transitions.now()
    new = NewRun(agent="bench.agent", queue="default", priority=0, scope="", fired_seq=0,
                 input={}, input_json="{}", max_requeues=3, available_at=at)
    for start in range(0, count, 1000):
        transitions.insert_runs([new] * min(1000, count - start), at)
    refs = []
    while len(refs) < count:
        runs = transitions.claim(WORKER, ["default"], 500, ScopePolicy(), {}, 600.0,
                                 include_lapsed=False)
        refs += [AttemptRef(r.pk, r.attempt, WORKER, 600.0, r.agent) for r in runs]
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {RunEvent._meta.db_table}, {AgentRun._meta.db_table}")
    return refs


def timed(name: str, db: str, writes: int, body: Callable[[], None], note: str = "") -> None:
    with Connections(db) as conns:
        start = time.perf_counter()
        body()
        took = time.perf_counter() - start
    print(f"{name:8} {writes:7d} writes in {took:6.2f} s = {writes / took:8.0f} writes/s, "
          f"peak {conns.peak:3d} connections {note}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=1000)
    parser.add_argument("--writes", type=int, default=5)
    parser.add_argument("--threads", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--writers", type=int, default=2)
    args = parser.parse_args()
    db = configure()

    from django.db import close_old_connections, connection

    from django_agentruns import transitions
    from django_agentruns.runtime.attempt_store import AttemptStore
    from django_agentruns.transitions import CheckpointWrite, EmitWrite, SucceedWrite

    n, w = args.attempts, args.writes
    refs = claimed(n)
    store = AttemptStore(args.writers)

    async def store_attempt(ref: Any) -> None:
        for i in range(w):
            await store.acall(EmitWrite(ref, uuid.uuid4(), "step", {"i": i}))

    async def store_all() -> None:
        await asyncio.gather(*(store_attempt(r) for r in refs))

    b0, w0 = store.batches, store.writes
    timed("store", db, n * w, lambda: asyncio.run(store_all()),
          f"(writers {args.writers})")
    print(f"         {store.batches - b0} transactions for {store.writes - w0} writes")

    refs = claimed(n)

    def thread_attempt(ref: Any) -> None:
        for i in range(w):
            transitions.emit(ref, uuid.uuid4(), "step", {"i": i})

    def threads_all() -> None:
        with ThreadPoolExecutor(args.threads, initializer=close_old_connections) as pool:
            list(pool.map(thread_attempt, refs))
            # Each thread closes its connection: one task per thread, held at a barrier.
            everyone = threading.Barrier(args.threads)
            list(pool.map(lambda _: (everyone.wait(), connection.close()),
                          range(args.threads)))

    timed("threads", db, n * w, threads_all, f"(threads {args.threads})")

    refs = claimed(args.runs)
    done = [0]

    async def agent(ref: Any) -> None:
        for i in range(3):
            await asyncio.sleep(0.4)  # the model call
            await store.acall(EmitWrite(ref, uuid.uuid4(), "llm.reply", {"turn": i}))
        await store.acall(CheckpointWrite(ref, {"turn": 3}, 1))
        await store.acall(SucceedWrite(ref, {"ok": True}))
        done[0] += 1

    async def agents() -> None:
        slots = asyncio.Semaphore(n)

        async def one(ref: Any) -> None:
            async with slots:
                await agent(ref)

        await asyncio.gather(*(one(r) for r in refs))

    start = time.perf_counter()
    timed("agent", db, args.runs * 5, lambda: asyncio.run(agents()),
          f"(concurrency {n})")
    took = time.perf_counter() - start
    print(f"         {done[0] / took:.0f} runs/s, {done[0] * 3 / took:.0f} events/s "
          f"(ideal {n / 1.2:.0f} runs/s)")
    store.close()


if __name__ == "__main__":
    main()
