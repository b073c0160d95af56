"""PostgreSQL administration for the harness: fresh databases from a migrated template,
and the server's own counters (`pg_stat_database`) read from outside the measured database.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVER_URL = os.environ.get("BENCH_PG_URL", "postgres://postgres@127.0.0.1:5432")
PREFIX = os.environ.get("BENCH_DB_PREFIX", "agentruns_bench")
TEMPLATE = f"{PREFIX}_tpl"


def db_url(name: str) -> str:
    return f"{SERVER_URL.rstrip('/')}/{name}"


def django_env(database_url: str, **extra: str) -> dict[str, str]:
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "DATABASE_URL": database_url, "DJANGO_SETTINGS_MODULE": "bench.settings",
            "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", **extra}


def migrate(database_url: str) -> None:
    subprocess.run([sys.executable, "-m", "django", "migrate", "--verbosity", "0"],
                   env=django_env(database_url), cwd=REPO_ROOT, check=True)


@dataclass(frozen=True)
class DbStats:
    commits: int
    rows_written: int  # tuples inserted + updated + deleted


class Admin:
    """One autocommit connection to the `postgres` database: its own queries are never
    counted against the database being measured."""

    def __init__(self) -> None:
        self._conn = psycopg.connect(db_url("postgres"), autocommit=True)

    def close(self) -> None:
        self._conn.close()

    def execute(self, query: Any, params: Any = None) -> Any:
        """Execute on the admin connection; if the server dropped it (a restart by someone
        else on a shared server), wait for the server, reconnect and try once more."""
        try:
            return self._conn.execute(query, params)
        except psycopg.OperationalError:
            deadline = time.monotonic() + 60
            while True:
                try:
                    self._conn = psycopg.connect(db_url("postgres"), autocommit=True)
                    break
                except psycopg.OperationalError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1)
            return self._conn.execute(query, params)

    def value(self, query: str) -> str:
        row = self.execute(query).fetchone()
        return "" if row is None else str(row[0])

    def drop(self, name: str) -> None:
        self.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))

    def make_template(self) -> None:
        """Create and migrate the template every fresh database is copied from."""
        self.drop(TEMPLATE)
        self.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(TEMPLATE)))
        migrate(db_url(TEMPLATE))

    def fresh(self, name: str) -> str:
        """A new database copied from the migrated template; returns its URL."""
        self.drop(name)
        self.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(TEMPLATE)))
        return db_url(name)

    def wait_idle(self, name: str, timeout: float = 30.0) -> None:
        """Until no session is connected to `name`; a backend flushes its counters as it
        exits, a moment after it leaves pg_stat_activity, hence the short pause."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            n = self.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s",
                             [name]).fetchone()
            if n is not None and n[0] == 0:
                break
            time.sleep(0.05)
        time.sleep(0.3)

    def stats(self, name: str) -> DbStats:
        self.execute("SELECT pg_stat_clear_snapshot()")
        row = self.execute(
            "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted "
            "FROM pg_stat_database WHERE datname = %s", [name]).fetchone()
        assert row is not None
        return DbStats(int(row[0]), int(row[1]))
