"""Agents of the chaos suite (tests/chaos): multi-step runs whose side effects are fenced.

One body serves three agents, steered by the run's input:

- ``steps``: how many steps; each emits a ``step`` event, sleeps ``sleep`` seconds (the
  "model call"), then records its side effect and checkpoints, in ONE transaction;
- ``fail`` at step ``fail_at``: ``"transient"`` raises `Retryable` on the first
  ``fail_attempts`` attempts, ``"fatal"`` raises `NotRetryable`;
- ``slow`` (``tests.chaos_slow`` only): attempt 1 sleeps ``slow`` seconds at step
  ``slow_at`` without a context call, past its timeout, so the worker stops renewing the
  lease and another worker takes the run over while this attempt still runs.

The side effect (a `SideEffect` row, note ``"effect"``) and the checkpoint commit together
or not at all: if the checkpoint's fenced UPDATE matches no row (the attempt lost the run),
`AttemptStopped` rolls the side effect back with it. That is how an application makes its
own writes as safe as the library's: a stale attempt can leave no trace.
"""

from __future__ import annotations

import os
import time
from typing import Any

from django.db import transaction

from django_agentruns import NotRetryable, Retryable, RunContext, agent

from .models import SideEffect

CHAOS = "tests.chaos"
CHAOS_ORDERED = "tests.chaos_ordered"
CHAOS_SLOW = "tests.chaos_slow"
CHAOS_MAX_REQUEUES = 8
# The slow agent: its attempt times out after SLOW_TIMEOUT; the worker's lease keeper stops
# renewing SLOW_LEASE_TTL/3 later, so the lease lapses within SLOW_LEASE_TTL after that.
SLOW_TIMEOUT = 1.5
SLOW_LEASE_TTL = 1.0
EFFECT_NOTE = "effect"


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
        time.sleep(float(spec.get("sleep", 0)))
        if step == spec.get("fail_at"):
            if spec.get("fail") == "fatal":
                raise NotRetryable(f"fatal failure at step {step}")
            if spec.get("fail") == "transient" and ctx.attempt <= int(spec.get("fail_attempts",
                                                                               1)):
                raise Retryable(f"transient failure at step {step}, attempt {ctx.attempt}")
        if step == spec.get("slow_at") and ctx.attempt == 1:
            time.sleep(float(spec.get("slow", 0)))  # no context call: the lease lapses
        record_step(ctx, step)
    return {"steps": steps}


@agent(CHAOS, max_requeues=CHAOS_MAX_REQUEUES)
def chaos(ctx: RunContext) -> dict[str, Any]:
    return run_steps(ctx)


@agent(CHAOS_ORDERED, ordered=True, max_requeues=CHAOS_MAX_REQUEUES)
def chaos_ordered(ctx: RunContext) -> dict[str, Any]:
    return run_steps(ctx)


@agent(CHAOS_SLOW, timeout=SLOW_TIMEOUT, lease_ttl=SLOW_LEASE_TTL,
       max_requeues=CHAOS_MAX_REQUEUES)
def chaos_slow(ctx: RunContext) -> dict[str, Any]:
    return run_steps(ctx)
