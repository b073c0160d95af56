"""Agents that wait: for a delivery, an approval, their child runs."""

from __future__ import annotations

import time
from typing import Any

from django_agentruns import RunContext, WaitTimedOut, agent

from .agents import record


@agent("tests.waits", queue="waiting")
def waits(ctx: RunContext) -> dict[str, Any]:
    """Records a side effect, checkpoints, then receives input["key"] (default "go")."""
    state = ctx.state or {"step": 0}
    if state["step"] == 0:
        record(ctx, note="before")
        ctx.checkpoint({"step": 1})
    timeout = ctx.input.get("timeout")
    try:
        payload = ctx.receive(ctx.input.get("key", "go"), timeout=timeout,
                              prompt=ctx.input.get("prompt"))
    except WaitTimedOut:
        if ctx.input.get("catch_timeout"):
            record(ctx, note="timed out")
            return {"timed_out": True}
        raise
    record(ctx, note="after")
    return {"got": payload}


@agent("tests.async_waits", queue="waiting")
async def async_waits(ctx: RunContext) -> dict[str, Any]:
    payload = await ctx.areceive("go")
    return {"got": payload}


@agent("tests.approves", queue="waiting")
def approves(ctx: RunContext) -> dict[str, Any]:
    """Proposes a refund and waits for an operator."""
    proposal = {"refund": ctx.input.get("amount", 10), "order": ctx.input.get("order", 1)}
    answer = ctx.request_approval("refund", proposal)
    return {"approved": answer.approved, "by": answer.by, "note": answer.note,
            "proposal": answer.proposal}


@agent("tests.child", queue="waiting")
def child(ctx: RunContext) -> dict[str, Any]:
    if ctx.input.get("fail"):
        from django_agentruns import NotRetryable

        raise NotRetryable(f"child {ctx.input.get('n')} failed")
    if ctx.input.get("receive"):
        return {"got": ctx.receive("go")}
    return {"n": ctx.input.get("n")}


@agent("tests.parent", queue="waiting", max_requeues=3)
def parent(ctx: RunContext) -> dict[str, Any]:
    """Spawns input["children"] children (each {"n": i, ...}), then waits for them all.

    With input["crash_after_spawn"], the first attempt fails retryably after spawning: the
    second must find the same children."""
    specs = ctx.input.get("children", [{"n": 0}])
    ids = [ctx.spawn("tests.child", spec, key=f"child-{i}") for i, spec in enumerate(specs)]
    if ctx.input.get("crash_after_spawn") and ctx.attempt == 1:
        from django_agentruns import Retryable

        raise Retryable("crashed after spawning", delay=0)
    results = ctx.wait_for_runs(ids, timeout=ctx.input.get("timeout"))
    return {str(pk): [r.status, r.reason, r.output, r.error and r.error["type"]]
            for pk, r in results.items()}


@agent("tests.waits_then_sleeps", queue="waiting", lease_ttl=1.0)
def waits_then_sleeps(ctx: RunContext) -> dict[str, Any]:
    payload = ctx.receive("go")
    time.sleep(float(ctx.input.get("sleep", 0)))
    return {"got": payload}


@agent("tests.async_parent", queue="waiting")
async def async_parent(ctx: RunContext) -> dict[str, Any]:
    """`parent` as a coroutine on the worker's loop: aspawn, await_runs, then an approval.
    Each wait is its own transaction, run off the loop (the loop never blocks on it)."""
    specs = ctx.input.get("children", [{"n": 0}])
    ids = [await ctx.aspawn("tests.child", spec, key=f"child-{i}")
           for i, spec in enumerate(specs)]
    results = await ctx.await_runs(ids)
    answer = await ctx.arequest_approval("ship", {"children": len(results)})
    return {"statuses": sorted(r.status for r in results.values()),
            "approved": answer.approved, "by": answer.by}


@agent("tests.spawns_itself", queue="waiting")
def spawns_itself(ctx: RunContext) -> dict[str, Any]:
    """Spawns one more of itself (up to input["levels"] levels) and waits for it; with
    input["fan"], spawns that many children of tests.child instead and waits for them.
    input["child_budget"] is passed as the child's budget (children then: tests.spender)."""
    if "fan" in ctx.input:
        ids = [ctx.spawn("tests.child", {"n": i}, key=f"c{i}")
               for i in range(int(ctx.input["fan"]))]
    elif "child_budget" in ctx.input:
        ids = [ctx.spawn("tests.spender", {"steps": 5}, key="spender", queue="waiting",
                         budget=ctx.input["child_budget"])]
    else:
        level = int(ctx.input.get("level", 0))
        if level >= int(ctx.input.get("levels", 50)):
            return {"level": level}
        ids = [ctx.spawn("tests.spawns_itself", {**ctx.input, "level": level + 1},
                         key="next")]
    results = ctx.wait_for_runs(ids)
    return {"children": [[r.status, r.reason] for r in results.values()]}
