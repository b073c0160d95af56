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
