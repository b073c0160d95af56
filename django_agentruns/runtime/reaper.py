"""The reaper: takes back running runs whose worker stopped renewing their lease.

A safety net, not a single point of failure: workers reap on their own every
REAP_INTERVAL, and a claim takes a lapsed run directly. Safe to run from cron on many
hosts at once, since each reclaim re-checks staleness inside its UPDATE.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime

from .. import transitions
from ..ops.retention import prune_finished_chunks
from ..transitions import Settlement

logger = logging.getLogger("django_agentruns.reaper")


@dataclass
class ReapReport:
    stale: list[int] = field(default_factory=list)
    requeued: list[int] = field(default_factory=list)
    dead_lettered: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # renewed or settled meanwhile
    wait_timeouts: list[int] = field(default_factory=list)  # waiting runs past their deadline
    parents_resumed: list[int] = field(default_factory=list)  # children all done, parent not
    chunks_pruned: int = 0  # live-output rows (SQLite) of finished runs, left by a crash
    groups_dropped: int = 0  # fairness groups with no queued, waiting or running run
    clocks_raised: int = 0  # queues whose fair-share clock moved up to their virtual now

    @property
    def total(self) -> int:
        return len(self.requeued) + len(self.dead_lettered) + len(self.cancelled)


def reap(at: datetime | None = None, *, limit: int = 1000, dry_run: bool = False,
         run_ids: list[int] | None = None) -> ReapReport:
    """Requeue, dead-letter or cancel (if asked) each run whose lease lapsed before `at`;
    queue again each waiting run whose wait's deadline passed (never a waiting run else);
    delete up to `limit` fairness groups left without a queued, waiting or running run,
    and raise the queues' fair-share clocks (transitions.fair.raise_clocks).

    `run_ids`: only these runs' lapsed leases (an operator's "reap now" on a stuck run,
    when nothing else reaps); waits are left to the next full reap."""
    at = at or transitions.now()
    report = ReapReport()
    if run_ids is None:
        _expire_waits(report, at, limit, dry_run)
        if not dry_run:
            report.chunks_pruned = prune_finished_chunks(limit)
            report.groups_dropped = transitions.drop_idle_groups(limit)
            report.clocks_raised = transitions.raise_clocks()
    rows = transitions.find_stale(at, limit) if run_ids is None \
        else transitions.find_stale(at, limit, run_ids)
    for row in rows:
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


def _expire_waits(report: ReapReport, at: datetime, limit: int, dry_run: bool) -> None:
    """Waits past their deadline go back to the queue (their `receive` raises WaitTimedOut),
    and parents whose children all finished but who were not resumed (a worker died between
    a one-statement settle and its follow-up) are resumed."""
    waits = transitions.waiting
    for run_id in waits.expired(at, limit):
        if not dry_run and waits.expire(run_id, at):
            report.wait_timeouts.append(run_id)
            logger.info("run %s: its wait timed out; queued again", run_id,
                        extra={"run_id": run_id})
    for run_id in transitions.children.parents_behind(limit):
        if not dry_run and transitions.children.resume_parent(run_id, at):
            report.parents_resumed.append(run_id)
