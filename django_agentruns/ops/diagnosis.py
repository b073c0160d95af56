"""What a run's state means for an operator, and what to do about it. Pure: no queries.

Shared by the admin's run page (its summary at the top), the overview and `manage.py why`,
so that a dead letter is explained in the same words wherever it is looked at.
"""

from __future__ import annotations

from ..models import AgentRun, Reason, Status
from ..registry import find_agent
from ..rules.limits import Budget, effective_budget

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
    if run.status == Status.FAILED and run.reason == Reason.BUDGET_EXHAUSTED:
        return budget_advice(run)
    if run.status == Status.FAILED and run.reason == Reason.ERROR:
        return "Failed in an interactive call (run_now): its caller saw the error."
    if run.status == Status.FAILED:
        return f"Failed ({run.reason or 'no reason recorded'}): read the error below, then retry."
    if run.status == Status.CANCELLED:
        return "Cancelled" + (f": {run.cancel_reason}" if run.cancel_reason else "") + \
            ". Retry it to run it again."
    if run.status == Status.RUNNING and run.cancel_requested_at is not None:
        return "A cancel was requested: it is cancelled once its worker notices."
    return ""


def run_budget(run: AgentRun) -> Budget | None:
    """The budget the run ran under: its own (an operator's retry set it), else its agent's."""
    spec = find_agent(run.agent)
    return effective_budget(run.budget, None if spec is None else spec.budget)


def spent(run: AgentRun) -> str:
    return f"{run.input_tokens + run.output_tokens} tokens, cost {run.cost:g}"


def budget_advice(run: AgentRun) -> str:
    """A budget dead letter: what it spent against what it was allowed, and the one retry
    that helps (a raised budget: the same one stops it again at once)."""
    budget = run_budget(run)
    allowed = "no budget known here" if budget is None else \
        ", ".join(f"{k} {v:g}" for k, v in budget.as_dict().items()) or "no bound"
    return (f"Budget exhausted: it recorded {spent(run)} against its budget ({allowed}). "
            f"Retry it with a raised budget (the admin's Retry, or "
            f"retry({run.pk}, budget={{\"tokens\": ..., \"cost\": ...}})); a retry without "
            f"one stops again at once, as its usage already passed the budget.")
