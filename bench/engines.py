"""The three engines as the harness drives them: worker command lines and queue tables.

Each worker runs at its engine's defaults except where a setting makes the engines
comparable: every one polls an idle queue once a second (ours and procrastinate are also
woken by LISTEN/NOTIFY; django-tasks-db only polls).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Engine:
    key: str
    label: str
    table: str
    pending: tuple[str, str]
    """Statuses of runs not finished yet: queued and running."""
    concurrent: bool
    """Whether one worker process runs several jobs at once."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment of this engine's worker processes (a settings variant)."""

    def worker(self, concurrency: int, burst: bool, processes: int = 1) -> list[str]:
        """`python -m django ...` for one worker command; `burst` exits once idle; ours
        alone runs `processes` > 1 (`runworker --processes`)."""
        django = [sys.executable, "-m", "django"]
        if self.key == "ours":
            return [*django, "runworker", "--queues", "default", "--concurrency",
                    str(concurrency), *(["--processes", str(processes)] if processes > 1
                                        else []), *(["--burst"] if burst else [])]
        if processes > 1:
            raise ValueError(f"{self.key}: one process per worker command")
        if self.key == "dtdb":
            # One task at a time per process: db_worker has no concurrency setting.
            return [*django, "db_worker", "--queue-name", "default", "--interval", "1",
                    "--no-startup-delay", "--no-reload", *(["--batch"] if burst else [])]
        if self.key == "procrastinate":
            return [*django, "procrastinate", "worker", "--queues", "default",
                    "--concurrency", str(concurrency), "--fetch-job-polling-interval", "1",
                    *(["--one-shot"] if burst else [])]
        raise ValueError(self.key)

    def pending_sql(self) -> str:
        return (f"SELECT count(*) FROM {self.table} "
                f"WHERE status IN ('{self.pending[0]}', '{self.pending[1]}')")


OURS = Engine("ours", "django-agentruns (ours)", "django_agentruns_agentrun",
              ("queued", "running"), concurrent=True)
DTDB = Engine("dtdb", "django-tasks-db", "django_tasks_database_dbtaskresult",
              ("READY", "RUNNING"), concurrent=False)
PROCRASTINATE = Engine("procrastinate", "procrastinate", "procrastinate_jobs",
                       ("todo", "doing"), concurrent=True)

# Ours with Django's psycopg pool of 16 connections instead of one persistent connection
# per thread (an attempt thread holds a connection only while it settles).
OURS_POOL = Engine("ours", "django-agentruns + pool", OURS.table, OURS.pending,
                   concurrent=True, env=(("BENCH_DB_POOL", "16"),))

ENGINES = (OURS, DTDB, PROCRASTINATE)
PEERS = (DTDB, PROCRASTINATE)
