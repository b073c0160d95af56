from __future__ import annotations

import warnings
from collections.abc import Iterator

import django
import pytest
from django.conf import settings
from django.db import connection

from tests import helpers


def _engine_vendor() -> str:
    return connection.vendor  # "sqlite" or "postgresql"; reading it opens no connection


def pytest_report_header(config: pytest.Config) -> list[str]:
    db = settings.DATABASES["default"]
    test_name = db.get("TEST", {}).get("NAME") or f"test_{db['NAME']}"  # Django's default
    where = db["NAME"] if _engine_vendor() == "sqlite" else f"{db.get('HOST')}:{db.get('PORT')}"
    return [
        f"agentruns: Django {django.get_version()}, database {_engine_vendor()} "
        f"({where}; test database {test_name})",
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    vendor = _engine_vendor()
    only_postgres = pytest.mark.skip(reason="postgres_only: this run uses sqlite")
    only_sqlite = pytest.mark.skip(reason="sqlite_only: this run uses postgresql")
    for item in items:
        if vendor != "postgresql" and item.get_closest_marker("postgres_only"):
            item.add_marker(only_postgres)
        if vendor != "sqlite" and item.get_closest_marker("sqlite_only"):
            item.add_marker(only_sqlite)


@pytest.fixture
def worker_env(transactional_db: None) -> Iterator[dict[str, str]]:
    """Environment for a ``python -m django ...`` subprocess on this test's database.

    Needs ``transactional_db``: a subprocess sees committed rows only, so the test must not
    run inside a transaction that is rolled back. Processes started with
    ``helpers.start_manage`` and still alive at teardown are killed *before* the database is
    flushed (or, on PostgreSQL, dropped), and the test is warned about them.
    """
    yield helpers.subprocess_env(connection.settings_dict)
    leftovers = helpers.close_all_started()
    if leftovers:
        warnings.warn(f"killed subprocesses still running at teardown: {leftovers}", stacklevel=1)
