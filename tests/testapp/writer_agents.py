"""Agents that wait, then write, many times per run, and touch the ORM only through their
context: the workload of the attempt store's tests (tests/test_attempt_writes.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from django_agentruns import RunContext, agent


@agent("tests.writer", max_requeues=3)
def writer(ctx: RunContext) -> dict[str, Any]:
    """input: {"steps": n, "sleep": s}. Per step: sleep (the model call), emit, checkpoint;
    a resumed attempt starts at its checkpoint, so a replayed emit has the same id."""
    state = ctx.state or {"i": 0}
    for i in range(int(state["i"]), int(ctx.input.get("steps", 3))):
        time.sleep(float(ctx.input.get("sleep", 0.01)))
        ctx.emit("step", {"i": i})
        ctx.checkpoint({"i": i + 1})
    return {"steps": ctx.input.get("steps", 3)}


@agent("tests.async_writer", max_requeues=3)
async def async_writer(ctx: RunContext) -> dict[str, Any]:
    """The async twin of tests.writer."""
    state = ctx.state or {"i": 0}
    for i in range(int(state["i"]), int(ctx.input.get("steps", 3))):
        await asyncio.sleep(float(ctx.input.get("sleep", 0.01)))
        await ctx.aemit("step", {"i": i})
        await ctx.acheckpoint({"i": i + 1})
    return {"steps": ctx.input.get("steps", 3)}


# The connection wrappers tests.queries ran its query on, for the test to look at later.
QUERIED_ON: list[Any] = []


@agent("tests.queries")
def queries(ctx: RunContext) -> dict[str, Any]:
    """Runs a query of its own (the agent's connection, not the worker's) and notes which
    connection it used."""
    from django.db import connections

    from .models import SideEffect

    count = SideEffect.objects.count()
    QUERIED_ON.append(connections["default"])
    return {"count": count}


@agent("tests.async_queries")
async def async_queries(ctx: RunContext) -> dict[str, Any]:
    """An async agent's database call off the loop (as its waits and spawns run): the
    thread it ran on is the loop's executor's, and must not keep the connection."""
    from django.db import connections

    from django_agentruns.runtime.context import storage_call

    from .models import SideEffect

    def query() -> int:
        count = SideEffect.objects.count()
        QUERIED_ON.append(connections["default"])
        return count

    return {"count": await storage_call(ctx, query)}
