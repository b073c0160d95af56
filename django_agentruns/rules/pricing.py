"""Model prices configured in `AGENTRUNS["MODEL_PRICES"]`, and the cost of a model call.

    AGENTRUNS = {"MODEL_PRICES": {"gpt-4o-mini": {"input": 0.15, "output": 0.6},
                                  "gpt-4o-mini-*": {"input": 0.15, "output": 0.6}}}

Prices are per million tokens, in the currency the app counts budgets in. A key is a model
name as the provider reports it, or a pattern ending in `*` (a dated snapshot such as
`gpt-4o-mini-2024-07-18`); an exact name wins, then the longest pattern. `ctx.record_usage`
prices a call given no cost; the framework integrations prefer a configured price to the
one their framework knows. Pure: no database.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..conf import app_settings

PER = 1_000_000  # prices are per million tokens
FIELDS = ("input", "output")
MODEL_MAX = 100  # RunUsage.model


@dataclass(frozen=True)
class Price:
    """Per million tokens: what a prompt token and a generated token cost."""

    input: float
    output: float

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input + output_tokens * self.output) / PER


def problem(key: Any, value: Any) -> str | None:
    """What is wrong with one entry of MODEL_PRICES (None: nothing); for the system check."""
    if not isinstance(key, str) or not 1 <= len(key) <= MODEL_MAX or "*" in key[:-1]:
        return (f"a key is a model name of 1-{MODEL_MAX} characters, or a pattern with one "
                f"'*' at its end, not {key!r:.60}")
    if not isinstance(value, dict) or set(value) != set(FIELDS):
        return f'the price is a dict {{"input": X, "output": Y}}, not {value!r:.80}'
    for name in FIELDS:
        price = value[name]
        if isinstance(price, bool) or not isinstance(price, int | float) \
                or not math.isfinite(price) or price < 0:
            return f"{name} must be a finite number >= 0 (per million tokens), not {price!r:.40}"
    return None


def price_of(model: str, prices: dict[str, Any] | None = None) -> Price | None:
    """The configured price of `model` (an exact key, else the longest matching pattern),
    or None. Entries with a problem are skipped (the system check reports them)."""
    table = app_settings.MODEL_PRICES if prices is None else prices
    if not model or not isinstance(table, dict):
        return None
    candidates = [model] if model in table else sorted(
        (key for key in table if isinstance(key, str) and key.endswith("*")
         and model.startswith(key[:-1])), key=len, reverse=True)
    for key in candidates:
        if problem(key, table[key]) is None:
            return Price(float(table[key]["input"]), float(table[key]["output"]))
    return None


def configured_cost(model: str, input_tokens: int, output_tokens: int) -> float | None:
    """The call's cost at `model`'s configured price, or None when it has none."""
    price = price_of(model)
    return None if price is None else price.cost(input_tokens, output_tokens)
