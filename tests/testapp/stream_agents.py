"""Agents that stream live output (`ctx.stream`), for tests/test_stream_chunks.py and the
live page's browser test."""

from __future__ import annotations

import asyncio
from typing import Any

from django_agentruns import RunContext, agent

from .agents import _until_gate, gate_open, record


@agent("tests.streamer")
def streamer(ctx: RunContext) -> dict[str, Any]:
    """Streams input["n"] words ("w0 ", "w1 ", ...) on input["channel"]; with input["gate"]
    then waits for its gate (no step boundary: the words are only live meanwhile) and
    streams input["after"] more ("a0 ", ...); input["emit"] emits a step in between."""
    channel = ctx.input.get("channel", "output")
    for i in range(int(ctx.input.get("n", 10))):
        ctx.stream(f"w{i} ", channel=channel)
    if ctx.input.get("emit"):
        ctx.emit("step", {"n": 0})
    if ctx.input.get("gate"):
        _until_gate(ctx, beat=False)
    for i in range(int(ctx.input.get("after", 0))):
        ctx.stream(f"a{i} ", channel=channel)
    return {"streamed": True}


@agent("tests.async_streamer")
async def async_streamer(ctx: RunContext) -> dict[str, Any]:
    """The async twin: `await ctx.astream`, then waits for its gate, then one more word."""
    for i in range(int(ctx.input.get("n", 10))):
        await ctx.astream(f"w{i} ")
    while not await asyncio.to_thread(gate_open, ctx.run_id):
        await asyncio.sleep(0.02)
    await ctx.astream("last")
    return {"streamed": True}


@agent("tests.stream_retry", max_requeues=2)
def stream_retry(ctx: RunContext) -> dict[str, Any]:
    """Streams a word, reaches a boundary, streams one more; attempt 1 then fails."""
    from django_agentruns import Retryable

    ctx.stream(f"first{ctx.attempt} ")
    ctx.emit("step", {"n": 0})
    ctx.stream(f"then{ctx.attempt} ")
    if ctx.attempt == 1:
        raise Retryable("fails once")
    return {"attempt": ctx.attempt}


@agent("tests.stream_bad")
def stream_bad(ctx: RunContext) -> None:
    """Streams input["text"] on input["channel"] (a bad one, in the tests)."""
    record(ctx)
    ctx.stream(ctx.input["text"], channel=ctx.input.get("channel", "output"))


@agent("tests.stream_bench", lease_ttl=30.0)
async def stream_bench(ctx: RunContext) -> dict[str, Any]:
    """bench/streaming.py's agent: streams input["rate"] chunks a second for
    input["seconds"] from input["start_at"] (epoch seconds), each chunk its send time
    (`time.time()`) and a `;`; with input["quiet"] it only sleeps as long (the same load
    without streaming)."""
    import time

    rate, seconds = float(ctx.input["rate"]), float(ctx.input["seconds"])
    # All runs start together, once the bench's streams are open.
    await asyncio.sleep(max(0.0, float(ctx.input.get("start_at", 0)) - time.time()))
    start = time.monotonic()
    sent = 0
    while (elapsed := time.monotonic() - start) < seconds:
        due = int(elapsed * rate) + 1
        while sent < due:
            if not ctx.input.get("quiet"):
                await ctx.astream(f"{time.time():.6f};")
            sent += 1
        await asyncio.sleep(max(0.0, sent / rate - (time.monotonic() - start)))
    return {"sent": sent}


@agent("tests.stream_then_wait")
def stream_then_wait(ctx: RunContext) -> dict[str, Any]:
    """Streams a word, then receives "answer" (the run waits), then streams the answer."""
    ctx.stream(f"asked{ctx.attempt} ")
    answer = ctx.receive("answer")
    ctx.stream(f"got {answer}")
    return {"answer": answer}


@agent("tests.async_stream_then_wait")
async def async_stream_then_wait(ctx: RunContext) -> dict[str, Any]:
    """The async twin of tests.stream_then_wait."""
    await ctx.astream(f"asked{ctx.attempt} ")
    answer = await ctx.areceive("answer")
    await ctx.astream(f"got {answer}")
    return {"answer": answer}
