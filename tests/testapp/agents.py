"""Agents the test suite runs, in-process and in worker subprocesses."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from django_agentruns import NotRetryable, Retryable, RunContext, agent

from .models import SideEffect


def record(ctx: RunContext, step: int = 0, note: str = "") -> None:
    SideEffect.objects.create(run_id=ctx.run_id, step=step, attempt=ctx.attempt,
                              worker=str(os.getpid()), note=note)


@agent("tests.noop")
def noop(ctx: RunContext) -> dict[str, Any]:
    return {"ok": True, "input": ctx.input}


@agent("tests.once")
def once(ctx: RunContext) -> dict[str, Any]:
    """Records one side effect per execution: exactly-once tests count them."""
    record(ctx)
    return {"run": ctx.run_id}


@agent("tests.steps")
def steps(ctx: RunContext) -> dict[str, Any]:
    """input: {"steps": n, "sleep": s}. Emits and checkpoints per step; resumes."""
    state = ctx.state or {"step": 0}
    total = int(ctx.input.get("steps", 3))
    for step in range(state["step"], total):
        ctx.emit("step", {"n": step})
        if ctx.input.get("sleep"):
            time.sleep(float(ctx.input["sleep"]))
        record(ctx, step)
        ctx.checkpoint({"step": step + 1})
    return {"steps": total}


@agent("tests.flaky", max_requeues=3)
def flaky(ctx: RunContext) -> dict[str, Any]:
    """Fails retryably until attempt input["succeed_on"] (default 2)."""
    record(ctx)
    if ctx.attempt < int(ctx.input.get("succeed_on", 2)):
        raise Retryable(f"transient failure on attempt {ctx.attempt}")
    return {"attempt": ctx.attempt}


@agent("tests.always_fails", max_requeues=2)
def always_fails(ctx: RunContext) -> None:
    record(ctx)
    raise ConnectionError("upstream unreachable")


@agent("tests.not_retryable")
def not_retryable(ctx: RunContext) -> None:
    record(ctx)
    raise NotRetryable("bad credentials")


@agent("tests.bad_output")
def bad_output(ctx: RunContext) -> Any:
    return {"value": object()}


@agent("tests.sleeper", lease_ttl=1.0)
def sleeper(ctx: RunContext) -> dict[str, Any]:
    """Sleeps input["seconds"] without touching its context: only the keeper renews."""
    record(ctx, note="start")
    time.sleep(float(ctx.input.get("seconds", 1)))
    record(ctx, note="end")
    return {"slept": ctx.input.get("seconds", 1)}


@agent("tests.heartbeats")
def heartbeats(ctx: RunContext) -> dict[str, Any]:
    """Calls heartbeat every 20 ms until input["seconds"] pass (or it is stopped)."""
    record(ctx, note="start")
    deadline = time.monotonic() + float(ctx.input.get("seconds", 30))
    while time.monotonic() < deadline:
        ctx.heartbeat()
        time.sleep(0.02)
    record(ctx, note="end")
    return {"done": True}


@agent("tests.timeout", timeout=0.3, max_requeues=1)
def times_out(ctx: RunContext) -> None:
    record(ctx)
    while True:
        ctx.heartbeat()
        time.sleep(0.02)


@agent("tests.async_steps")
async def async_steps(ctx: RunContext) -> dict[str, Any]:
    for step in range(int(ctx.input.get("steps", 2))):
        await ctx.aemit("step", {"n": step})
        await asyncio.sleep(float(ctx.input.get("sleep", 0.01)))
        await ctx.acheckpoint({"step": step + 1})
    return {"async": True}


@agent("tests.async_sleeper", timeout=0.5, max_requeues=0)
async def async_sleeper(ctx: RunContext) -> None:
    await asyncio.sleep(float(ctx.input.get("seconds", 30)))


@agent("tests.ordered", ordered=True)
def ordered(ctx: RunContext) -> dict[str, Any]:
    record(ctx, step=int(ctx.input.get("n", 0)), note=ctx.scope)
    if ctx.input.get("fail"):
        raise NotRetryable("told to fail")
    return {"n": ctx.input.get("n")}


@agent("tests.ordered_blocking", ordered=True, dead_letters_block=True)
def ordered_blocking(ctx: RunContext) -> dict[str, Any]:
    record(ctx, step=int(ctx.input.get("n", 0)), note=ctx.scope)
    if ctx.input.get("fail"):
        raise NotRetryable("told to fail")
    return {"n": ctx.input.get("n")}
