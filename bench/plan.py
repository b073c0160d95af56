"""What a benchmark run measures (`Plan`: FULL, QUICK) and the latency trial, which
`run` and `pooler` both use: below both, so neither imports the other."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engines import Engine
from bench.harness import Target, client, start_workers, stop_workers
from bench.pg import django_env


@dataclass(frozen=True)
class Plan:
    reps: int
    drain_runs: int
    drain_cap: float
    enqueue_one_runs: int
    bulk_runs: int
    bulk_batch: int
    latency_rate: float
    latency_seconds: float
    """The latency trial: `latency_rate` runs/s for `latency_seconds` measured, 300 samples
    (FULL) a trial, and a p99 of every repetition's samples together (900 at 3): one stray
    sample moved the p99 of 200. The rate stays low: at 40/s a peer's worker on a loaded
    machine fell behind, and its "latency" became a queue's wait."""
    io_runs: int
    io_serial_runs: int
    io_cap: float
    io_concurrency: tuple[int, ...]
    sqlite: bool
    drain_concurrency: int = 16
    """The second no-op drain's concurrency per worker process (the first runs one at a time)."""
    worker_warmup: float = 2.5
    """Seconds an idle worker gets to start (and LISTEN) before the latency producer."""
    llm_configs: tuple[tuple[str, int, int, int], ...] = (
        ("llm_sync", 200, 1, 1500), ("llm_steps_sync", 200, 1, 1500),
        ("llm_async", 200, 1, 1000), ("llm_async", 1000, 1, 4000),
        ("llm_steps_async", 1000, 1, 4000), ("llm_async", 500, 2, 4000))
    """The LLM-shaped rows: (agent, --concurrency per process, --processes, runs). Each is
    timed from the first run's start to the last one's finish, ramp-up and tail included,
    as a user sees a batch of that many runs."""
    llm_cap: float = 30.0


FULL = Plan(reps=3, drain_runs=5000, drain_cap=15.0, enqueue_one_runs=500, bulk_runs=2000,
            bulk_batch=1000, latency_rate=20.0, latency_seconds=15.0, io_runs=1000,
            io_serial_runs=70, io_cap=7.0, io_concurrency=(50, 100, 200), sqlite=True)
QUICK = Plan(reps=1, drain_runs=1000, drain_cap=3.0, enqueue_one_runs=150, bulk_runs=1000,
             bulk_batch=500, latency_rate=20.0, latency_seconds=3.0, io_runs=300,
             io_serial_runs=20, io_cap=2.5, io_concurrency=(100,), sqlite=True,
             worker_warmup=1.5, llm_cap=10.0,
             llm_configs=(("llm_sync", 200, 1, 400), ("llm_async", 1000, 1, 2000),
                          ("llm_async", 500, 2, 2000)))


def latency(target: Target, engine: Engine, rate: float, seconds: float, warmup: float,
            logs: Path) -> dict[str, Any]:
    """Open-loop producer at `rate`/s against one idle worker; each agent writes its start
    time, the producer its enqueue time, so both ends are measured the same way."""
    starts = logs / f"latency-{engine.key}-{time.monotonic_ns()}.txt"
    env = django_env(target.url, BENCH_LATENCY_FILE=str(starts), **dict(engine.env))
    workers = start_workers(engine, 1, 1, False, env, logs / f"{engine.key}-latency.log")
    try:
        time.sleep(warmup)
        produced = client(target.url, engine, "produce", str(rate), str(seconds), "1",
                          env=env, timeout=seconds + 120)
        expected = int(produced["measured"])
        deadline = time.monotonic() + 15

        def measured() -> list[float]:
            if not starts.exists():
                return []
            rows = [line.split() for line in starts.read_text().splitlines()]
            return [1000 * (float(s) - float(t0)) for token, t0, s in rows if token[0] == "m"]

        values = measured()
        while len(values) < expected and time.monotonic() < deadline:
            time.sleep(0.1)
            values = measured()
    finally:
        stop_workers(workers, wait_first=0.0)
    if not values:
        raise RuntimeError(f"{engine.key}: no latency samples")
    return {"p50": percentile(values, 50), "p95": percentile(values, 95),
            "p99": percentile(values, 99), "n": len(values), "missing": expected - len(values),
            "values": values}


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest rank: the smallest value with at least p% of the sample at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]
