"""procrastinate tasks for the benchmark (found by procrastinate's Django autodiscovery)."""

from __future__ import annotations

import asyncio
import time

from procrastinate.contrib.django import app

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
