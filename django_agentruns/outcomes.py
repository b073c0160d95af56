"""The result vocabulary, in one home: what an attempt, a write or a decision came to.

Every value an executor, the policy or storage switches on is an enum here (so mypy
checks each branch), with the values passed between them: the fence (`AttemptRef`) and
an attempt's `Outcome`, and the values of waiting runs (`Waited`, `Approval`, `RunResult`).
The string enums keep the values that are stored and logged
("lease_lost", "dead_letter"). Kept apart from `transitions` (which imports the models)
so `RunContext` can be imported before the app registry is ready.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

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


@dataclass(frozen=True)
class UsageTotals:
    """What a usage write answered: its renewal, and the run's totals after it (tokens,
    input and output together, and cost), which the attempt compares with its budget."""

    renewal: Renewal
    tokens: int
    cost: float


@dataclass(frozen=True)
class StepStart:
    """What a step's start write answered: its renewal, the step's occurrence, and for a
    step done already (by an earlier attempt, or copied by a replaying fork) its result."""

    renewal: Renewal
    occurrence: int = 0
    done: bool = False
    result: Any = None
    replayed: bool = False


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


class StopReason(enum.StrEnum):
    """Why an attempt was told to stop (logged, and the `stop_reason` of its outcome)."""

    CANCELLED = "cancelled"
    LEASE_LOST = "lease_lost"
    TIMEOUT = "timeout"
    SHUTDOWN = "shutdown"
    INTERRUPTED = "interrupted"  # the database stayed out of reach: requeued, not charged
    WAITING = "waiting"  # the attempt recorded a wait (ctx.receive): the run is waiting
    BUDGET = "budget_exhausted"  # recorded usage passed the run's budget: dead-lettered


class OutcomeKind(enum.StrEnum):
    """How the agent's code ended, before storage is told."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class DecisionAction(enum.StrEnum):
    """What happens to a run after a failed or abandoned attempt (`policy.decide`)."""

    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    CANCEL = "cancel"


@dataclass
class Outcome:
    """What the attempt came to, before storage is told."""

    kind: OutcomeKind
    output: Any = None
    error: BaseException | None = None
    stop_reason: StopReason | None = None
    detail: str = ""  # what passed the budget, for a budget stop

    def __post_init__(self) -> None:
        # Plain strings are accepted (and kept as the enum), as before the enums existed.
        self.kind = OutcomeKind(self.kind)
        if self.stop_reason is not None:
            self.stop_reason = StopReason(self.stop_reason)


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


# Values of waiting runs, passed between the API, the context and `transitions.waiting`.
KEY_MAX = 200
"""Longest key a run receives on (`ctx.receive`, `deliver`, `ctx.spawn`)."""

RESERVED_PREFIX = "~"
"""Keys the engine uses itself (a wait for child runs) start with it; callers' may not."""


class DeliverResult(enum.Enum):
    """What `deliver` (and `approve`, `reject`) came to."""

    DELIVERED = "delivered"  # the run waited for this key: it is queued again
    ALREADY_DELIVERED = "already_delivered"  # the first payload stands (a retried webhook)
    STORED = "stored"  # the run does not wait for it yet: `receive` will find it
    NOT_FOUND = "not_found"  # no run has that id
    FINISHED = "finished"  # the run is finished: nothing was stored


class WaitState(enum.Enum):
    """What an attempt's wait write came to (`transitions.waiting.wait_for`)."""

    READY = "ready"  # the payload (or every child) is there: go on, the lease renewed
    WAITING = "waiting"  # recorded: the run is waiting, the lease released; end the attempt
    TIMED_OUT = "timed_out"  # the wait's deadline passed: `WaitTimedOut`
    WOULD_WAIT = "would_wait"  # an interactive run (no lease) cannot wait: nothing written
    CANCEL_REQUESTED = "cancel_requested"
    LOST = "lost"  # the fence matched nothing


@dataclass(frozen=True)
class RunResult:
    """A finished child run, as `ctx.wait_for_runs` returns it."""

    status: str
    reason: str
    output: Any = None
    error: dict[str, str] | None = None  # {"type", "message"} of a failed run


@dataclass(frozen=True)
class Waited:
    state: WaitState
    payload: Any = None
    by: str = ""
    runs: dict[int, RunResult] = field(default_factory=dict)


@dataclass(frozen=True)
class Approval:
    """A person's answer to `ctx.request_approval`: `proposal` as they approved it (maybe
    edited), or as proposed when they rejected it or left it unchanged."""

    approved: bool
    by: str
    note: str
    proposal: Any
