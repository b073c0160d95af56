"""django-agentruns agents for the benchmark (autodiscovered like every `agents` module)."""

from __future__ import annotations

import asyncio
import time

from django_agentruns import RunContext, agent

from .probe import record_start


@agent("bench.noop")
def noop(ctx: RunContext) -> None:
    return None


@agent("bench.tenant", fair_key=lambda input: (input or {}).get("t"))
def tenant(ctx: RunContext) -> None:
    """A no-op run of fairness group input["t"] (bench/fair.py)."""


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


# The same calls as durable steps (`ctx.step`): each call's result stored once, so a retry
# pays for none of them again; the event after each as above, no checkpoint needed.
# Compared with the rows above, this is the cost of a step (in a run's first attempt, one
# fenced write each: its end, which writes its held start too; an async step's end rides
# on the emit after it, one queued write for both; docs/steps.md).


def _model_call() -> dict[str, int]:
    time.sleep(LLM_CALL)
    return {"tokens": 256}


async def _amodel_call() -> dict[str, int]:
    await asyncio.sleep(LLM_CALL)
    return {"tokens": 256}


@agent("bench.llm_steps_sync")
def llm_steps_sync(ctx: RunContext) -> None:
    for step in range(3):
        reply = ctx.step("model", _model_call)
        ctx.emit("llm.step", {"step": step, "tokens": reply["tokens"]})


@agent("bench.llm_steps_async")
async def llm_steps_async(ctx: RunContext) -> None:
    for step in range(3):
        reply = await ctx.astep("model", _amodel_call)
        await ctx.aemit("llm.step", {"step": step, "tokens": reply["tokens"]})
