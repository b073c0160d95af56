"""The chaos harness's helpers: the limit-key sampler, queries that survive a restart,
worker processes' ids and signals, waiting for PostgreSQL to answer again."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from django.db import DatabaseError, InterfaceError, connection, connections
from django.db.models import Count

from django_agentruns.models import AgentRun, Status
from tests import helpers

T = TypeVar("T")


class KeySampler:
    """Samples, from the database while the chaos runs, how many runs of each limited key
    are running: the invariant that a key's limit is never exceeded, at any moment."""

    def __init__(self, limits: dict[str, int], every: float = 0.02) -> None:
        self.limits = limits
        self.every = every
        self.samples = 0
        self.peaks: dict[str, int] = dict.fromkeys(limits, 0)
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="key-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.every):
                counts = guarded(lambda: dict(
                    AgentRun.objects.filter(status=Status.RUNNING, limit_key__in=self.limits)
                    .order_by().values_list("limit_key").annotate(n=Count("id"))), None)
                if counts is None:
                    continue
                self.samples += 1
                for key, n in counts.items():
                    self.peaks[key] = max(self.peaks[key], n)
                    if n > self.limits[key] and len(self.violations) < 20:
                        self.violations.append(f"{n} runs of key {key!r} running at once, "
                                               f"its limit is {self.limits[key]}")
        finally:
            connection.close()  # this thread's own connection


def guarded(func: Callable[[], T], default: T) -> T:
    """A query from the harness: on a database error (a restart) close and carry on."""
    try:
        return func()
    except (DatabaseError, InterfaceError):
        connections.close_all()
        return default


def _pids(worker_ids: Iterable[str]) -> set[int]:
    """The process ids in worker ids of the form host:pid:random."""
    return {int(w.split(":")[-2]) for w in worker_ids if w.count(":") >= 2}


def _thaw(worker: helpers.ManageProcess) -> None:
    if worker.popen.poll() is None:
        worker.send_signal(signal.SIGCONT)


def _outcomes() -> dict[str, int]:
    rows = AgentRun.objects.values_list("status", "reason")
    counts: dict[str, int] = {}
    for status, reason in rows:
        key = f"{status}/{reason}" if status == Status.FAILED else status
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _connection_params() -> dict[str, Any]:
    params = dict(connection.get_connection_params())
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return params


def wait_for_postgres(params: dict[str, Any], timeout: float = 60) -> None:
    import psycopg

    def answers() -> bool:
        try:
            psycopg.connect(**{**params, "connect_timeout": 2}).close()
        except psycopg.Error:
            return False
        return True

    helpers.wait_until(answers, timeout=timeout, interval=0.2,
                       message="PostgreSQL to answer again after the restart")


def default_restart_mode() -> str:
    """``CHAOS_PG_RESTART`` = terminate (default) | cluster | none ("pgbouncer" is chosen by
    the test that puts a PgBouncer in front, not by this variable).

    "terminate" ends only this database's sessions: the machine's server, shared with other
    work, is never restarted. "cluster" restarts a real server: a private one the test
    starts itself (tests/private_postgres.py), never the machine's.
    """
    mode = os.environ.get("CHAOS_PG_RESTART", "terminate")
    if mode not in ("cluster", "terminate", "none"):
        raise ValueError(f"CHAOS_PG_RESTART must be cluster, terminate or none, not {mode!r}")
    return mode
