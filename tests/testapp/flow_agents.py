"""Agents of flow control (limits per key, snoozes, budgets): tests/test_snooze.py,
test_key_limits.py and test_budgets.py."""

from __future__ import annotations

import time
from typing import Any

from django_agentruns import RunContext, Snooze, agent


class RateLimitError(Exception):
    """Shaped like an OpenAI-style client's error: a status and a response with headers."""

    def __init__(self, status: int, retry_after: str | None) -> None:
        super().__init__(f"HTTP {status}")
        self.status_code = status
        self.response = type("Response", (), {
            "status_code": status,
            "headers": {} if retry_after is None else {"retry-after": retry_after}})()


def _key(input: Any) -> str | None:
    return input.get("key") if isinstance(input, dict) else None


@agent("tests.rate_limited", limit_key=_key, max_requeues=3)
def rate_limited(ctx: RunContext) -> dict[str, Any]:
    """A 429 with `Retry-After: input["retry_after"]` (default "1") on its first
    input["limited"] attempts (default: always), then succeeds."""
    if ctx.attempt <= int(ctx.input.get("limited", 10**6)):
        raise RateLimitError(int(ctx.input.get("status", 429)),
                             str(ctx.input.get("retry_after", "1")))
    return {"attempt": ctx.attempt}


@agent("tests.snoozer", max_requeues=1)
def snoozer(ctx: RunContext) -> dict[str, Any]:
    """`raise Snooze(input["delay"])` on its first input["times"] attempts."""
    if ctx.attempt <= int(ctx.input.get("times", 1)):
        raise Snooze(ctx.input.get("delay", 0))
    return {"attempt": ctx.attempt}


@agent("tests.keyed", limit_key=_key)
def keyed(ctx: RunContext) -> dict[str, Any]:
    """Runs input["seconds"] (default 0.2) with heartbeats; its key is input["key"]."""
    deadline = time.monotonic() + float(ctx.input.get("seconds", 0.2))
    while time.monotonic() < deadline:
        ctx.heartbeat()
        time.sleep(0.02)
    return {"key": ctx.input.get("key")}


@agent("tests.keyed_openai", limit_key="openai")
def keyed_openai(ctx: RunContext) -> None:
    """Has a fixed key, which enqueue(limit_key=...) may override."""


@agent("tests.spender", budget={"tokens": 1000})
def spender(ctx: RunContext) -> dict[str, Any]:
    """input["steps"] steps (default 5), each recording 400 tokens then checkpointing."""
    state = ctx.state or {"step": 0}
    for step in range(state["step"], int(ctx.input.get("steps", 5))):
        ctx.record_usage(input_tokens=300, output_tokens=100, cost=0.01, model="gpt-test")
        ctx.checkpoint({"step": step + 1})
    return {"steps": ctx.state["step"] if ctx.state else 0}


@agent("tests.async_spender", budget={"cost": 0.025})
async def async_spender(ctx: RunContext) -> dict[str, Any]:
    """As tests.spender, async, with a cost budget."""
    state = ctx.state or {"step": 0}
    for step in range(state["step"], int(ctx.input.get("steps", 5))):
        await ctx.arecord_usage(input_tokens=300, output_tokens=100, cost=0.01, model="m")
        await ctx.acheckpoint({"step": step + 1})
    return {"done": True}


def _broken_key(input: Any) -> str:
    raise KeyError("tenant")


@agent("tests.keyed_broken", limit_key=_broken_key)
def keyed_broken(ctx: RunContext) -> None:
    """Its limit_key callable raises: enqueue refuses the run."""


@agent("tests.asks_a_delay", max_requeues=2)
def asks_a_delay(ctx: RunContext) -> None:
    """Fails with `Retryable(delay=input["delay"])` (a float; "inf"/"nan" as strings), or
    with a 429 whose Retry-After is input["retry_after"]."""
    from django_agentruns import Retryable

    if "retry_after" in ctx.input:
        raise RateLimitError(429, str(ctx.input["retry_after"]))
    raise Retryable("later", delay=float(ctx.input["delay"]))


@agent("tests.polite_spender", budget={"tokens": 1000})
def polite_spender(ctx: RunContext) -> dict[str, Any]:
    """Checks `ctx.stop_requested` before each (paid) model call, as an agent should: each
    call is a SideEffect row, then 400 tokens recorded. At most 10 calls."""
    from .agents import record

    calls = 0
    while not ctx.stop_requested and calls < 10:
        record(ctx, step=calls, note="model call")
        calls += 1
        ctx.record_usage(input_tokens=400, model="m")
    return {"calls": calls}


@agent("tests.estimated", limit_key=_key, estimate={"tokens": 1000, "cost": 0.5})
def estimated(ctx: RunContext) -> dict[str, Any]:
    """Reserves 1000 tokens and 0.5 at claim; records input["tokens"] (default 1000) and
    input["cost"] (default 0), after input["seconds"] (default 0; on its first attempt
    input["first_seconds"] if given)."""
    seconds = ctx.input.get("first_seconds") if ctx.attempt == 1 else None
    deadline = time.monotonic() + float(seconds or ctx.input.get("seconds", 0))
    while time.monotonic() < deadline:
        ctx.heartbeat()
        time.sleep(0.02)
    ctx.record_usage(input_tokens=int(ctx.input.get("tokens", 1000)), output_tokens=0,
                     cost=float(ctx.input.get("cost", 0.0)), model="m")
    return {"key": ctx.input.get("key")}


@agent("tests.failover", limit_key=["prov:a", "prov:b"], max_requeues=0)
def failover(ctx: RunContext) -> dict[str, Any]:
    """A 429 (Retry-After: 120) while it runs under input["fail_on"]; says which key it got."""
    if ctx.limit_key == ctx.input.get("fail_on"):
        raise RateLimitError(429, "120")
    return {"key": ctx.limit_key, "attempt": ctx.attempt}


@agent("tests.tenant", fair_key=lambda input: input.get("tenant"))
def tenant(ctx: RunContext) -> dict[str, Any]:
    """A run of tenant input["tenant"] (its fairness group), taking input["seconds"]."""
    time.sleep(float(ctx.input.get("seconds", 0)))
    return {"tenant": ctx.input.get("tenant")}
