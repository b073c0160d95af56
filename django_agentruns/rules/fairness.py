"""Fair shares: a run's fairness group (`fair_key`) and the groups' weights.

Pure checks, no database. Within a queue, the claim takes runs in turns across the groups
that have a due run (by the virtual starts enqueue stamps: transitions.fair), weighted by
`AGENTRUNS["FAIR_WEIGHTS"]` (a group not listed weighs 1; weights apply at enqueue),
instead of oldest first across all of them: priority first, then fairness, then age. Runs
without a key form one group of their own ("").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..conf import app_settings
from ..exceptions import InvalidInputError
from ..validation import check_short_text

FAIR_KEY_MAX = 200  # AgentRun.fair_key, FairGroup.key
LARGEST_WEIGHT = 1e6

FairKey = str | Callable[[Any], "str | None"] | None


def check_fair_key(value: Any, what: str = "fair_key") -> str:
    """A fairness group is 1-200 characters with no NUL or surrogate."""
    return check_short_text(value, what, FAIR_KEY_MAX)


def check_agent_fair_key(name: str, value: Any) -> None:
    """`@agent(fair_key=...)`: a group, or a callable of the input returning one (or None)."""
    if value is None or callable(value):
        return
    check_fair_key(value, f"Agent {name!r}: fair_key")


def resolve_fair_key(agent: str, default: FairKey, override: Any, input: Any) -> str:
    """A new run's group: `enqueue(fair_key=...)`, else the agent's (a callable is called
    with the input), else none (""). Raises InvalidInputError for a bad one."""
    if override is not None:
        return check_fair_key(override)
    if default is None:
        return ""
    if callable(default):
        try:
            key = default(input)
        except Exception as exc:
            raise InvalidInputError(f"Agent {agent!r}: fair_key({input!r:.80}) raised "
                                    f"{type(exc).__name__}: {exc}") from exc
        return "" if key is None else check_fair_key(key, f"Agent {agent!r}: fair_key(input)")
    return check_fair_key(default)


def weight_problem(key: Any, value: Any) -> str | None:
    """Why FAIR_WEIGHTS[key] = value is wrong, or None."""
    if not isinstance(key, str) or (key and len(key) > FAIR_KEY_MAX):
        return f"a key is a fair_key (a string of at most {FAIR_KEY_MAX} characters)"
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or not 0 < value <= LARGEST_WEIGHT:
        return f"a weight is a number above 0 and at most {LARGEST_WEIGHT:g}"
    return None


def fair_weights() -> tuple[tuple[str, float], ...]:
    """The groups with a weight other than 1, sorted (a hashable shape for the claim's
    statement cache); entries the system check reports are left out."""
    raw = app_settings.FAIR_WEIGHTS or {}
    if not isinstance(raw, dict):
        return ()
    return tuple(sorted((k, float(v)) for k, v in raw.items()
                        if weight_problem(k, v) is None and float(v) != 1.0))
