"""Usage and budgets of an attempt: what `ctx.record_usage` checks and writes, and how an
attempt learns its run's budget.

The totals live on the run (AgentRun.input_tokens, output_tokens, cost), added to by a
fenced write through the attempt's store (`transitions.UsageWrite`), like an emit; the
attempt keeps a copy to compare with its budget at every context call, without a query.
"""

from __future__ import annotations

import math
from typing import Any

from .. import transitions
from ..conf import app_settings
from ..exceptions import InvalidInputError
from ..ops import metrics
from ..outcomes import Renewal, UsageTotals
from ..rules.limits import effective_budget
from ..rules.pricing import configured_cost
from ..validation import is_short_text
from .control import AttemptControl

MODEL_MAX = 100


def arm(control: AttemptControl, run: Any, spec: Any) -> None:
    """Give an attempt its run's budget and the totals recorded so far (a retried run
    that already passed its budget stops at its first context call)."""
    control.budget = effective_budget(getattr(run, "budget", None),
                                      getattr(spec, "budget", None))
    control.spent = (int(run.input_tokens or 0) + int(run.output_tokens or 0),
                     float(run.cost or 0.0))
    _judge(control)


def usage_write(control: AttemptControl, input_tokens: Any, output_tokens: Any, cost: Any,
                model: Any) -> transitions.UsageWrite:
    """`ctx.record_usage`'s write, every argument checked first (a bad one writes
    nothing); a step boundary, so a stop requested before it raises here."""
    for name, value in (("input_tokens", input_tokens), ("output_tokens", output_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
            raise InvalidInputError(f"record_usage: {name} must be a whole number >= 0, "
                                    f"not {value!r:.60}")
    if isinstance(cost, bool) or not isinstance(cost, int | float) or not math.isfinite(cost) \
            or cost < 0:
        raise InvalidInputError(f"record_usage: cost must be a finite number >= 0, "
                                f"not {cost!r:.60}")
    if not is_short_text(model, MODEL_MAX, empty=True):
        raise InvalidInputError(f"record_usage: model must be a string of at most {MODEL_MAX} "
                                f"characters with no NUL or surrogate, not {model!r:.60}")
    if not cost and model:  # no cost given: the model's configured price, if it has one
        cost = configured_cost(model, input_tokens, output_tokens) or 0.0
    control.check()
    control.usage_calls += 1  # the write's key: retried as it is, it adds nothing again
    return transitions.UsageWrite(control.ref, input_tokens, output_tokens, float(cost), model,
                                  max_events=int(app_settings.MAX_EVENTS_PER_RUN),
                                  seq=control.usage_calls)


def recorded(control: AttemptControl, agent: str, write: transitions.UsageWrite,
             result: transitions.Result) -> None:
    """Take what the usage write answered: the run's new totals, then the renewal (a lost
    lease or a cancel request stops the attempt)."""
    assert isinstance(result, UsageTotals), result
    if result.renewal is not Renewal.LOST:
        control.spent = (result.tokens, result.cost)
        metrics.observe_usage(agent, write.model, write.input_tokens + write.output_tokens,
                              write.cost)
    control.apply(result.renewal)
    _judge(control)  # after: the call that passes the budget returns; the next one stops


def _judge(control: AttemptControl) -> None:
    """Note what passed the budget; `control.check` stops the attempt at the next call."""
    if control.budget is not None and control.over_budget is None:
        control.over_budget = control.budget.exceeded_by(*control.spent)
