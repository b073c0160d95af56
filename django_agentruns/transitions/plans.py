"""How the worker's prepared statements are planned (PostgreSQL, `PREPARED_STATEMENTS`).

PostgreSQL soon runs a prepared statement on its generic plan, made once per connection
from the tables' sizes at that moment. Made while the runs or events were few (a new
install, a new partition), it scans them for every row of every statement after, until
an ANALYZE replans it. So the worker's own connections, the claim loop's and the attempt
store's writers', plan no sequential scan where an index serves: every statement they run
finds its rows by an index (docs/performance.md, "Plans made while the tables were
small")."""

from __future__ import annotations

import threading

from django.db import DEFAULT_DB_ALIAS, connection

from ..conf import app_settings
from ..db import listen_alias

_planned = threading.local()  # the server connection this thread last set up


def prepared_by_index() -> bool:
    """Whether the worker's connections plan by index (`plan_by_index`) and its
    one-statement write is prepared: PREPARED_STATEMENTS on PostgreSQL, and `default` not
    behind a pooler (LISTEN_DATABASE unset or `default`). Through a pooler in transaction
    mode a session's SET would stay with a server connection that other clients get next,
    so there it is not set, and the one-statement write stays unprepared, planned afresh
    each time. Planning is half of a lone emit's 1.5 ms."""
    return connection.vendor == "postgresql" and bool(app_settings.PREPARED_STATEMENTS) \
        and listen_alias() == DEFAULT_DB_ALIAS


def plan_by_index() -> None:
    """Where `prepared_by_index`, set this thread's connection to plan no sequential scan
    where an index serves, once per server connection (a reconnect is set up again).
    Inside a transaction it is set but not remembered: a rollback undoes a SET."""
    if not prepared_by_index():
        return
    connection.ensure_connection()
    opened = connection.connection
    if getattr(_planned, "connection", None) is opened:
        return
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
    _planned.connection = None if connection.in_atomic_block else opened
