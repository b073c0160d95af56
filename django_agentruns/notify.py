"""Wake idle workers when runs are queued (PostgreSQL LISTEN/NOTIFY).

The database sends the notifications: triggers on the runs table (migration 0002) NOTIFY
CHANNEL with the queue's name for every INSERT of queued runs, however made, and for a run
an operator retries. NOTIFY is transactional: it is delivered when the enqueuing
transaction commits, never if it rolls back, and PostgreSQL folds identical notifications
of one transaction into one, so a bulk enqueue sends one per queue, not one per run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from django.db import connection

logger = logging.getLogger("django_agentruns.worker")

CHANNEL = "agentruns"
"""The channel the triggers NOTIFY and workers LISTEN on; the payload is the queue's name."""


class Listener:
    """LISTENs on its own connection and wakes the worker when one of its queues gets runs.

    Polling stays the fallback: if the connection drops, the listener reconnects with
    backoff, and the worker still looks every POLL_INTERVAL.
    """

    def __init__(self, queues: Iterable[str], wake: threading.Event,
                 stopping: threading.Event) -> None:
        self.queues = set(queues)
        self.wake = wake
        self.stopping = stopping
        self.connected = threading.Event()
        self.thread = threading.Thread(target=self._run, name="agentruns-listen", daemon=True)

    @staticmethod
    def available() -> bool:
        return connection.vendor == "postgresql"

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        import psycopg

        params = connection.get_connection_params()
        params.pop("cursor_factory", None)
        params.pop("context", None)
        failures = 0
        while not self.stopping.is_set():
            try:
                with psycopg.connect(**params, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.connected.set()
                    failures = 0
                    # Catch up on anything enqueued while we were not listening.
                    self.wake.set()
                    while not self.stopping.is_set():
                        # Short: the worker joins this thread when it stops, so this
                        # timeout is how long a stop (or a burst worker's exit) waits.
                        for note in conn.notifies(timeout=0.05):
                            if note.payload in self.queues:
                                self.wake.set()
            except Exception:  # any failure: reconnect; polling covers the gap
                self.connected.clear()
                failures += 1
                logger.warning("LISTEN connection failed (%s in a row); polling until it is "
                               "back", failures, exc_info=failures == 1)
                self.stopping.wait(min(30.0, 0.2 * 2 ** min(failures, 8)))
