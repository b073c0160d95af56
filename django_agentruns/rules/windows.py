"""Flow control's windows: what a limit key may start per rolling minute, and may spend in
tokens per minute and cost per day, besides how many of its runs run at once.

Pure vocabulary, no database. Each field of a key's limits comes from the first that sets
it of: its limits row, the longest matching pattern row, its `AGENTRUNS["LIMITS"]` entry,
the longest matching pattern entry (a key ending in `*` matches every key with that
prefix, and each matching key has its own window); else no bound.
`transitions.windows` counts the windows under the key's lock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from ..conf import SETTING_NAME, app_settings
from ..exceptions import InvalidInputError
from .limits import LARGEST_LIMIT, check_limit_key, check_max_running

FIELDS = ("max_running", "per_minute", "tokens_per_minute", "cost_per_day")
MINUTE = 60.0
DAY = 86400.0
ESTIMATE_FIELDS = ("tokens", "cost")


@dataclass(frozen=True)
class KeyLimits:
    """A key's limits; None: no bound of that kind."""

    max_running: int | None = None
    per_minute: int | None = None
    tokens_per_minute: int | None = None
    cost_per_day: float | None = None

    @property
    def windowed(self) -> bool:
        """Whether the claim must count a window (an extra statement) for this key."""
        return any(v is not None for v in (self.per_minute, self.tokens_per_minute,
                                           self.cost_per_day))

    def over(self, other: KeyLimits) -> KeyLimits:
        """These fields, else `other`'s (a row over the setting)."""
        return KeyLimits(*(getattr(self, f) if getattr(self, f) is not None
                           else getattr(other, f) for f in FIELDS))

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Estimate:
    """What a run is expected to spend, reserved in the token and cost windows at claim."""

    tokens: int | None = None
    cost: float | None = None


def is_pattern(key: str) -> bool:
    return key.endswith("*")


def matches(pattern: str, key: str) -> bool:
    return is_pattern(pattern) and not is_pattern(key) and key.startswith(pattern[:-1])


def best_pattern(key: str, patterns: Iterable[str]) -> str | None:
    """The longest pattern matching `key` (the most specific), if any."""
    found = [p for p in patterns if matches(p, key)]
    return max(found, key=len) if found else None


def check_field(name: str, value: Any) -> int | float | None:
    """One field of a key's limits, checked (None: unset)."""
    if value is None:
        return None
    if name == "max_running":
        return check_max_running(value)
    if name == "cost_per_day":
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value) or value < 0:
            raise InvalidInputError(f"cost_per_day must be None or a finite number >= 0, "
                                    f"not {value!r:.60}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**62:
        raise InvalidInputError(f"{name} must be None or a whole number >= 0, "
                                f"not {value!r:.60}")
    return value


def parse_limits(value: Any) -> KeyLimits:
    """A LIMITS value: a number (most running at once) or a dict of FIELDS."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(FIELDS), key=repr)
        if unknown:
            raise InvalidInputError(f"unknown field(s) {', '.join(map(repr, unknown))}; "
                                    f"the fields are {', '.join(FIELDS)}")
        return KeyLimits(**{f: check_field(f, value.get(f)) for f in FIELDS})  # type: ignore[arg-type]
    if value is None:
        raise InvalidInputError(f"a limit must be a whole number in 0..{LARGEST_LIMIT} or a "
                                f"dict of {', '.join(FIELDS)}, not None")
    return KeyLimits(max_running=check_max_running(value))


def settings_problem(key: Any, value: Any) -> str | None:
    """Why `LIMITS[key] = value` is refused, if it is."""
    try:
        check_limit_key(key, f"{SETTING_NAME}['LIMITS'] key")
        parse_limits(value)
    except InvalidInputError as exc:
        return str(exc)
    return None


def settings_table() -> dict[str, KeyLimits]:
    """`AGENTRUNS["LIMITS"]`, its valid entries parsed (the system check reports the rest)."""
    raw = app_settings.LIMITS or {}
    if not isinstance(raw, Mapping):
        return {}
    return {k: parse_limits(v) for k, v in raw.items() if not settings_problem(k, v)}


def from_settings(key: str, table: Mapping[str, KeyLimits] | None = None) -> KeyLimits:
    """The setting's limits of `key`: each field from its own entry, else from its longest
    matching pattern's."""
    table = settings_table() if table is None else table
    pattern = best_pattern(key, table)
    own = table.get(key, KeyLimits())
    return own.over(table[pattern]) if pattern else own


def resolve(key: str, row: KeyLimits | None, pattern_rows: Mapping[str, KeyLimits],
            table: Mapping[str, KeyLimits] | None = None) -> KeyLimits:
    """A key's limits in force: its row's fields, else its longest matching pattern row's,
    else the setting's (exact, then pattern)."""
    own = row or KeyLimits()
    pattern = best_pattern(key, pattern_rows)
    if pattern:
        own = own.over(pattern_rows[pattern])
    return own.over(from_settings(key, table))


def row_limits(row: Any) -> KeyLimits:
    """A limits row's own fields (an AgentLimit or a values() dict)."""
    get = row.get if isinstance(row, Mapping) else lambda f: getattr(row, f)
    return KeyLimits(*(get(f) for f in FIELDS))


def check_estimate(value: Any, what: str = "estimate") -> Estimate | None:
    """{"tokens": N, "cost": X} (either or both) as an Estimate; None stays None."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) - set(ESTIMATE_FIELDS):
        raise InvalidInputError(f'{what} must be a dict like {{"tokens": 4000, "cost": 0.02}}, '
                                f"not {value!r:.80}")
    tokens, cost = value.get("tokens"), value.get("cost")
    if tokens is not None and check_field("tokens_per_minute", tokens) is None:
        raise InvalidInputError(f"{what}['tokens'] must be a whole number >= 0")
    try:
        check_field("cost_per_day", cost)
    except InvalidInputError:
        raise InvalidInputError(f"{what}['cost'] must be a finite number >= 0, "
                                f"not {cost!r:.60}") from None
    return Estimate(tokens=tokens, cost=None if cost is None else float(cost))


def with_field(limits: KeyLimits, name: str, value: Any) -> KeyLimits:
    return replace(limits, **{name: value})


def settings_limits() -> dict[str, int]:
    """The setting's most-running-at-once of each exact key (paused keys: 0)."""
    return {k: v.max_running for k, v in settings_table().items()
            if v.max_running is not None and not is_pattern(k)}


def effective_limit(key: str, max_running: int | None) -> int | None:
    """A key's most running at once: its row's value, else the setting's, else None."""
    if max_running is not None:
        return max_running
    return from_settings(key).max_running


class _Keep:
    """`set_limit`'s default: leave the field as it is (None resets it to the setting)."""

    def __repr__(self) -> str:
        return "KEEP"


KEEP: Any = _Keep()
