"""What a worker's `run()` gives back or raises, and the id it runs under: kept apart from
the claim loop (`runtime.worker`, which re-exports them) so callers that only read a
worker's result need not read its loop."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from ..exceptions import AgentRunsError


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
