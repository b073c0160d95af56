"""The reaper: takes back running runs whose worker stopped renewing their lease.

A safety net, not a single point of failure: workers reap on their own every
REAP_INTERVAL, and a claim takes a lapsed run directly. Safe to run from cron on many
hosts at once, since each reclaim re-checks staleness inside its UPDATE.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime

from . import transitions
from .transitions import Settlement

logger = logging.getLogger("django_agentruns.reaper")


@dataclass
class ReapReport:
    stale: list[int] = field(default_factory=list)
    requeued: list[int] = field(default_factory=list)
    dead_lettered: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # renewed or settled meanwhile

    @property
    def total(self) -> int:
        return len(self.requeued) + len(self.dead_lettered) + len(self.cancelled)


def reap(at: datetime | None = None, *, limit: int = 1000, dry_run: bool = False) -> ReapReport:
    """Requeue, dead-letter or cancel (if asked) each run whose lease lapsed before `at`."""
    at = at or transitions.now()
    report = ReapReport()
    for row in transitions.find_stale(at, limit):
        report.stale.append(row["id"])
        if dry_run:
            continue
        settlement = transitions.reap_one(row, at)
        bucket = {
            Settlement.REQUEUED: report.requeued,
            Settlement.DEAD_LETTERED: report.dead_lettered,
            Settlement.CANCELLED: report.cancelled,
        }.get(settlement, report.skipped)
        bucket.append(row["id"])
        if settlement is not Settlement.LOST:
            logger.info("run %s %s attempt %s reaped: %s (lease lapsed, worker %s)", row["id"],
                        row["agent"], row["attempt"], settlement.value, row["claimed_by"],
                        extra={"run_id": row["id"], "agent": row["agent"],
                               "attempt": row["attempt"], "worker_id": row["claimed_by"]})
    return report
