from __future__ import annotations

import contextlib
import itertools
import os
import warnings
from collections.abc import Iterator
from typing import Any

import django
import pytest
from django.conf import settings
from django.db import connection
from django.test import Client

from tests import browser as browser_support
from tests import fakeprovider, helpers
from tests import pgbouncer as pgb
from tests.test_admin import login, staff


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
    kept, dropped = [], []
    for item in items:
        if _partitioned_needs_rollback(item):
            dropped.append(item)
            continue
        kept.append(item)
        if vendor != "postgresql" and item.get_closest_marker("postgres_only"):
            item.add_marker(only_postgres)
        if vendor != "sqlite" and item.get_closest_marker("sqlite_only"):
            item.add_marker(only_sqlite)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _partitioned_needs_rollback(item: pytest.Item) -> bool:
    """`history_layout`'s partitioned variant of a test that commits: the layout is DDL
    inside the test's rolled-back transaction, so such a test has no partitioned variant
    (not generated, rather than skipped; tests/test_partitions.py covers partitioned
    history with committing workers)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or callspec.params.get("history_layout") != "partitioned":
        return False
    names = getattr(item, "fixturenames", ())
    marker = item.get_closest_marker("django_db")
    return ("transactional_db" in names or "live_server" in names
            or "worker_env" in names
            or (marker is not None and bool(marker.kwargs.get("transaction"))))


@pytest.fixture
def viewer() -> Client:
    """A staff user's admin client that may view runs and nothing more."""
    return login(staff("viewer", "view_agentrun"))


@pytest.fixture
def operator() -> Client:
    """A staff user's admin client that may view, retry and cancel runs (the browser tests
    have an `operator` fixture of their own: a user, for a live server)."""
    return login(staff("operator", "view_agentrun", "retry_agentrun", "cancel_agentrun"))


@pytest.fixture
def browser_available() -> None:
    """The browser tests' gate: a loud skip without chromium or Playwright, a failure in CI."""
    browser_support.require_browser()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Browser tests that could not run are shouted about, as a missing PostgreSQL is; and
    scripts/test.sh is told (the file AGENTRUNS_BROWSER_MARKER names), to say so in its
    last line."""
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if browser_support.MISSING_TAG in str(getattr(r, "longrepr", ""))]
    if not skipped:
        return
    reason = str(skipped[0].longrepr).split(browser_support.MISSING_TAG, 1)[1].strip(" :')")
    terminalreporter.section("BROWSER TESTS SKIPPED", sep="!", red=True, bold=True)
    terminalreporter.write_line(
        f"!!! {len(skipped)} browser test(s) SKIPPED: {reason}", red=True, bold=True)
    terminalreporter.write_line("!!! The admin's buttons were NOT clicked in a real browser. "
                                "Set REQUIRE_BROWSER=1 (CI does) to fail instead.", red=True)
    marker = os.environ.get("AGENTRUNS_BROWSER_MARKER")
    if marker:
        with open(marker, "a") as out:
            out.write(f"{len(skipped)} browser tests skipped: {reason}\n")


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


@pytest.fixture(scope="session")
def pgbouncer() -> Iterator[pgb.PgBouncer]:
    """A private PgBouncer in transaction mode in front of the test server (this session's).

    Missing pgbouncer: the test is skipped with a loud reason, or fails in CI
    (`REQUIRE_PGBOUNCER=1` or `CI` set), where `.ci/run` installs it.
    """
    if pgb.binary() is None:
        message = f"PGBOUNCER MISSING: {pgb.INSTALL_HINT}"
        if pgb.required():
            pytest.fail(message)
        warnings.warn(message, stacklevel=1)
        pytest.skip(message)
    db = settings.DATABASES["default"]
    bouncer = pgb.PgBouncer(str(db.get("HOST") or "127.0.0.1"), int(db.get("PORT") or 5432))
    with bouncer:
        yield bouncer


@pytest.fixture(scope="session", autouse=True)
def _release_pooled_test_database(request: pytest.FixtureRequest) -> Iterator[None]:
    """When the whole session goes through a PgBouncer (scripts/test-pgbouncer.sh), drop
    its server connections to the test database before pytest-django drops it."""
    port = os.environ.get("AGENTRUNS_TEST_PGBOUNCER_PORT")
    if not port:
        yield
        return
    request.getfixturevalue("django_db_setup")
    yield
    pgb.PgBouncer.kill_on(int(port), str(connection.settings_dict["NAME"]))


TRUNCATE_EVERY = 10
"""One flush in so many truncates (see `_flush_by_delete`); the others delete."""
KEPT_BY_DELETE = ("django_content_type", "auth_permission")
"""What the flush's `post_migrate` would write again as it was: kept, it only reads them."""


@pytest.fixture(scope="session", autouse=True)
def _flush_by_delete() -> Iterator[None]:
    """On PostgreSQL a committing test's teardown empties the tables with DELETE, not
    TRUNCATE: a TRUNCATE of 26 tables makes new files for each and their indexes and syncs
    them, 0.1-0.2 s, where deleting a test's few rows takes 10 ms (the foreign keys are
    deferred to the commit, by which every row is gone), and the content types and
    permissions stay (`KEPT_BY_DELETE`) rather than be written again by the flush's
    `post_migrate`. Every `TRUNCATE_EVERY`-th flush, and any that resets sequences or
    cascades, still truncates: the dead rows left by the deletes stay few on a server that
    may run without autovacuum."""
    if connection.vendor != "postgresql":
        yield
        return
    from django.db.backends.postgresql.operations import DatabaseOperations

    original = DatabaseOperations.sql_flush
    flushes = itertools.count(1)

    def sql_flush(self: DatabaseOperations, style: Any, tables: Any, *,
                  reset_sequences: bool = False, allow_cascade: bool = False) -> list[str]:
        if not tables or reset_sequences or allow_cascade \
                or next(flushes) % TRUNCATE_EVERY == 0:
            return original(self, style, tables, reset_sequences=reset_sequences,
                            allow_cascade=allow_cascade)
        return ["SET CONSTRAINTS ALL DEFERRED",
                *(f"DELETE FROM {self.quote_name(table)}" for table in tables
                  if table not in KEPT_BY_DELETE)]

    DatabaseOperations.sql_flush = sql_flush  # type: ignore[method-assign]
    yield
    DatabaseOperations.sql_flush = original  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _fair_view_afresh() -> None:
    """Each test's enqueues read afresh whether fair shares are on: the process's view
    (transitions.fair.stamping) would otherwise carry an earlier test's groups."""
    from django_agentruns.transitions import fair

    fair.forget_view()


@pytest.fixture(autouse=True)
def _plans_as_they_were() -> Iterator[None]:
    """A worker run on the test's own thread sets that connection to plan by index
    (transitions.plans): set it back, lest the later tests' plans differ."""
    yield
    from django_agentruns.transitions import plans

    if getattr(plans._planned, "connection", None) is None:
        return
    plans._planned.connection = None
    with contextlib.suppress(Exception), connection.cursor() as cursor:
        cursor.execute("RESET enable_seqscan")


@pytest.fixture
def fake_provider() -> Iterator[fakeprovider.FakeProvider]:
    """A scripted OpenAI-compatible server (tests/fakeprovider.py), stopped after the test;
    give a worker subprocess `fake_provider.env()` to reach it."""
    with fakeprovider.FakeProvider() as provider:
        yield provider


HISTORY_SPAN = 1000


@pytest.fixture(params=["plain", "partitioned"])
def history_layout(request: pytest.FixtureRequest, settings: Any) -> Iterator[str]:
    """Runs a test on plain history tables, then (PostgreSQL) on history partitioned by run
    id (`HISTORY_PARTITION`). The conversion is DDL inside the test's transaction, which
    PostgreSQL rolls back with it: the next test finds the plain tables again. On SQLite the
    setting is on too, and ignored: the same plain tables."""
    from django_agentruns import partitioning

    partitioning.forget_top()  # an earlier test's (rolled-back) partitions are not these
    if request.param == "plain":
        yield "plain"
        return
    marker = request.node.get_closest_marker("django_db")
    if "transactional_db" in request.fixturenames or "live_server" in request.fixturenames or \
            (marker is not None and marker.kwargs.get("transaction")):
        pytest.fail("a committing test has no partitioned variant: conftest deselects it")
    from django_agentruns.ops import partitions

    settings.AGENTRUNS = {**(getattr(settings, "AGENTRUNS", None) or {}),
                          "HISTORY_PARTITION": HISTORY_SPAN}
    request.getfixturevalue("db")
    if connection.vendor == "postgresql":
        partitions.convert(HISTORY_SPAN)
        assert partitions.partitioned_tables() == set(partitions.history_tables())
    else:
        assert partitions.span() is None
        assert not partitions.partitioned_tables()
    yield "partitioned"
    partitioning.forget_top()


@pytest.fixture
def tasks() -> Iterator[Any]:
    """The test tasks of Django's tasks framework (tests/testapp/tasks.py), with TASKS naming
    our backend; skips where neither django.tasks nor the backport imports."""
    import importlib

    from django.test import override_settings

    from django_agentruns.tasks import TASKS_AVAILABLE, UNAVAILABLE_REASON
    from tests.tasks_support import TASKS

    if not TASKS_AVAILABLE:
        pytest.skip(UNAVAILABLE_REASON)
    with override_settings(TASKS=TASKS):
        yield importlib.import_module("tests.testapp.tasks")


@pytest.fixture
def received() -> Iterator[list[tuple[str, str, str, int, type]]]:
    """(signal, result id, status, attempts, sender) for every task signal sent."""
    from django_agentruns.tasks import compat

    seen: list[tuple[str, str, str, int, type]] = []
    receivers = {}
    for name in ("task_enqueued", "task_started", "task_finished"):
        def receiver(sender: type, task_result: Any, _name: str = name, **kwargs: Any) -> None:
            seen.append((_name, task_result.id, str(task_result.status), task_result.attempts,
                         sender))
        receivers[name] = receiver
        getattr(compat, name).connect(receiver, weak=False)
    yield seen
    for name, receiver in receivers.items():
        getattr(compat, name).disconnect(receiver)
