"""Values passed between the executor and storage: the fence, and what a write came to.

Kept apart from `transitions` (which imports the models) so `RunContext` can be imported
before the app registry is ready.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Q

from .states import Status


@dataclass(frozen=True)
class AttemptRef:
    """Who is writing: the fence every attempt write carries.

    `lease_ttl` is None for interactive runs (`run_now`), which hold no lease.
    """

    run_id: int
    attempt: int
    worker_id: str
    lease_ttl: float | None
    agent: str = ""

    def guard(self) -> Q:
        return Q(pk=self.run_id, status=Status.RUNNING, claimed_by=self.worker_id,
                 attempt=self.attempt)

    def lease_until(self, now: datetime) -> datetime | None:
        return None if self.lease_ttl is None else now + timedelta(seconds=self.lease_ttl)


class Renewal(enum.Enum):
    OK = "ok"
    LOST = "lost"  # the guard matched nothing: reaped, reclaimed or settled elsewhere
    CANCEL_REQUESTED = "cancel_requested"


class Settlement(enum.Enum):
    SUCCEEDED = "succeeded"
    REQUEUED = "requeued"
    DEAD_LETTERED = "dead_lettered"
    CANCELLED = "cancelled"
    WAITING = "waiting"  # the attempt ended waiting; its wait write released the lease
    LOST = "lost"  # nothing written: the attempt no longer owns the run


class CancelResult(enum.Enum):
    CANCELLED = "cancelled"  # was queued: cancelled at once
    REQUESTED = "requested"  # was running: its attempt will stop within a third of its lease
    ALREADY_REQUESTED = "already_requested"
    NOT_CANCELLABLE = "not_cancellable"  # already finished: nothing to do


@dataclass(frozen=True)
class ScopePolicy:
    """Which agents keep firing order per scope; the registry builds it for storage."""

    ordered: frozenset[str] = frozenset()
    dead_letters_block: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ErrorInfo:
    type: str
    message: str
    traceback: str
