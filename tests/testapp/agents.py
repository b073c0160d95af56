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


@agent("tests.ordered_barrier", ordered=True)
def ordered_barrier(ctx: RunContext) -> dict[str, Any]:
    """Records a "barrier" row, then waits until input["expect"] such rows exist.

    Ordering tests give the first run of several scopes expect=N: they can only all
    succeed if those scopes' runs execute at the same time. Fails after input["wait"] s.
    """
    record(ctx, step=int(ctx.input.get("n", 0)), note="barrier")
    deadline = time.monotonic() + float(ctx.input.get("wait", 10))
    while SideEffect.objects.filter(note="barrier").count() < int(ctx.input.get("expect", 0)):
        if time.monotonic() > deadline:
            raise NotRetryable("barrier not reached: scopes did not run in parallel")
        ctx.heartbeat()
        time.sleep(0.01)
    return {"n": ctx.input.get("n")}


@agent("tests.emit_resume")
def emit_resume(ctx: RunContext) -> dict[str, Any]:
    """Emits "a", checkpoints, emits "b", fails on attempt 1; the retry emits "b", "c".

    The reference implementation numbered emitted ids from zero per attempt, so the
    resumed "b" collided with "a" and one event was lost.
    """
    state = ctx.state or {"phase": 0}
    if state["phase"] == 0:
        ctx.emit("a", {"attempt": ctx.attempt})
        ctx.checkpoint({"phase": 1})
    ctx.emit("b", {"attempt": ctx.attempt})
    if ctx.attempt < int(ctx.input.get("succeed_on", 2)):
        raise Retryable(f"fails after emitting on attempt {ctx.attempt}")
    ctx.emit("c", {"attempt": ctx.attempt})
    return {"attempt": ctx.attempt}


@agent("tests.resumable", max_requeues=3)
def resumable(ctx: RunContext) -> dict[str, Any]:
    """input: {"steps": n, "fail_at": k, "sleep": s}. One SideEffect and a checkpoint per
    step; the first attempt fails retryably before step k. Notes where each attempt began."""
    state = ctx.state or {"step": 0}
    record(ctx, step=-1, note=f"resume:{state['step']}")
    for step in range(state["step"], int(ctx.input.get("steps", 3))):
        if step == ctx.input.get("fail_at") and ctx.attempt == 1:
            raise Retryable(f"transient failure before step {step}")
        if ctx.input.get("sleep"):
            time.sleep(float(ctx.input["sleep"]))
        record(ctx, step)
        ctx.checkpoint({"step": step + 1})
    return {"steps": ctx.input.get("steps", 3)}


@agent("tests.bad_checkpoint")
def bad_checkpoint(ctx: RunContext) -> None:
    record(ctx)
    ctx.checkpoint({"when": object()})


def gate_open(run_id: int) -> bool:
    """A test opens a run's gate by writing SideEffect(run_id=..., note="open")."""
    return SideEffect.objects.filter(run_id=run_id, note="open").exists()


def _until_gate(ctx: RunContext, *, beat: bool) -> None:
    """Loop in 20 ms sleeps until the gate opens or input["seconds"] (default 30) pass."""
    deadline = time.monotonic() + float(ctx.input.get("seconds", 30))
    while time.monotonic() < deadline and not gate_open(ctx.run_id):
        if beat:
            ctx.heartbeat()
        time.sleep(0.02)


@agent("tests.gate")
def gate(ctx: RunContext) -> dict[str, Any]:
    """Heartbeats (a step boundary every 20 ms) until the test opens its gate."""
    record(ctx, note="start")
    _until_gate(ctx, beat=True)
    record(ctx, note="end")
    return {"gate": "opened"}


@agent("tests.busy_sleep")
def busy_sleep(ctx: RunContext) -> dict[str, Any]:
    """A `time.sleep` loop that makes no context call until the test opens its gate.

    It only reads `ctx.stop_requested` (an in-memory flag, no storage call) to note when
    the worker's lease keeper has seen a stop. With input["boundary"] it reaches one step
    boundary (`ctx.heartbeat`) before returning.
    """
    record(ctx, note="start")
    seen = False
    deadline = time.monotonic() + float(ctx.input.get("seconds", 30))
    while time.monotonic() < deadline and not gate_open(ctx.run_id):
        if not seen and ctx.stop_requested:
            seen = True
            record(ctx, note="stop seen")
        time.sleep(0.02)
    if ctx.input.get("boundary"):
        ctx.heartbeat()
    record(ctx, note="end")
    return {"stop_seen": seen}


@agent("tests.fails_when_cancelled", max_requeues=3)
def fails_when_cancelled(ctx: RunContext) -> None:
    """Waits (no context call) until its run has a cancel request, then fails retryably."""
    from django_agentruns.models import AgentRun

    record(ctx, note="start")
    deadline = time.monotonic() + float(ctx.input.get("seconds", 30))
    while time.monotonic() < deadline and not AgentRun.objects.filter(
            pk=ctx.run_id, cancel_requested_at__isnull=False).exists():
        time.sleep(0.02)
    raise Retryable("failed after the cancel request")


@agent("tests.stuck", timeout=0.3, lease_ttl=1.0, max_requeues=1)
def stuck(ctx: RunContext) -> dict[str, Any]:
    """Attempt 1 hangs in `time.sleep` past its timeout, reaching no step boundary, until the
    test opens its gate; later attempts return at once."""
    record(ctx, note="start")
    if ctx.attempt == 1:
        _until_gate(ctx, beat=False)
        record(ctx, note="end")
    return {"attempt": ctx.attempt}


@agent("tests.async_wait")
async def async_wait(ctx: RunContext) -> dict[str, Any]:
    """Awaits asyncio.sleep(input["seconds"]) with no context call; notes start and end."""
    await asyncio.to_thread(record, ctx, 0, "start")
    await asyncio.sleep(float(ctx.input.get("seconds", 30)))
    await asyncio.to_thread(record, ctx, 0, "end")
    return {"slept": True}


@agent("tests.triage", max_requeues=1)
def triage(ctx: RunContext) -> dict[str, Any]:
    """A ticket triage with tool calls and checkpoints (the admin tests' and screenshots' run).

    input["fail"]: "auth" dead-letters at once; "timeout" fails retryably every attempt.
    """
    state = ctx.state or {"step": 0}
    tools = ("fetch_ticket", "classify")
    for step in range(state["step"], len(tools)):
        ctx.emit("tool_call", {"tool": tools[step], "ticket": ctx.input.get("ticket")})
        ctx.checkpoint({"step": step + 1, "done": list(tools[: step + 1])})
    if ctx.input.get("fail") == "auth":
        raise NotRetryable("model provider answered 401: invalid API key")
    if ctx.input.get("fail") == "timeout":
        raise TimeoutError("model call timed out after 30 s")
    return {"label": "billing", "confidence": 0.93}


@agent("tests.live_steps")
def live_steps(ctx: RunContext) -> dict[str, Any]:
    """Emits step 0, waits (heartbeating) for its gate, emits step 1: the live stream's tests
    see the first step arrive while the run is still running."""
    ctx.emit("step", {"n": 0})
    _until_gate(ctx, beat=True)
    ctx.emit("step", {"n": 1})
    return {"steps": 2}


@agent("tests.traced")
def traced(ctx: RunContext) -> dict[str, Any]:
    """Makes a span of its own (needs opentelemetry): it must nest in the attempt's span."""
    from opentelemetry import trace

    with trace.get_tracer("tests").start_as_current_span("model call"):
        ctx.emit("step", {"n": 0})
    return {"traced": True}


@agent("tests.async_traced")
async def async_traced(ctx: RunContext) -> dict[str, Any]:
    """The async twin of tests.traced: the span context must cross onto the event loop."""
    from opentelemetry import trace

    with trace.get_tracer("tests").start_as_current_span("async model call"):
        await ctx.aemit("step", {"n": 0})
    return {"traced": True}


from . import (  # noqa: E402,F401
    chaos_agents,
    failure_agents,
    flow_agents,
    framework_agents,  # each framework loaded where it is wanted (see there)
    provider_agents,
    step_agents,
    stream_agents,
    waiting_agents,
    writer_agents,
)


@agent("tests.sized", max_requeues=1)
def sized(ctx: RunContext) -> Any:
    """Waits (up to input["wait"] s) for the global gate, SideEffect(run_id=0, note="open"),
    so that the runs of a test finish together; then returns {"blob": "x" * input["big"]},
    or {"n": input["n"], "tag": input["tag"]}."""
    record(ctx)
    deadline = time.monotonic() + float(ctx.input.get("wait", 0))
    while time.monotonic() < deadline and not gate_open(0):
        time.sleep(0.005)
    if ctx.input.get("big"):
        return {"blob": "x" * int(ctx.input["big"])}
    return {"n": ctx.input.get("n"), "tag": ctx.input.get("tag", "")}


@agent("tests.emitter", max_requeues=0)
def emitter(ctx: RunContext) -> dict[str, Any]:
    """Emits input["events"] events of input["size"] characters, checkpointing after each
    of the first input["checkpoints"]; returns how many it emitted."""
    for i in range(int(ctx.input.get("events", 0))):
        ctx.emit("step", {"i": i, "text": "x" * int(ctx.input.get("size", 0))})
        if i < int(ctx.input.get("checkpoints", 0)):
            ctx.checkpoint({"i": i, "text": "y" * int(ctx.input.get("state", 0))})
    return {"emitted": int(ctx.input.get("events", 0))}


@agent("tests.scheduled", queue="scheduled", every=3600, catch_up=True)
def scheduled(ctx: RunContext) -> dict[str, Any]:
    """Declares its schedule: workers serving queue "scheduled" tick it (test_schedules)."""
    return {"tick": ctx.input.get("tick")}
