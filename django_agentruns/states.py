"""Run states and termination reasons: data, importable before the app registry is ready.

See docs/state_machine.md for who moves a run between them.
"""

from __future__ import annotations

from django.db import models


class Status(models.TextChoices):
    QUEUED = "queued", "Queued"
    """Waiting to start (new, retrying after backoff, or retried by an operator).
    A worker's claim moves it to running; `cancel` moves it to cancelled."""
    RUNNING = "running", "Running"
    """An attempt holds the lease. The owning worker settles it; the reaper (or a claim)
    takes it back to queued or failed once the lease lapses."""
    WAITING = "waiting", "Waiting"
    """An attempt stopped to wait for a delivery (`ctx.receive`, an approval) or for its
    child runs: no lease, no worker slot, never reaped. A `deliver` for the awaited key,
    its last child finishing, or its deadline passing (the reaper) queue it again;
    `cancel` cancels it at once."""
    SUCCEEDED = "succeeded", "Succeeded"
    """Terminal: the agent returned its output."""
    FAILED = "failed", "Failed"
    """Terminal: dead-lettered, with the reason saying why. An operator's retry requeues it."""
    CANCELLED = "cancelled", "Cancelled"
    """Terminal: cancelled while queued, or stopped while running. An operator may retry it."""


TERMINAL = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)

UNFINISHED = (Status.QUEUED, Status.RUNNING, Status.WAITING)
"""Statuses that hold a dedupe key (the partial unique index `agentruns_dedupe`): a run
in one of them is returned to a second `enqueue` with its key."""


class Reason(models.TextChoices):
    """Why a run ended where it did (empty while queued or running)."""

    NONE = "", "—"
    COMPLETED = "completed", "Completed"
    """Succeeded: the agent returned."""
    RETRIES_EXHAUSTED = "retries_exhausted", "Retries exhausted"
    """Dead letter: a retryable failure or an abandoned attempt with no requeue left."""
    NOT_RETRYABLE = "not_retryable", "Not retryable"
    """Dead letter: a failure no retry can fix (auth, config, 4xx, `NotRetryable`)."""
    BUDGET_EXHAUSTED = "budget_exhausted", "Budget exhausted"
    """Dead letter: the run's recorded tokens or cost passed its budget (`@agent(budget=...)`);
    an operator may retry it with a raised one (`retry(run_id, budget=...)`)."""
    CANCELLED = "cancelled", "Cancelled"
    """Cancelled by a caller or an operator."""
    ERROR = "error", "Error (interactive)"
    """An interactive run (`run_now`) failed; the caller saw the error, nothing retries it."""


DEAD_LETTER_REASONS = (Reason.RETRIES_EXHAUSTED, Reason.NOT_RETRYABLE, Reason.BUDGET_EXHAUSTED)
