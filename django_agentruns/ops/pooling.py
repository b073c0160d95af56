"""System checks for a deployment behind a connection pooler (PgBouncer in transaction mode).

Two sources of "the worker's database is pooled": the settings (`LISTEN_DATABASE` names a
direct connection other than `default`, so `default` is the pooled one), and, under
`check --deploy`, the wake-up self-check itself (a NOTIFY sent through `default` does not
reach a LISTEN made through the listen alias).
"""

from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register
from django.db import DEFAULT_DB_ALIAS

from ..conf import SETTING_NAME

E010_BAD_LISTEN_DATABASE = "agentruns.E010"
W005_WAKEUPS_DEGRADED = "agentruns.W005"
W006_PREPARED_BEHIND_POOLER = "agentruns.W006"
W007_SERVER_SIDE_CURSORS = "agentruns.W007"

_POSTGRES = "postgresql"


def _engine(alias: str) -> str:
    return str(settings.DATABASES.get(alias, {}).get("ENGINE", ""))


def _listen_setting() -> Any:
    raw = getattr(settings, SETTING_NAME, None)
    return raw.get("LISTEN_DATABASE") if isinstance(raw, dict) else None


@register()
def check_listen_database(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    alias = _listen_setting()
    errors: list[CheckMessage] = []
    if alias is not None and (not isinstance(alias, str) or alias not in settings.DATABASES):
        errors.append(Error(
            f"{SETTING_NAME}['LISTEN_DATABASE'] = {alias!r} is not an alias in DATABASES.",
            hint=f"Name a DATABASES entry that connects directly to PostgreSQL (not through "
                 f"PgBouncer), or None for the worker's own; aliases: "
                 f"{', '.join(sorted(settings.DATABASES))}.", id=E010_BAD_LISTEN_DATABASE))
        return errors
    if alias is not None and _POSTGRES in _engine(DEFAULT_DB_ALIAS) \
            and _POSTGRES not in _engine(alias):
        errors.append(Error(
            f"{SETTING_NAME}['LISTEN_DATABASE'] = {alias!r} is not a PostgreSQL database, so "
            "the worker cannot LISTEN on it.",
            hint="Point it at the same PostgreSQL server as 'default', directly.",
            id=E010_BAD_LISTEN_DATABASE))
    elif alias not in (None, DEFAULT_DB_ALIAS) and _POSTGRES in _engine(DEFAULT_DB_ALIAS):
        errors += pooler_warnings(f"LISTEN_DATABASE is {alias!r}, so 'default' is taken to "
                                  "go through a pooler")
    return errors


@register(deploy=True)
def check_wakeups(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """`check --deploy`: LISTEN through the listen alias, NOTIFY through `default`."""
    from ..db import listen_alias

    alias = listen_alias()
    if alias not in settings.DATABASES or _POSTGRES not in _engine(DEFAULT_DB_ALIAS) \
            or _POSTGRES not in _engine(alias):
        return []  # nothing to wake (SQLite), or E010 says what is wrong
    try:
        received = probe(alias)
    except Exception as exc:  # the server is away: say so, the deployment is not ready
        return [Warning(f"The wake-up self-check could not run: {exc}",
                        hint="Check that the database answers, then run check --deploy "
                             "again.", id=W005_WAKEUPS_DEGRADED)]
    if received:
        return []
    from ..db import DEGRADED_HINT, PROBE_TIMEOUT

    messages: list[CheckMessage] = [Warning(
        f"Wake-ups degraded: a NOTIFY sent through 'default' did not reach a LISTEN on "
        f"{alias!r} within {PROBE_TIMEOUT:g} s; workers will only poll (every POLL_INTERVAL) "
        "and a new run waits up to that long to start.",
        hint=DEGRADED_HINT[0].upper() + DEGRADED_HINT[1:] + ".", id=W005_WAKEUPS_DEGRADED)]
    if alias == DEFAULT_DB_ALIAS:  # else check_listen_database already said the rest
        messages += pooler_warnings("the wake-up self-check failed, so 'default' is taken to "
                                    "go through a transaction pooler")
    return messages


def probe(alias: str) -> bool:
    """One self-check from this process, on a channel of its own."""
    from ..db import listening, probe_channel, self_check

    channel = probe_channel(f"check:{uuid.uuid4().hex}")
    with listening(alias, channel) as conn:
        return self_check(conn, channel)


def pooler_warnings(why: str) -> list[CheckMessage]:
    """What breaks behind a transaction pooler: prepared statements and server-side cursors."""
    from ..conf import app_settings

    db = settings.DATABASES.get(DEFAULT_DB_ALIAS, {})
    options = db.get("OPTIONS", {})
    messages: list[CheckMessage] = []
    prepared = [name for name, on in (
        (f"{SETTING_NAME}['PREPARED_STATEMENTS']", app_settings.PREPARED_STATEMENTS is True),
        ("OPTIONS['server_side_binding']", options.get("server_side_binding") is True),
        ("OPTIONS['prepare_threshold']", options.get("prepare_threshold") is not None),
    ) if on]
    if prepared:
        messages.append(Warning(
            f"{' and '.join(prepared)} prepare statements on the server, and {why}: a pooler "
            "without prepared-statement support (PgBouncer before 1.21, or without "
            "max_prepared_statements) fails with 'prepared statement ... does not exist'.",
            hint="Turn them off for the pooled alias, or run PgBouncer >= 1.21 with "
                 "max_prepared_statements > 0.", id=W006_PREPARED_BEHIND_POOLER))
    if db.get("DISABLE_SERVER_SIDE_CURSORS") is not True:
        messages.append(Warning(
            f"DATABASES['default']['DISABLE_SERVER_SIDE_CURSORS'] is not True, and {why}: "
            "QuerySet.iterator() (the admin's bulk actions use it) opens a server-side "
            "cursor, which a transaction pooler can hand to another client.",
            hint="Set DATABASES['default']['DISABLE_SERVER_SIDE_CURSORS'] = True.",
            id=W007_SERVER_SIDE_CURSORS))
    return messages
