"""Agents made of durable steps (`ctx.step`): each step's execution is counted in
SideEffect (note: the step's key), so tests see how often a step really ran."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from django_agentruns import NotRetryable, Retryable, RunContext, agent
from django_agentruns.runtime import steps

from .models import SideEffect

if os.environ.get("AGENTRUNS_TEST_START_HELD"):
    # A worker subprocess of a test that kills it inside a step whose start is still held.
    steps.START_HELD = float(os.environ["AGENTRUNS_TEST_START_HELD"])
if os.environ.get("AGENTRUNS_TEST_END_HELD"):
    # ... or after an async step whose end is still held.
    steps.END_HELD = float(os.environ["AGENTRUNS_TEST_END_HELD"])


def executed(ctx: RunContext, step: int, note: str = "") -> None:
    """One real execution of a step, with its key (as it was inside the step)."""
    SideEffect.objects.create(run_id=ctx.run_id, step=step, attempt=ctx.attempt,
                              note=note or str(ctx.step_key))


def executed_off_loop(ctx: RunContext, step: int, note: str) -> None:
    """`executed` on a thread of the loop's executor, whose connection is closed after."""
    from django.db import connection

    try:
        executed(ctx, step, note)
    finally:
        connection.close()


def executions(run_id: int, step: int | None = None) -> list[str]:
    qs = SideEffect.objects.filter(run_id=run_id).order_by("id")
    if step is not None:
        qs = qs.filter(step=step)
    return list(qs.values_list("note", flat=True))


@agent("tests.step_chain", max_requeues=3)
def step_chain(ctx: RunContext) -> dict[str, Any]:
    """input: {"n": steps, "pause_after": i, "hang_in": i, "sleep": s}. Step i records its
    execution and returns {"i": i}. On attempt 1 only: a long pause after step
    `pause_after` (outside any step) or inside step `hang_in`, so a test can kill the
    worker there."""
    results = []
    for i in range(int(ctx.input.get("n", 3))):
        def call(i: int = i) -> dict[str, Any]:
            executed(ctx, i)
            if ctx.attempt == 1 and ctx.input.get("hang_in") == i:
                time.sleep(60)
            if ctx.input.get("sleep"):
                time.sleep(float(ctx.input["sleep"]))
            return {"i": i, "key": ctx.step_key}

        results.append(ctx.step("call", call))
        if ctx.attempt == 1 and ctx.input.get("pause_after") == i:
            time.sleep(60)
    return {"results": results}


@agent("tests.step_wait")
def step_wait(ctx: RunContext) -> dict[str, Any]:
    """A step, a wait for "go", a step: the resumed attempt replays the first."""
    before = ctx.step("before", lambda: executed(ctx, 0) or "b")
    go = ctx.receive("go")
    after = ctx.step("after", lambda: executed(ctx, 1) or f"a:{go}")
    return {"before": before, "after": after}


@agent("tests.step_retry", max_requeues=0)
def step_retry(ctx: RunContext) -> dict[str, Any]:
    """input: {"fail": n, "retries": r, "error": "retryable"|"fatal"}: the step raises on
    its first n executions, and is retried r times within the attempt."""
    def flaky() -> str:
        executed(ctx, 0)
        if len(executions(ctx.run_id)) <= int(ctx.input.get("fail", 0)):
            if ctx.input.get("error") == "fatal":
                raise NotRetryable("no use trying again")
            raise Retryable("blip", delay=0.01)
        return "ok"

    return {"result": ctx.step("flaky", flaky, retries=int(ctx.input.get("retries", 0)))}


@agent("tests.step_timeout", max_requeues=0)
def step_timeout(ctx: RunContext) -> dict[str, Any]:
    """A sync step that sleeps input["sleep"] s, bounded by input["timeout"] s."""
    def slow() -> str:
        executed(ctx, 0)
        time.sleep(float(ctx.input["sleep"]))
        executed(ctx, 1, "late")
        return "slow"

    return {"result": ctx.step("slow", slow, timeout=float(ctx.input["timeout"]))}


@agent("tests.step_loop")
def step_loop(ctx: RunContext) -> dict[str, Any]:
    """The same step name in a loop: occurrences 1..n, with usage recorded inside each."""
    drafts = []
    for i in range(int(ctx.input.get("n", 3))):
        def draft(i: int = i) -> str:
            executed(ctx, i)
            ctx.record_usage(input_tokens=10, output_tokens=i, cost=0.5)
            return f"draft {i}"

        drafts.append(ctx.step("draft", draft))
    if ctx.attempt == 1 and ctx.input.get("fail"):
        raise Retryable("after the steps", delay=0)
    return {"drafts": drafts}


@agent("tests.async_step_chain")
async def async_step_chain(ctx: RunContext) -> dict[str, Any]:
    """input: {"n": steps, "timeout": s, "sleep": s, "pause_after": i}: async steps
    (astep); on attempt 1, a long pause after step `pause_after` (no write after it)."""
    async def call(i: int) -> dict[str, Any]:
        await asyncio.to_thread(executed_off_loop, ctx, i, str(ctx.step_key))
        await asyncio.sleep(float(ctx.input.get("sleep", 0)))
        return {"i": i, "key": ctx.step_key}

    results = []
    for i in range(int(ctx.input.get("n", 3))):
        results.append(await ctx.astep("call", call, i, timeout=ctx.input.get("timeout")))
        if ctx.attempt == 1 and ctx.input.get("pause_after") == i:
            await asyncio.sleep(60)
    return {"results": results}


@agent("tests.step_chain_more")
def step_chain_more(ctx: RunContext) -> dict[str, Any]:
    """tests.step_chain's steps, then one more that it never had: a changed agent a
    replaying fork runs against the recorded steps."""
    chained = step_chain(ctx)
    return {**chained, "review": ctx.step("review", lambda: executed(ctx, 99) or "fine")}
