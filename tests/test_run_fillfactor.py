"""The run table keeps a fifth of each page free (migration 0027, PostgreSQL), so that
the renewals a run's lease takes while it runs stay on their page: HOT updates, no index
entry and less WAL, where a packed page sent each new version to another page and into
every index of the table."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import connection

from django_agentruns import enqueue_many, transitions
from django_agentruns.models import AgentRun
from django_agentruns.outcomes import AttemptRef

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

RUNS = AgentRun._meta.db_table
ROUNDS = 4  # a run's lease is renewed at each emit and checkpoint, and by its keeper


@pytest.fixture(autouse=True)
def _fresh_pages() -> None:
    """The run table's pages as a new install has them: the suite empties tables between
    committing tests by DELETE (tests/conftest.py), whose dead rows would leave room on
    the pages this module measures."""
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {RUNS} CASCADE")


def pages(ids: list[int]) -> dict[int, int]:
    """Each run's heap page (the block of its row's current version)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id, (ctid::text::point)[0]::bigint FROM {RUNS} "
                       "WHERE id = ANY(%s)", [ids])
        return dict(cursor.fetchall())


def fillfactor() -> str | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT option_value FROM pg_options_to_table("
                       "(SELECT reloptions FROM pg_class WHERE oid = %s::regclass)) "
                       "WHERE option_name = 'fillfactor'", [RUNS])
        row = cursor.fetchone()
    return row[0] if row else None


def renewals_on_their_page() -> float:
    enqueue_many([{"agent": "tests.noop"} for _ in range(600)])
    claimed = []
    while batch := transitions.claim("w", ["default"], 64, transitions.ScopePolicy(), {},
                                     60.0):
        claimed.extend(batch)
    assert len(claimed) == 600
    refs = [AttemptRef(run.pk, run.attempt, "w", lease_ttl=60.0) for run in claimed]
    stayed = 0
    for _ in range(ROUNDS):
        before = pages([run.pk for run in claimed])
        transitions.renew_many("w", refs)
        after = pages(list(before))
        stayed += sum(after[pk] == page for pk, page in before.items())
    return stayed / (ROUNDS * len(claimed))


def test_a_running_runs_renewals_stay_on_its_page() -> None:
    assert fillfactor() == "80"
    # About two thirds here (0.15 on packed pages, below): a renewal of many runs in one
    # statement fills a page's free fifth before its earlier versions can be pruned.
    assert renewals_on_their_page() >= 0.5


def test_migration_0027_keeps_room_and_its_way_back_packs_pages_full() -> None:
    call_command("migrate", "django_agentruns", "0026", verbosity=0)
    try:
        assert fillfactor() is None
        packed = renewals_on_their_page()
    finally:
        call_command("migrate", "django_agentruns", verbosity=0)
    assert packed < 0.3  # what the migration is for: without it, most renewals moved
    assert fillfactor() == "80"
