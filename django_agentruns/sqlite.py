"""The SQLite database OPTIONS workers need; importable from a settings module.

    DATABASES["default"]["OPTIONS"] = {**SQLITE_OPTIONS}
"""

from __future__ import annotations

from typing import Any

SQLITE_OPTIONS: dict[str, Any] = {
    # Writers take the lock at BEGIN and wait up to `timeout` for it, instead of failing at
    # once with "database is locked" when a read transaction tries to upgrade (Django 5.1+).
    "transaction_mode": "IMMEDIATE",
    "timeout": 30,
    # WAL: readers (the admin, other workers) run while a worker writes.
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
}
