"""Flow control's vocabulary: limit keys, limits per key, and token/cost budgets.

Pure checks, no database (`api.set_limit` writes a limit, `transitions.limited` claims
under them). A run's limit key is resolved once, at enqueue
(`resolve_limit_key`), and stored on the run; the claim (transitions.limited) reads the
limits table under a lock per key. A key's limit is its row's `max_running`, else
`AGENTRUNS["LIMITS"][key]`, else none (unlimited).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .conf import SETTING_NAME, app_settings
from .exceptions import InvalidInputError
from .validation import check_short_text

KEY_MAX = 200  # AgentRun.limit_key, AgentLimit.key
LARGEST_LIMIT = 2**31 - 1
BUDGET_FIELDS = ("tokens", "cost")

LimitKey = str | Callable[[Any], "str | None"] | None


def check_limit_key(value: Any, what: str = "limit_key") -> str:
    """A limit key is 1-200 characters with no NUL or surrogate."""
    return check_short_text(value, what, KEY_MAX)


def check_max_running(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= LARGEST_LIMIT:
        raise InvalidInputError(f"max_running must be None or a whole number in "
                                f"0..{LARGEST_LIMIT}, not {value!r:.60}")
    return value


def check_agent_limit_key(name: str, value: Any) -> None:
    """`@agent(limit_key=...)`: a key, or a callable of the input returning one."""
    if value is None or callable(value):
        return
    check_limit_key(value, f"Agent {name!r}: limit_key")


def resolve_limit_key(agent: str, default: LimitKey, override: Any, input: Any) -> str:
    """The key stored on a new run: `enqueue(limit_key=...)`, else the agent's (a callable
    is called with the input), else "" (no key). Raises InvalidInputError for a bad one."""
    if override is not None:
        return check_limit_key(override)
    if default is None:
        return ""
    if callable(default):
        try:
            key = default(input)
        except Exception as exc:
            raise InvalidInputError(f"Agent {agent!r}: limit_key({input!r:.80}) raised "
                                    f"{type(exc).__name__}: {exc}") from exc
        return "" if key is None else check_limit_key(key, f"Agent {agent!r}: limit_key(input)")
    return check_limit_key(default)


# --------------------------------------------------------------------------- budgets


@dataclass(frozen=True)
class Budget:
    """Most tokens (input + output) and cost a run may record; None: no bound."""

    tokens: int | None = None
    cost: float | None = None

    def exceeded_by(self, tokens: int, cost: float) -> str | None:
        """What passed the budget, if anything ("tokens 1200 > 1000")."""
        if self.tokens is not None and tokens > self.tokens:
            return f"tokens {tokens} > {self.tokens}"
        if self.cost is not None and cost > self.cost:
            return f"cost {cost:g} > {self.cost:g}"
        return None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in (("tokens", self.tokens), ("cost", self.cost)) if v is not None}


def check_budget(value: Any, what: str = "budget") -> Budget | None:
    """{"tokens": N, "cost": X} (either or both) as a Budget; None stays None."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidInputError(f'{what} must be a dict like {{"tokens": 200000, "cost": 2.0}}, '
                                f"not {value!r:.80}")
    unknown = sorted(set(value) - set(BUDGET_FIELDS), key=repr)
    if unknown:
        raise InvalidInputError(f"{what} has unknown field(s) {', '.join(map(repr, unknown))}; "
                                f"the fields are {', '.join(BUDGET_FIELDS)}")
    tokens, cost = value.get("tokens"), value.get("cost")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)
                               or not 0 <= tokens < 2**63):
        raise InvalidInputError(f"{what}['tokens'] must be a whole number >= 0, not {tokens!r}")
    if cost is not None and (isinstance(cost, bool) or not isinstance(cost, int | float)
                             or not math.isfinite(cost) or cost < 0):
        raise InvalidInputError(f"{what}['cost'] must be a finite number >= 0, not {cost!r}")
    return Budget(tokens=tokens, cost=None if cost is None else float(cost))


def effective_budget(run_budget: Any, agent_budget: Budget | None) -> Budget | None:
    """The run's own budget (an operator's retry set it) wins over its agent's."""
    if run_budget:
        try:
            return check_budget(run_budget)
        except InvalidInputError:
            return agent_budget  # a hand-edited row: keep the agent's rather than none
    return agent_budget


# --------------------------------------------------------------------------- limits


def settings_limits() -> dict[str, int]:
    """`AGENTRUNS["LIMITS"]`, the valid entries (the system check reports the rest)."""
    raw = app_settings.LIMITS or {}
    if not isinstance(raw, Mapping):
        return {}
    return {k: v for k, v in raw.items() if not limits_problem(k, v)}


def limits_problem(key: Any, value: Any) -> str | None:
    """Why `LIMITS[key] = value` is refused, if it is."""
    try:
        check_limit_key(key, f"{SETTING_NAME}['LIMITS'] key")
        if value is None:
            raise InvalidInputError("a limit must be a whole number >= 0, not None")
        check_max_running(value)
    except InvalidInputError as exc:
        return str(exc)
    return None


def effective_limit(key: str, max_running: int | None) -> int | None:
    """A key's limit: its row's value, else the setting's, else None (unlimited)."""
    if max_running is not None:
        return max_running
    return settings_limits().get(key)

