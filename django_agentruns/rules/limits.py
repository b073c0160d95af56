"""Flow control's vocabulary: limit keys, limits per key, and token/cost budgets.

Pure checks, no database (`api.set_limit` writes a limit, `transitions.limited` claims
under them). A run's limit key is resolved once, at enqueue
(`resolve_limit_key`), and stored on the run; the claim (transitions.limited) reads the
limits table under a lock per key. A key's limits (running at once, and its windows) are
in django_agentruns.rules.windows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..exceptions import InvalidInputError
from ..validation import check_short_text

KEY_MAX = 200  # AgentRun.limit_key, AgentLimit.key
LARGEST_LIMIT = 2**31 - 1
BUDGET_FIELDS = ("tokens", "cost")

LimitKey = str | list[str] | Callable[[Any], "str | list[str] | None"] | None
MAX_FAILOVER_KEYS = 20


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
    """`@agent(limit_key=...)`: a key, a list of keys (failover, in order of preference), or
    a callable of the input returning either."""
    if value is None or callable(value):
        return
    check_keys(value, f"Agent {name!r}: limit_key")


def check_keys(value: Any, what: str = "limit_key") -> tuple[str, ...]:
    """A key, or a non-empty list of distinct keys, as a tuple (failover order)."""
    if isinstance(value, list | tuple):
        if not value or len(value) > MAX_FAILOVER_KEYS:
            raise InvalidInputError(f"{what} as a list must hold 1-{MAX_FAILOVER_KEYS} keys, "
                                    f"not {len(value)}")
        keys = tuple(check_limit_key(k, what) for k in value)
        if len(set(keys)) != len(keys):
            raise InvalidInputError(f"{what} lists a key twice: {list(keys)!r:.120}")
        return keys
    return (check_limit_key(value, what),)


def resolve_limit_key(agent: str, default: LimitKey, override: Any, input: Any
                      ) -> tuple[str, ...]:
    """The keys of a new run, in failover order (): `enqueue(limit_key=...)`, else the
    agent's (a callable is called with the input), else none. Raises InvalidInputError
    for a bad one."""
    if override is not None:
        return check_keys(override)
    if default is None:
        return ()
    if callable(default):
        try:
            key = default(input)
        except Exception as exc:
            raise InvalidInputError(f"Agent {agent!r}: limit_key({input!r:.80}) raised "
                                    f"{type(exc).__name__}: {exc}") from exc
        return () if key is None else check_keys(key, f"Agent {agent!r}: limit_key(input)")
    return check_keys(default)


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
