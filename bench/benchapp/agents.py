"""django-agentruns agents for the benchmark (autodiscovered like every `agents` module)."""

from __future__ import annotations

import asyncio
import time

from django_agentruns import RunContext, agent

from .probe import record_start


@agent("bench.noop")
def noop(ctx: RunContext) -> None:
    return None


@agent("bench.sleep_sync")
def sleep_sync(ctx: RunContext) -> None:
    time.sleep(0.1)


@agent("bench.sleep_async")
async def sleep_async(ctx: RunContext) -> None:
    await asyncio.sleep(0.1)


@agent("bench.latency")
def latency(ctx: RunContext) -> None:
    record_start(ctx.input)


# LLM-shaped: three model calls of 0.4 s, an event after each, a checkpoint after the
# second (resumed from on a retry). The run lasts 1.2 s of waiting and four writes.
LLM_CALL = 0.4


@agent("bench.llm_sync")
def llm_sync(ctx: RunContext) -> None:
    for step in range((ctx.state or {}).get("next", 0), 3):
        time.sleep(LLM_CALL)
        ctx.emit("llm.step", {"step": step, "tokens": 256})
        if step == 1:
            ctx.checkpoint({"next": 2})


@agent("bench.llm_async")
async def llm_async(ctx: RunContext) -> None:
    for step in range((ctx.state or {}).get("next", 0), 3):
        await asyncio.sleep(LLM_CALL)
        await ctx.aemit("llm.step", {"step": step, "tokens": 256})
        if step == 1:
            await ctx.acheckpoint({"next": 2})
