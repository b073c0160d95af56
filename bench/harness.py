"""What every workload of the harness shares: the fresh database of one trial, worker and
client processes, and `run_trial`, which retries a trial once if the server dropped it.
"""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import psutil
import psycopg

from bench.engines import Engine
from bench.pg import PREFIX, REPO_ROOT, Admin, DbStats, db_url, django_env

T = TypeVar("T")

RUN_DB = f"{PREFIX}_run"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)



# --------------------------------------------------------------------------- targets


class Target(Protocol):
    """The fresh database of one trial."""

    url: str
    polls: int

    def open_poller(self) -> None: ...
    def count(self, sql: str) -> int: ...
    def close_poller(self) -> None: ...
    def settle(self) -> None: ...
    def analyze(self) -> None: ...
    def stats(self) -> DbStats | None: ...
    def drop(self) -> None: ...


class PgTarget:
    """A trial's database: by default a fresh copy of the template; `fresh=False` measures
    an existing database as it is (the history bench's filled ones)."""

    def __init__(self, admin: Admin, name: str = RUN_DB, fresh: bool = True) -> None:
        self.admin = admin
        self.name = name
        self.url = admin.fresh(name) if fresh else db_url(name)
        self.polls = 0
        self._conn: psycopg.Connection[Any] | None = None

    def open_poller(self) -> None:
        self._conn = psycopg.connect(self.url, autocommit=True)

    def count(self, sql: str) -> int:
        assert self._conn is not None
        self.polls += 1  # each one is a committed transaction, subtracted from the worker's
        row = self._conn.execute(sql).fetchone()  # type: ignore[arg-type]
        return int(row[0]) if row else 0

    def seconds(self, sql: str) -> float | None:
        """The one number `sql` selects (None for NULL), on the poller's connection."""
        assert self._conn is not None
        row = self._conn.execute(sql).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def close_poller(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def settle(self) -> None:
        self.admin.wait_idle(self.name)

    def analyze(self) -> None:
        """Planner statistics, as autovacuum keeps them for a table in service (a fresh
        table filled in one go has none yet, and its first plans are guesses)."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("ANALYZE")

    def stats(self) -> DbStats:
        return self.admin.stats(self.name)

    def drop(self) -> None:
        self.close_poller()
        self.admin.drop(self.name)


class SqliteTarget:
    def __init__(self, template: Path) -> None:
        self.path = template.with_name("run.sqlite3")
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        shutil.copyfile(template, self.path)
        self.url = f"sqlite:///{self.path}"
        self.polls = 0
        self._conn: sqlite3.Connection | None = None

    def open_poller(self) -> None:
        self._conn = sqlite3.connect(self.path, timeout=30)

    def count(self, sql: str) -> int:
        assert self._conn is not None
        self.polls += 1
        return int(self._conn.execute(sql).fetchone()[0])

    def close_poller(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def settle(self) -> None:
        pass

    def analyze(self) -> None:
        with sqlite3.connect(self.path, timeout=30) as conn:
            conn.execute("ANALYZE")

    def stats(self) -> None:
        return None

    def drop(self) -> None:
        self.close_poller()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)


# --------------------------------------------------------------------------- processes


def client(url: str, engine: Engine, *args: str, env: dict[str, str] | None = None,
           timeout: float = 600) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "bench.client", engine.key, *args],
                          env=env or django_env(url), cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.client {engine.key} {' '.join(args)} failed:\n{proc.stderr}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def start_workers(engine: Engine, count: int, concurrency: int, burst: bool,
                  env: dict[str, str], logfile: Path,
                  processes: int = 1) -> list[subprocess.Popen[bytes]]:
    with open(logfile, "ab") as out:  # each child keeps its own copy of the descriptor
        return [subprocess.Popen(engine.worker(concurrency, burst, processes), env=env,
                                 cwd=REPO_ROOT,
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
                for _ in range(count)]


def stop_workers(workers: Sequence[subprocess.Popen[bytes]], wait_first: float) -> None:
    """Let burst workers exit on their own for `wait_first` s, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + wait_first
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.wait(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    for w in workers:
        try:
            w.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


def peak_rss(handles: list[psutil.Process], peak: int) -> int:
    for h in handles:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, h.memory_info().rss)
    return peak



class CpuMeter(threading.Thread):
    """CPU seconds a trial cost, split three ways: the worker processes (with their
    children: this process's reaped children, so started after the meter and stopped
    before `stop`), the PostgreSQL backends serving the trial's database (found in
    `pg_stat_activity` every 100 ms, each read until it exits: its CPU since it started,
    within the trial), and this harness process (its poller and samplers). Other agents'
    load on the machine is in none of them."""

    def __init__(self, database: str) -> None:
        super().__init__(daemon=True)
        self.database = database
        self.backends: dict[int, float] = {}
        self._children = _cpu(resource.RUSAGE_CHILDREN)
        self._own = _cpu(resource.RUSAGE_SELF)
        self._done = threading.Event()
        self._conn = psycopg.connect(db_url("postgres"), autocommit=True)
        self.start()

    def _sample(self) -> None:
        rows = self._conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s",
                                  [self.database]).fetchall()
        for (pid,) in rows:
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(pid).cpu_times()
                self.backends[pid] = t.user + t.system

    def run(self) -> None:
        while not self._done.wait(0.1):
            with contextlib.suppress(psycopg.Error):
                self._sample()

    def stop(self) -> dict[str, float]:
        """Seconds of CPU: worker, postgres, harness (call once the workers are reaped)."""
        self._done.set()
        self.join(5)
        self._conn.close()
        return {"worker": _cpu(resource.RUSAGE_CHILDREN) - self._children,
                "postgres": sum(self.backends.values()),
                "harness": _cpu(resource.RUSAGE_SELF) - self._own}


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def run_trial(admin: Admin, what: str, fn: Callable[..., T], *args: Any) -> T:
    """`fn(target, *args)` on a fresh database, dropped afterwards; if the server dropped
    a connection meanwhile (a restart), the trial runs once more."""
    for attempt in (1, 2):
        target = PgTarget(admin)
        try:
            return fn(target, *args)
        except (psycopg.OperationalError, RuntimeError) as exc:
            # On a shared server someone may restart PostgreSQL under us: once more.
            if attempt == 2:
                raise
            log(f"{what} failed ({str(exc).strip().splitlines()[-1][:200]}); "
                "trying again in 10 s")
            time.sleep(10)
        finally:
            target.close_poller()
            with contextlib.suppress(psycopg.OperationalError):
                target.drop()
    raise AssertionError("unreachable")
