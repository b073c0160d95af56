"""Values of waiting runs, passed between the API, the context and `transitions.waiting`.

Kept apart from the models (like `outcomes`) so `RunContext` can be imported before the app
registry is ready.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

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
