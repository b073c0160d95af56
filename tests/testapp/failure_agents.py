"""Agents that fail the hard ways (BaseException, an unprintable error) or whose database
connection fails under them: tests/test_failure_paths.py and test_database_restart.py."""

from __future__ import annotations

import time
from typing import Any

from django.db import connection

from django_agentruns import NotRetryable, RunContext, agent

BASE_ERRORS: dict[str, type[BaseException]] = {
    "SystemExit": SystemExit, "KeyboardInterrupt": KeyboardInterrupt,
}


class UnprintableError(NotRetryable):
    """A NotRetryable whose message cannot be had: its `__str__` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no message for you")


@agent("tests.raises_base", max_requeues=0)
def raises_base(ctx: RunContext) -> None:
    """input: {"raise": "SystemExit" | "KeyboardInterrupt"}."""
    ctx.emit("before")
    raise BASE_ERRORS[ctx.input["raise"]]("raised by the agent")


@agent("tests.async_raises_base", max_requeues=0)
async def async_raises_base(ctx: RunContext) -> dict[str, Any]:
    """input: {"raise": ...} as tests.raises_base; without it, succeeds."""
    await ctx.aemit("before")
    if "raise" in ctx.input:
        raise BASE_ERRORS[ctx.input["raise"]]("raised by the agent")
    return {"ok": True}


@agent("tests.ordered_interrupted", ordered=True)
def ordered_interrupted(ctx: RunContext) -> dict[str, Any]:
    """input: {"raise": ...} as tests.raises_base; without it, succeeds."""
    if "raise" in ctx.input:
        raise BASE_ERRORS[ctx.input["raise"]]("raised by the agent")
    return {"ok": True}


@agent("tests.unprintable", max_requeues=3)
def unprintable(ctx: RunContext) -> None:
    raise UnprintableError()


@agent("tests.healthy", max_requeues=1)
def healthy(ctx: RunContext) -> dict[str, Any]:
    """Never fails: input {"steps": n, "sleep": s}, an event and a checkpoint per step."""
    state = ctx.state or {"step": 0}
    total = int(ctx.input.get("steps", 10))
    for step in range(state["step"], total):
        ctx.emit("step", {"n": step})
        time.sleep(float(ctx.input.get("sleep", 0.2)))
        ctx.checkpoint({"step": step + 1})
    return {"steps": total}


@agent("tests.drops_connection", max_requeues=0)
def drops_connection(ctx: RunContext) -> dict[str, Any]:
    """Its first attempt closes the database connection under Django (as a server restart
    would) between two steps; nothing else fails, so it must succeed on attempt 1."""
    ctx.checkpoint({"step": 1})
    if ctx.attempt == 1:
        raw = connection.connection
        assert raw is not None  # the checkpoint just used this thread's connection
        raw.close()
    ctx.emit("after")
    ctx.heartbeat()
    ctx.checkpoint({"step": 2})
    return {"attempt": ctx.attempt}


@agent("tests.converts_stop", max_requeues=0)
def converts_stop(ctx: RunContext) -> dict[str, Any]:
    """Turns whatever its checkpoint raises (a stop too) into an error of its own."""
    try:
        ctx.checkpoint({"step": 1})
    except BaseException as exc:
        raise RuntimeError("the agent's own wrapper") from exc
    return {"attempt": ctx.attempt}
