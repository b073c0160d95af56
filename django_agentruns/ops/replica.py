"""Reads from a replica (`READ_DATABASE`): its system check, and how far behind it is.

Operators' reads that decide nothing go to the read database (`queries.reading`); every
action writes to, and re-checks the run on, the primary. What a lagging replica costs is a
list a few seconds old, which the admin says when the lag passes `LAG_SHOWN`.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, register
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections

from ..conf import SETTING_NAME
from ..db import read_alias

E019_BAD_READ_DATABASE = "agentruns.E019"
LAG_SHOWN = 5.0
"""Seconds of replica lag past which the admin's lists and overview say they are behind."""

# Caught up when everything received is replayed (an idle primary writes no commits, so
# the last replayed commit's age alone would read as lag); else the age of that commit.
_LAG_SQL = ("SELECT CASE WHEN NOT pg_is_in_recovery() THEN NULL "
            "WHEN pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() THEN 0 "
            "ELSE EXTRACT(EPOCH FROM now() - pg_last_xact_replay_timestamp()) END")


@register()
def check_read_database(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    raw = getattr(settings, SETTING_NAME, None)
    alias = raw.get("READ_DATABASE") if isinstance(raw, dict) else None
    if alias is None or (isinstance(alias, str) and alias in settings.DATABASES):
        return []
    return [Error(
        f"{SETTING_NAME}['READ_DATABASE'] = {alias!r} is not an alias in DATABASES.",
        hint=f"Name the DATABASES entry of a streaming replica of 'default', or None to read "
             f"from 'default'; aliases: {', '.join(sorted(settings.DATABASES))}.",
        id=E019_BAD_READ_DATABASE)]


def lag() -> float | None:
    """Seconds the read database is behind the primary; None when it is the primary, not a
    PostgreSQL standby, or cannot say (it is down: the page's own reads will say so)."""
    alias = read_alias()
    conn = connections[alias]
    if alias == DEFAULT_DB_ALIAS or conn.vendor != "postgresql":
        return None
    try:
        with conn.cursor() as cursor:
            cursor.execute(_LAG_SQL)
            row = cursor.fetchone()
    except DatabaseError:
        return None
    return None if row is None or row[0] is None else float(row[0])


def lag_note() -> str | None:
    """What the admin says above a list read from a replica that is over `LAG_SHOWN`
    behind; None when it is close enough (or there is no replica)."""
    behind = lag()
    if behind is None or behind <= LAG_SHOWN:
        return None
    return (f"These figures are read from the replica {read_alias()!r}, {behind:.0f} s behind "
            "the primary: recent changes may not show yet. Actions always apply to the "
            "primary's current state.")
