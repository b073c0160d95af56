"""A worker's periodic chores between claims: the reaper's pass (every `REAP_INTERVAL`)
and the history partitions new runs will need (every `ENSURE_INTERVAL`). Each is a clock
read when not due, so the claim loop can call `tick` on every pass."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from ..ops import partitions
from . import reaper

logger = logging.getLogger("django_agentruns.worker")

ENSURE_INTERVAL = 10.0  # seconds between a worker's looks at the history partitions


class Chores:
    def __init__(self, worker_id: str, reap_interval: float,
                 on_reaped: Callable[[int], None]) -> None:
        self.worker_id = worker_id
        self.reap_interval = reap_interval
        self._on_reaped = on_reaped
        self._last_reap = 0.0
        self._last_ensure = -math.inf

    def tick(self) -> None:
        self.reap()
        self.ensure_partitions()

    def reap(self) -> None:
        if self.reap_interval <= 0:
            return
        now = time.monotonic()
        if now - self._last_reap < self.reap_interval:
            return
        self._last_reap = now
        self._on_reaped(reaper.reap().total)

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
