"""An attempt's writes as values: what `batched.apply_writes` applies, many at a time, and
what each answers (`Result`)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..outcomes import AttemptRef, Renewal, Settlement, StepStart, UsageTotals
from .steps import CarriedEnd, StepEndWrite, StepStartWrite


@dataclass(frozen=True)
class RenewWrite:
    """A heartbeat: extend the lease; `Renewal` says whether the attempt may go on."""

    ref: AttemptRef


@dataclass(frozen=True)
class EmitWrite:
    """Renew, then append one event unless its id is stored already (as `emit`)."""

    ref: AttemptRef
    event_id: uuid.UUID
    type: str
    payload: dict[str, Any]
    max_events: int | None = None
    despite_cancel: bool = False
    """Appended while a cancel request stands (still fenced by the lease), answering
    CANCEL_REQUESTED all the same: live output the attempt streamed before it stopped."""


@dataclass(frozen=True)
class CheckpointWrite:
    """Save resume state as checkpoint number `count`, renewing the lease (as `checkpoint`)."""

    ref: AttemptRef
    state: Any
    count: int
    max_events: int | None = None


@dataclass(frozen=True)
class SucceedWrite:
    """The attempt's success with its output (as `settle_succeeded`)."""

    ref: AttemptRef
    output: Any


@dataclass(frozen=True)
class SettleWrite:
    """Any other end of the attempt: `settle` is its transition (`settle_failed`,
    `settle_cancelled`, `abandon`, `interrupt` with their arguments bound), run in the
    batch's transaction. Rare next to the others, so each runs on its own."""

    ref: AttemptRef
    settle: Callable[[], Settlement]


@dataclass(frozen=True)
class UsageWrite:
    """A model call's tokens and cost added to the run's totals, with a `run.usage` event
    and a renewal (as `record_usage`); answers the run's totals after it."""

    ref: AttemptRef
    input_tokens: int
    output_tokens: int
    cost: float
    model: str
    max_events: int | None = None
    seq: int | None = None  # the call's number in its attempt: a retried write adds nothing


Write = (RenewWrite | EmitWrite | CheckpointWrite | SucceedWrite | SettleWrite | UsageWrite
         | StepStartWrite | StepEndWrite | CarriedEnd)
Result = Renewal | Settlement | UsageTotals | StepStart
Event = tuple[int, str, dict[str, Any], int, uuid.UUID]
