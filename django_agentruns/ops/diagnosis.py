"""What a run's state means for an operator, and what to do about it. Pure: no queries.

Shared by the admin's run page (its summary at the top), the overview and `manage.py why`,
so that a dead letter is explained in the same words wherever it is looked at.
"""

from __future__ import annotations

from ..models import AgentRun, Reason, Status

ABANDONED = "AbandonedAttempt"  # the error_type transitions record for an abandoned attempt
SHORT_ERROR = 90


def short_error(message: str, limit: int = SHORT_ERROR) -> str:
    """The error message on one line, cut to `limit` characters."""
    line = " ".join(message.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def advice(run: AgentRun) -> str:
    """What to do next about `run`, in one or two sentences ("" when nothing is needed)."""
    if run.status == Status.FAILED and run.error_type == ABANDONED:
        return ("Abandoned: its worker died, was stopped, or lost the database before the "
                "attempt ended, on every attempt. Check the workers (manage.py workers) and "
                "their logs, then retry.")
    if run.status == Status.FAILED and run.reason == Reason.NOT_RETRYABLE:
        return ("Not retryable: fix the cause first (the error below: credentials, "
                "configuration, bad input); retrying without a fix fails the same way.")
    if run.status == Status.FAILED and run.reason == Reason.RETRIES_EXHAUSTED:
        return (f"Retries exhausted after {run.requeue_count} requeue"
                f"{'' if run.requeue_count == 1 else 's'}: read the last error and the "
                "timeline's run.requeued events; retry once the cause is gone.")
    if run.status == Status.FAILED:
        return "Failed in an interactive call (run_now): its caller saw the error."
    if run.status == Status.CANCELLED:
        return "Cancelled" + (f": {run.cancel_reason}" if run.cancel_reason else "") + \
            ". Retry it to run it again."
    if run.status == Status.RUNNING and run.cancel_requested_at is not None:
        return "A cancel was requested: it is cancelled once its worker notices."
    return ""
