"""Wake idle workers when runs are queued (PostgreSQL LISTEN/NOTIFY).

NOTIFY is transactional: it is delivered when the enqueuing transaction commits, never
if it rolls back, and PostgreSQL folds identical notifications of one transaction into
one, so a bulk enqueue sends one per queue, not one per run.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import connection

CHANNEL = "agentruns"


def notify_on_commit(queues: Iterable[str]) -> None:
    if connection.vendor != "postgresql":
        return  # SQLite workers poll
    with connection.cursor() as cursor:
        for queue in queues:
            cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, queue])
