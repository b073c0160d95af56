"""A worker's periodic chores between claims: the reaper's pass (every `REAP_INTERVAL`),
the history partitions new runs will need (every `ENSURE_INTERVAL`), its schedules' ticks,
and the views its claims use (paused queues, fair shares, limits: read at most once a
second). Each is a clock read when not due, so the claim loop can call `tick` on any
pass; it keeps them off the pass that claims a run just enqueued (`Worker._serve`)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

from ..ops import partitions
from . import reaper
from .ticker import Ticker

logger = logging.getLogger("django_agentruns.worker")

ENSURE_INTERVAL = 10.0  # seconds between a worker's looks at the history partitions
LATE = 2.0  # seconds without a tick after which the claim loop ticks first, whatever else


class Chores:
    def __init__(self, worker_id: str, reap_interval: float, on_reaped: Callable[[int], None],
                 ticker: Ticker | None = None, views: Sequence[Callable[[], object]] = ()
                 ) -> None:
        self.worker_id = worker_id
        self.reap_interval = reap_interval
        self._on_reaped = on_reaped
        self._ticker = ticker
        self._views = views  # each reads its view if it is a second old
        self._last_reap = 0.0
        self._last_ensure = -math.inf
        self._ticked = -math.inf

    def tick(self) -> int:
        """The chores that are due; returns the runs they queued (reaped leases, schedule
        ticks), which a pass that ticks after its claim claims again."""
        self._ticked = time.monotonic()
        made = self.reap() + (self._ticker.tick() if self._ticker is not None else 0)
        self.ensure_partitions()
        for read in self._views:
            read()
        return made

    def late(self) -> bool:
        """Whether `tick` was last called `LATE` seconds ago or more (a busy loop)."""
        return time.monotonic() - self._ticked >= LATE

    def reap(self) -> int:
        if self.reap_interval <= 0:
            return 0
        now = time.monotonic()
        if now - self._last_reap < self.reap_interval:
            return 0
        self._last_reap = now
        reaped = reaper.reap().total
        self._on_reaped(reaped)
        return reaped

    def ensure_partitions(self) -> None:
        """Partitioned history: make the partitions new runs will need, from every worker
        (no leader; a try-lock lets one do the DDL at a time), once per ENSURE_INTERVAL: one
        catalog read and a sequence read when nothing is due."""
        now = time.monotonic()
        if now - self._last_ensure < ENSURE_INTERVAL:
            return
        self._last_ensure = now
        if partitions.span() is not None:
            created = partitions.ensure().created
            if created:
                logger.info("created history partitions %s", ", ".join(created),
                            extra={"worker_id": self.worker_id})
