"""Retrying a budget dead letter from the admin: with a raised budget, or warned that the
same budget stops it again at once (its recorded usage already passed it).

The run page's Retry confirmation offers the budget fields for a run dead-lettered
`budget_exhausted`, filled with the budget it ran under; posting them calls
`api.retry(run_id, budget=...)`. Nothing here writes a run but through that call.
"""

from __future__ import annotations

import math
from typing import Any

from django.db.models import QuerySet
from django.http import HttpRequest

from .. import api
from ..exceptions import InvalidInputError, RunNotFoundError
from ..models import AgentRun, Reason
from ..ops.diagnosis import run_budget
from .actions import MISSING, RETRY, log_changes, username

FIELDS = ("budget_tokens", "budget_cost")


def posted_budget(request: HttpRequest) -> dict[str, Any] | str | None:
    """The budget the confirmation posted: None if no field was filled, a message if one
    is not a number >= 0."""
    raw = {name: request.POST.get(name, "").strip() for name in FIELDS}
    if not any(raw.values()):
        return None
    budget: dict[str, Any] = {}
    if raw["budget_tokens"]:
        tokens = raw["budget_tokens"].replace(",", "").replace("_", "")
        if not (tokens.isascii() and tokens.isdigit() and len(tokens) < 19):
            return f"Budget tokens must be a whole number >= 0, not {raw['budget_tokens']!r}: " \
                   "nothing was retried."
        budget["tokens"] = int(tokens)
    if raw["budget_cost"]:
        try:
            cost = float(raw["budget_cost"])
        except ValueError:
            cost = -1.0
        if not math.isfinite(cost) or cost < 0:
            return f"Budget cost must be a number >= 0, not {raw['budget_cost']!r}: " \
                   "nothing was retried."
        budget["cost"] = cost
    return budget


def retry_with_budget(request: HttpRequest, run_id: int, budget: dict[str, Any]) -> str:
    """`api.retry` with the raised budget; the outcome as `RETRY` names them."""
    try:
        retried = api.retry(run_id, by=username(request), budget=budget)
    except RunNotFoundError:
        return MISSING
    except InvalidInputError:  # its dedupe key is held by another unfinished run
        return "skipped"
    if retried:
        log_changes(request, [run_id], RETRY)
    return "retried" if retried else "skipped"


def confirmation_context(eligible: QuerySet[AgentRun], single: bool) -> dict[str, Any]:
    """What the Retry confirmation says about budgets: for one budget dead letter, its
    budget and spending (the form's fields); for several, how many will stop at once."""
    over = eligible.filter(reason=Reason.BUDGET_EXHAUSTED)
    run = over.first() if single else None
    if run is None:
        return {"budget_exhausted_count": over.count(), "budget_run": None}
    budget = run_budget(run)
    return {
        "budget_exhausted_count": 1,
        "budget_run": run,
        "budget_spent_tokens": run.input_tokens + run.output_tokens,
        "budget_spent_cost": run.cost,
        "budget_tokens": "" if budget is None or budget.tokens is None else budget.tokens,
        "budget_cost": "" if budget is None or budget.cost is None else f"{budget.cost:g}",
    }
