"""procrastinate tasks for the benchmark (found by procrastinate's Django autodiscovery)."""

from __future__ import annotations

import asyncio
import time

from procrastinate import JobContext
from procrastinate.contrib.django import app

from .agents import LLM_CALL
from .models import Step
from .probe import record_start


@app.task(name="bench.noop", queue="default")
def noop() -> None:
    return None


@app.task(name="bench.sleep_sync", queue="default")
def sleep_sync() -> None:
    time.sleep(0.1)


@app.task(name="bench.sleep_async", queue="default")
async def sleep_async() -> None:
    await asyncio.sleep(0.1)


@app.task(name="bench.latency", queue="default")
def latency(token: str, t0: float) -> None:
    record_start({"token": token, "t0": t0})


# LLM-shaped (see agents.py): three 0.4 s model calls, one row per step in the job's own
# table through the ORM; procrastinate has no checkpoint to save.
@app.task(name="bench.llm_sync", queue="default", pass_context=True)
def llm_sync(context: JobContext) -> None:
    for step in range(3):
        time.sleep(LLM_CALL)
        Step.objects.create(job_id=context.job.id, step=step, payload={"tokens": 256})


@app.task(name="bench.llm_async", queue="default", pass_context=True)
async def llm_async(context: JobContext) -> None:
    for step in range(3):
        await asyncio.sleep(LLM_CALL)
        await Step.objects.acreate(job_id=context.job.id, step=step, payload={"tokens": 256})
