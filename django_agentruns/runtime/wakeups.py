"""Wake idle workers when runs are queued (PostgreSQL LISTEN/NOTIFY).

The database sends the notifications: triggers on the runs table (migration 0002) NOTIFY
CHANNEL with the queue's name for every INSERT of queued runs, however made, and for a run
an operator retries. NOTIFY is transactional: it is delivered when the enqueuing
transaction commits, never if it rolls back, and PostgreSQL folds identical notifications
of one transaction into one, so a bulk enqueue sends one per queue, not one per run.

Behind a transaction pooler (PgBouncer in transaction mode) a LISTEN lands on a server
connection that goes back to the pool after the statement: notifications are lost, and
the worker would fall back to polling without a word. So the listener connects through
`AGENTRUNS["LISTEN_DATABASE"]` (a direct connection) when set, and checks itself each
time it connects (`self_check`): a NOTIFY sent the way an enqueue sends one (through the
worker's own database) must reach it within PROBE_TIMEOUT, else it says so loudly.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from ..conf import app_settings
from ..db import (
    CHANNEL,
    DEGRADED_HINT,
    PROBE_RETRY,
    PROBE_TIMEOUT,
    Reconnects,
    listen_alias,
    listening,
    notifications,
    probe_channel,
    self_check,
)
from ..ops import metrics

logger = logging.getLogger("django_agentruns.worker")

class Listener:
    """LISTENs on its own connection and wakes the worker when one of its queues gets runs.

    Polling stays the fallback: if the connection drops, the listener reconnects with
    backoff, and the worker still looks every POLL_INTERVAL. `connected` is set while the
    connection is up and has passed its self-check; `degraded` while it has not.
    """

    def __init__(self, queues: Iterable[str], wake: threading.Event,
                 stopping: threading.Event, *, worker_id: str = "",
                 poll_interval: float | None = None) -> None:
        self.queues = set(queues)
        self.wake = wake
        self.stopping = stopping
        self.alias = listen_alias()
        self.channel = probe_channel(worker_id or uuid.uuid4().hex)
        self.poll_interval = float(poll_interval if poll_interval is not None
                                   else app_settings.POLL_INTERVAL)
        self.connected = threading.Event()
        self.degraded = threading.Event()
        self._warned = False  # the degraded warning is logged once per episode
        self.thread = threading.Thread(target=self._run, name="agentruns-listen", daemon=True)

    @staticmethod
    def available() -> bool:
        return bool(connections[DEFAULT_DB_ALIAS].vendor == "postgresql"
                    and connections[listen_alias()].vendor == "postgresql")

    def start(self) -> None:
        self._set_degraded(True)  # until the first self-check passes
        self.thread.start()

    def _run(self) -> None:
        reconnects = Reconnects(logger, "LISTEN connection", 0.2, 30.0)
        while not self.stopping.is_set():
            try:
                with listening(self.alias, CHANNEL, self.channel) as conn:
                    reconnects.connected()
                    if not self_check(conn, self.channel):
                        self._warn_degraded()
                        self.stopping.wait(PROBE_RETRY)
                        continue
                    self._set_degraded(False)
                    # Catch up on anything enqueued while we were not listening.
                    self.wake.set()
                    self._listen(conn)
            except Exception:  # any failure: reconnect; polling covers the gap
                self._set_degraded(True)
                self.stopping.wait(reconnects.failed("; polling every %.3g s until it is back",
                                                     self.poll_interval))
        self.connected.clear()

    def _listen(self, conn: Any) -> None:
        while not self.stopping.is_set():
            # Short: the worker joins this thread when it stops, so this timeout is how
            # long a stop (or a burst worker's exit) waits.
            for note in notifications(conn, 0.05):
                if note.channel == CHANNEL and note.payload in self.queues:
                    self.wake.set()

    def _warn_degraded(self) -> None:
        self._set_degraded(True)
        log = logger.debug if self._warned else logger.warning
        self._warned = True
        log("wake-ups degraded: the listener's self-check on database %r got no "
            "notification within %.3g s; %s. Until then this worker looks for runs every "
            "POLL_INTERVAL (%.3g s).", self.alias, PROBE_TIMEOUT, DEGRADED_HINT,
            self.poll_interval)

    def _set_degraded(self, degraded: bool) -> None:
        metrics.set_wakeups_degraded(degraded)  # first: whoever sees the event sees it too
        if degraded:
            self.connected.clear()
            self.degraded.set()
        else:
            self.degraded.clear()
            self.connected.set()
            logger.info("wake-ups %s: the listener's self-check on database %r passed",
                        "restored" if self._warned else "on", self.alias)
            self._warned = False
