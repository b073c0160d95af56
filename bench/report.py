"""bench/results.md: the machine a run measured on and the report around the tables."""

from __future__ import annotations

import contextlib
import json
import os
import platform
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import psutil

from bench.pg import Admin
from bench.plan import Plan
from bench.tables import ROWS, Results, cpu_table, sweep_table, table


def versions() -> dict[str, str]:
    out = {"Python": platform.python_version()}
    for name in ("Django", "django-agentruns", "django-tasks-db", "procrastinate", "psycopg"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def machine(admin: Admin) -> dict[str, str]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "CPUs (nproc)": f"{os.cpu_count()} ({cpu})" if cpu else str(os.cpu_count()),
        "RAM": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "OS": platform.platform(),
        "PostgreSQL": admin.value("SHOW server_version"),
        "synchronous_commit / fsync": f"{admin.value('SHOW synchronous_commit')} / "
                                      f"{admin.value('SHOW fsync')}",
        "max_connections (server-wide)": admin.value("SHOW max_connections"),
        "pg_stat_statements": pg_stat_statements(admin),
    }
    info.update(versions())
    return info


def pg_stat_statements(admin: Admin) -> str:
    if "pg_stat_statements" in admin.value("SHOW shared_preload_libraries"):
        return "preloaded (statements are still counted in the workers, the same way for all)"
    return ("not in shared_preload_libraries, so the extension cannot collect: statements "
            "are counted in the worker processes instead (psycopg execute calls)")


def report(results: Results, plan: Plan, info: dict[str, str], load: tuple[str, str],
           seconds: float, command: str, llm_section: str) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# django-agentruns benchmark: ours vs django-tasks-db vs procrastinate",
        "",
        f"Run {when} with `{command}` in {seconds / 60:.1f} min: {plan.reps} repetition(s), "
        "engines interleaved, "
        "a fresh database per trial. Medians; ↑ higher is better, ↓ lower is better; the "
        "ratio compares ours with the better of the two peers (above 1 is ours ahead on ↑ "
        "rows, behind on ↓ rows).",
        "",
        table(results, plan),
        "",
        "`*` a trial hit the time cap before the queue emptied: its rate is runs finished / "
        "time elapsed. `†` in a trial the worker exited with runs unfinished (a settle "
        "that failed, e.g. on the server's connection limit, leaves its run running until "
        "the lease lapses): runs finished / time to exit. `(c=N)`: the concurrency with the "
        "best median, chosen in the first repetition. The SQLite rows are "
        "one repetition, ours only (procrastinate needs PostgreSQL; not a comparison).",
        "",
        "## CPU per run (ms): worker / PostgreSQL / harness",
        "",
        "Medians over the trials of each row, per run finished. Worker: the worker "
        "processes' own CPU (user + system, start-up and stop included: they are part of "
        "a drain as a user runs it); PostgreSQL: the backends serving the trial's "
        "database; harness: the process timing the trial (its polls). The machine's other "
        "load is in none of them.",
        "",
        cpu_table(results, {key: label.format(drain_c=plan.drain_concurrency,
                                              drain_n=f"{plan.drain_runs:,}")
                            for key, label, _, _ in ROWS if key.startswith("drain")}),
        "",
        llm_section,
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in info.items()),
        f"| load average (1 min) at start / end | {load[0]} / {load[1]} |",
        "",
        "## I/O-bound sweep (one worker process, runs/s, median per concurrency)",
        "",
        sweep_table(results),
        "",
        "## Settings of this run",
        "",
        f"- no-op drains: {plan.drain_runs:,} runs queued first (not timed; the database then "
        f"ANALYZEd, as autovacuum keeps a table in service), then timed from "
        f"the first run's start (the queued count drops, within a 20 ms poll) until no run "
        f"is queued or running, or {plan.drain_cap:g} s; "
        f"each worker process at concurrency 1, then at {plan.drain_concurrency} "
        f"(django-tasks-db's db_worker has no concurrency setting: one task at a time in both)",
        f"- enqueue one by one: {plan.enqueue_one_runs:,} runs, each in its own transaction "
        f"(autocommit, as a plain view); bulk: {plan.bulk_runs:,} runs, {plan.bulk_batch:,} "
        "per transaction (ours `enqueue_many`, procrastinate `batch_defer`, django-tasks-db a "
        "loop of `enqueue()` in one transaction: it has no bulk API)",
        f"- latency: one idle worker (concurrency 1), an open-loop producer at "
        f"{plan.latency_rate:g} runs/s for {plan.latency_seconds:g} s after 1 s of warm-up "
        f"({plan.latency_rate * plan.latency_seconds:,.0f} samples a trial, and a p99 of "
        f"all repetitions' samples together); "
        "the agent writes its start time, the producer its enqueue time",
        f"- I/O-bound: {plan.io_runs:,} runs ({plan.io_serial_runs} for django-tasks-db, "
        f"which runs one task at a time) of a 100 ms sleep, one worker process, concurrency "
        f"{', '.join(map(str, plan.io_concurrency))} (swept in the first repetition, the best "
        f"re-measured after), cap {plan.io_cap:g} s",
        "",
        "## Raw values per repetition",
        "",
        "```json",
        json.dumps({k: dict(v) for k, v in results.values.items()
                    if not k.startswith("llm_")}, indent=None,
                   default=lambda x: round(x, 3))[:20000],
        "```",
    ]
    return "\n".join(lines)
