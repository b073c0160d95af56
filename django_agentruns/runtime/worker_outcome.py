"""What a worker's `run()` gives back or raises, the id it runs under, and whether a burst
worker has work left (`work_pending`): kept apart from the claim loop (`runtime.worker`,
which re-exports them) so callers that only read a worker's result need not read its
loop."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from django.utils import timezone

from .. import transitions
from ..exceptions import AgentRunsError
from ..ops import visibility
from ..outcomes import ScopePolicy

logger = logging.getLogger("django_agentruns.worker")


class ContentionTimeout(AgentRunsError):
    """A burst worker waited too long on runs held by another worker."""


def make_worker_id() -> str:
    """Unique per process start, so a restarted worker never matches its old fence."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class WorkerStats:
    claimed: int = 0
    settled: dict[str, int] = field(default_factory=dict)
    pass_errors: int = 0
    reaped: int = 0


def work_pending(queues: Sequence[str], scopes: ScopePolicy, known: frozenset[str],
                 worker_id: str) -> bool:
    """Whether a burst worker with nothing running should wait for runs rather than exit.

    Not every queued, due run counts: one behind a dead letter or a backoff is not waiting
    on another worker, nor one of an agent this worker lacks (a worker that has it takes
    it); waiting for those would end in ContentionTimeout."""
    at = timezone.now()
    if transitions.awaited(queues, at, scopes, known).exists():
        return True
    left = visibility.count_due_elsewhere(queues, known, at)
    if left:
        logger.warning("leaving %s due runs of agents this worker does not have (%s): "
                       "a worker that has them will claim them", sum(left.values()),
                       ", ".join(sorted({agent for _, agent in left})),
                       extra={"worker_id": worker_id})
    return False
