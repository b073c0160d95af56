"""System checks for a pooled deployment: LISTEN_DATABASE names a usable alias, and the
settings that break behind a transaction pooler are pointed out (agentruns.E010, W005-W007).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import override_settings

from django_agentruns.ops import pooling

PG = {"ENGINE": "django.db.backends.postgresql", "NAME": "app", "HOST": "pgbouncer"}
DIRECT = {**PG, "HOST": "postgres"}
# The checks read settings.DATABASES only; no connection is made from these overrides.
pytestmark = pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")

LITE = {"ENGINE": "django.db.backends.sqlite3", "NAME": "/tmp/x.sqlite3"}


def ids(databases: dict[str, Any], **agentruns: Any) -> list[str]:
    with override_settings(DATABASES=databases, AGENTRUNS=agentruns):
        return [m.id or "" for m in pooling.check_listen_database()]


def test_unset_says_nothing() -> None:
    assert ids({"default": PG}) == []


def test_an_alias_that_is_not_in_databases_is_an_error() -> None:
    assert ids({"default": PG}, LISTEN_DATABASE="direct") == [pooling.E010_BAD_LISTEN_DATABASE]
    assert ids({"default": PG}, LISTEN_DATABASE=3) == [pooling.E010_BAD_LISTEN_DATABASE]


def test_a_listen_alias_that_is_not_postgresql_is_an_error() -> None:
    assert ids({"default": PG, "direct": LITE}, LISTEN_DATABASE="direct") == \
        [pooling.E010_BAD_LISTEN_DATABASE]


def test_a_direct_alias_implies_default_is_pooled_and_what_breaks_there() -> None:
    databases = {"default": {**PG, "DISABLE_SERVER_SIDE_CURSORS": True}, "direct": DIRECT}
    assert ids(databases, LISTEN_DATABASE="direct") == []
    assert ids(databases, LISTEN_DATABASE="direct", PREPARED_STATEMENTS=True) == \
        [pooling.W006_PREPARED_BEHIND_POOLER]
    pooled_prepare = {**databases, "default": {**databases["default"],
                                               "OPTIONS": {"prepare_threshold": 5}}}
    assert ids(pooled_prepare, LISTEN_DATABASE="direct") == [pooling.W006_PREPARED_BEHIND_POOLER]
    assert ids({"default": PG, "direct": DIRECT}, LISTEN_DATABASE="direct") == \
        [pooling.W007_SERVER_SIDE_CURSORS]


def test_the_default_alias_itself_says_nothing_of_pooling() -> None:
    assert ids({"default": PG}, LISTEN_DATABASE="default", PREPARED_STATEMENTS=True) == []


@pytest.mark.django_db
def test_the_deploy_probe_passes_on_a_direct_connection_and_skips_sqlite() -> None:
    # PostgreSQL: the test server, reached directly; SQLite: there is nothing to wake.
    assert pooling.check_wakeups() == []
    if connection.vendor == "postgresql":
        assert pooling.probe("default") is True
