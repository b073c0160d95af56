"""The timed trials the main table is made of: a no-op drain (its rate, commits, statements,
rows and CPU per run) and enqueueing, one by one and in bulk."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil

from bench.engines import Engine
from bench.harness import CpuMeter, PgTarget, Target, client, peak_rss, start_workers, stop_workers
from bench.pg import django_env

POLL = 0.02  # seconds between two looks at the queue while workers drain it


def drain(target: Target, engine: Engine, kind: str, runs: int, processes: int,
          concurrency: int, cap: float, logs: Path) -> dict[str, Any]:
    """`runs` queued runs of `kind`; workers started; timed from the first run's start
    until none is queued or running (or `cap` seconds). Commits, rows and statements are
    counted for the workers alone; CPU split into worker, PostgreSQL, harness per run."""
    client(target.url, engine, "prefill", kind, str(runs))
    target.analyze()
    target.settle()
    before = target.stats()
    statements = logs / f"statements-{engine.key}-{time.monotonic_ns()}.txt"
    env = django_env(target.url, BENCH_STATEMENTS_FILE=str(statements), **dict(engine.env))
    sql = engine.pending_sql()
    queued_sql = f"SELECT count(*) FROM {engine.table} WHERE status = '{engine.pending[0]}'"
    target.open_poller()
    polls_before = target.polls
    meter = CpuMeter(target.name) if isinstance(target, PgTarget) else None
    launched = time.perf_counter()
    workers = start_workers(engine, processes, concurrency, True, env,
                            logs / f"{engine.key}-{kind}.log")
    handles = [psutil.Process(w.pid) for w in workers]
    peak = 0
    start: float | None = None
    remaining = runs
    try:
        while True:
            now = time.perf_counter()
            peak = peak_rss(handles, peak)
            exited = all(w.poll() is not None for w in workers)
            if start is None:
                # Timed from the first run's start (the queued count drops, within a
                # poll), as a user sees a batch: the workers' start-up is not the drain's.
                if target.count(queued_sql) < runs:
                    start = now
                elif exited or now - launched > cap + 60:
                    break
            else:
                remaining = target.count(sql)
                if remaining == 0 or now - start >= cap or exited:
                    break
            time.sleep(POLL)
    except BaseException:
        stop_workers(workers, wait_first=0.0)
        raise
    elapsed = now - (start if start is not None else launched)
    failed = [w.returncode for w in workers if w.poll() not in (None, 0)]
    stop_workers(workers, wait_first=30.0 if remaining == 0 else 0.0)
    cpu = meter.stop() if meter is not None else None
    # Runs in flight when the cap struck finish during the graceful stop: count them too
    # when dividing the workers' commits and statements.
    finished = runs - target.count(sql)
    polls = target.polls - polls_before
    target.close_poller()
    target.settle()
    after = target.stats()
    done = runs - remaining
    if failed or done == 0:
        tail = (logs / f"{engine.key}-{kind}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{engine.key} workers failed (exit {failed}, {done} done):\n{tail}")
    result: dict[str, Any] = {"runs_per_s": done / elapsed, "done": done, "elapsed": elapsed,
                              "capped": remaining > 0 and elapsed >= cap,
                              # the workers left before the queue was done (a failed settle
                              # leaves its run running until the lease lapses)
                              "incomplete": remaining > 0 and elapsed < cap,
                              "rss_mb": peak / 2**20}
    if before is not None and after is not None:
        result["commits"] = (after.commits - before.commits - polls) / finished
        result["rows"] = (after.rows_written - before.rows_written) / finished
    if cpu is not None:  # ms per run finished
        result.update({f"cpu_{k}": 1000 * v / max(finished, 1) for k, v in cpu.items()})
    if statements.exists():
        total = sum(int(line.split()[1]) for line in statements.read_text().splitlines())
        result["statements"] = total / finished
    return result


def enqueue_one(target: Target, engine: Engine, runs: int) -> float:
    result = client(target.url, engine, "enqueue-one", str(runs))
    return float(result["count"] / result["seconds"])


def enqueue_bulk(target: Target, engine: Engine, runs: int, batch: int) -> float:
    result = client(target.url, engine, "enqueue-bulk", str(runs), str(batch))
    return float(result["count"] / result["seconds"])
