"""Agents of the chaos suite (tests/chaos): multi-step runs whose side effects are fenced.

One body serves four agents, steered by the run's input (and an async twin, a fifth,
whose attempts are coroutines on the worker's loop writing through its attempt store; its
durable steps are `ctx.astep`):

- ``steps``: how many steps; each emits a ``step`` event, sleeps ``sleep`` seconds (the
  "model call"), then records its side effect and checkpoints, in ONE transaction;
- ``wait_at`` (``tests.chaos_waits``): at that step the run waits for its delivery
  (``ctx.receive``), which the chaos deliverer sends at a random time, before or after;
- ``fail`` at step ``fail_at``: ``"transient"`` raises `Retryable` on the first
  ``fail_attempts`` attempts, ``"fatal"`` raises `NotRetryable`;
- ``durable``: the "model call" is a durable step (``ctx.step("call", ...)``) whose
  every real execution leaves a `SideEffect` (note ``"call"``), so the suite can prove
  that a step that completed is never executed again;
- ``slow_at`` (``tests.chaos_slow`` only): before that step (or, if it is ``steps``,
  before returning) attempt 1 makes a "call" that outlives its timeout and its lease: it
  makes no context call, so its worker stops renewing the lease and another worker takes
  the run over; the call returns only once that next attempt is running (or after
  ``slow`` seconds). Slow mid-run, its next context call stops it; slow at the end, it
  returns an output, and only the fence on its settlement keeps it from settling the run
  under the new attempt's feet. Later attempts make the call in ``finish`` seconds.

The side effect (a `SideEffect` row, note ``"effect"``) and the checkpoint commit together
or not at all: if the checkpoint's fenced UPDATE matches no row (the attempt lost the run),
`AttemptStopped` rolls the side effect back with it. That is how an application makes its
own writes as safe as the library's: a stale attempt can leave no trace.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from asgiref.sync import sync_to_async
from django.db import transaction

from django_agentruns import NotRetryable, Retryable, RunContext, Snooze, agent
from django_agentruns.models import AgentRun, Status

from .models import SideEffect

CHAOS = "tests.chaos"
CHAOS_ORDERED = "tests.chaos_ordered"
CHAOS_SLOW = "tests.chaos_slow"
CHAOS_ASYNC = "tests.chaos_async"
CHAOS_WAITS = "tests.chaos_waits"
WAIT_KEY = "chaos"
CHAOS_MAX_REQUEUES = 8
# The slow agent: its attempt times out after SLOW_TIMEOUT; the worker's lease keeper stops
# renewing SLOW_LEASE_TTL/3 later, so the lease lapses within SLOW_LEASE_TTL after that.
SLOW_TIMEOUT = 1.5
SLOW_LEASE_TTL = 1.0
EFFECT_NOTE = "effect"
CALL_NOTE = "call"


def record_step(ctx: RunContext, step: int) -> None:
    """The fenced side effect: the row commits only together with the checkpoint after it."""
    with transaction.atomic():
        SideEffect.objects.create(run_id=ctx.run_id, step=step, attempt=ctx.attempt,
                                  worker=str(os.getpid()), note=EFFECT_NOTE)
        ctx.checkpoint({"step": step + 1})


def run_steps(ctx: RunContext) -> dict[str, Any]:
    spec = ctx.input
    steps = int(spec.get("steps", 3))
    state = ctx.state or {"step": 0}
    for step in range(int(state["step"]), steps):
        ctx.emit("step", {"n": step})
        if spec.get("durable"):
            ctx.step("call", durable_call, ctx, step)
        else:
            time.sleep(float(spec.get("sleep", 0)))
        if step == spec.get("wait_at"):
            # Waits for the deliverer (tests/chaos/deliverer.py), which sends {"run": id}.
            payload = ctx.receive(WAIT_KEY)
            if payload != {"run": ctx.run_id}:
                raise NotRetryable(f"received {payload!r}, not this run's payload")
        if step == spec.get("snooze_at") and ctx.attempt <= int(spec.get("snoozes", 1)):
            snooze(ctx, spec)
        if step == spec.get("fail_at"):
            if spec.get("fail") == "fatal":
                raise NotRetryable(f"fatal failure at step {step}")
            if spec.get("fail") == "transient" and ctx.attempt <= int(spec.get("fail_attempts",
                                                                               1)):
                raise Retryable(f"transient failure at step {step}, attempt {ctx.attempt}")
        slow_down(ctx, step)
        record_step(ctx, step)
    slow_down(ctx, steps)
    return {"steps": steps}


def durable_call(ctx: RunContext, step: int) -> dict[str, Any]:
    """A step's real execution: counted (committed at once, whatever happens next), then
    the "model call"."""
    SideEffect.objects.create(run_id=ctx.run_id, step=step, attempt=ctx.attempt,
                              worker=str(os.getpid()), note=CALL_NOTE)
    time.sleep(float(ctx.input.get("sleep", 0)))
    return {"step": step, "key": ctx.step_key}


async def adurable_call(ctx: RunContext, step: int) -> dict[str, Any]:
    """`durable_call` for the async twin: counted in a thread, then the "model call"."""
    await sync_to_async(count_call, thread_sensitive=False)(ctx, step)
    await asyncio.sleep(float(ctx.input.get("sleep", 0)))
    return {"step": step, "key": ctx.step_key}


def count_call(ctx: RunContext, step: int) -> None:
    SideEffect.objects.create(run_id=ctx.run_id, step=step, attempt=ctx.attempt,
                              worker=str(os.getpid()), note=CALL_NOTE)


class ChaosRateLimit(Exception):
    """An OpenAI-style 429 with a Retry-After: snoozes the run and closes its key."""

    status_code = 429

    def __init__(self, attempt: int) -> None:
        super().__init__(f"rate limited on attempt {attempt}")
        self.response = type("Response", (), {"headers": {"Retry-After": "0.1"}})()


def snooze(ctx: RunContext, spec: dict[str, Any]) -> None:
    """A snoozing run: `Snooze`, or a 429 with Retry-After for a run with a limit key."""
    if spec.get("key"):
        raise ChaosRateLimit(ctx.attempt)
    raise Snooze(0.05, f"snoozed on attempt {ctx.attempt}")


def chaos_key(input: Any) -> str | None:
    return input.get("key") if isinstance(input, dict) else None


def slow_down(ctx: RunContext, step: int) -> None:
    if step != ctx.input.get("slow_at"):
        return
    if ctx.attempt > 1:
        time.sleep(float(ctx.input.get("finish", 0)))
        return
    # No context call in here: the lease keeper gives up on this attempt after its timeout,
    # the lease lapses, and the run is taken over while this still "waits for the model".
    deadline = time.monotonic() + float(ctx.input.get("slow", 0))
    taken_over = AgentRun.objects.filter(pk=ctx.run_id, status=Status.RUNNING,
                                         attempt__gt=ctx.attempt)
    while time.monotonic() < deadline and not taken_over.exists():
        time.sleep(0.02)


@agent(CHAOS, max_requeues=CHAOS_MAX_REQUEUES, limit_key=chaos_key)
def chaos(ctx: RunContext) -> dict[str, Any]:
    return run_steps(ctx)


@agent(CHAOS_ASYNC, max_requeues=CHAOS_MAX_REQUEUES)
async def chaos_async(ctx: RunContext) -> dict[str, Any]:
    """`run_steps` as a coroutine (no slow mode): emits awaited through the worker's
    attempt store; the fenced side effect and its checkpoint in a thread, one transaction."""
    spec = ctx.input
    steps = int(spec.get("steps", 3))
    state = ctx.state or {"step": 0}
    for step in range(int(state["step"]), steps):
        await ctx.aemit("step", {"n": step})
        if spec.get("durable"):
            # Its end held by the attempt until the next write carries it (runtime.steps).
            await ctx.astep("call", adurable_call, ctx, step)
        else:
            await asyncio.sleep(float(spec.get("sleep", 0)))
        if step == spec.get("fail_at"):
            if spec.get("fail") == "fatal":
                raise NotRetryable(f"fatal failure at step {step}")
            if spec.get("fail") == "transient" and ctx.attempt <= int(spec.get("fail_attempts",
                                                                               1)):
                raise Retryable(f"transient failure at step {step}, attempt {ctx.attempt}")
        await sync_to_async(record_step, thread_sensitive=False)(ctx, step)
    return {"steps": steps}


@agent(CHAOS_ORDERED, ordered=True, max_requeues=CHAOS_MAX_REQUEUES)
def chaos_ordered(ctx: RunContext) -> dict[str, Any]:
    return run_steps(ctx)


@agent(CHAOS_SLOW, timeout=SLOW_TIMEOUT, lease_ttl=SLOW_LEASE_TTL,
       max_requeues=CHAOS_MAX_REQUEUES)
def chaos_slow(ctx: RunContext) -> dict[str, Any]:
    return run_steps(ctx)


@agent(CHAOS_WAITS, max_requeues=CHAOS_MAX_REQUEUES)
def chaos_waits(ctx: RunContext) -> dict[str, Any]:
    return run_steps(ctx)


@agent("tests.raises", max_requeues=0)
def raises(ctx: RunContext) -> None:
    """Raises ValueError with the text given as code points (JSON input cannot hold NUL or
    lone surrogates, an exception's message can): bad-input tests record odd errors."""
    raise ValueError("".join(chr(c) for c in ctx.input["codepoints"]))
