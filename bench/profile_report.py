"""The writing of bench/profile.md from `bench.profile_worker`'s measurements: statement
shapes described, py-spy's raw samples summed by thread, phase and library, cProfile's
tables clipped, and the page itself.
"""

from __future__ import annotations

import collections
import io
import os
import pstats
import re
import sysconfig
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from bench.pg import REPO_ROOT

if TYPE_CHECKING:
    from bench.profile_worker import StatementLog


def describe(shape_: str) -> str:
    """A readable digest of a statement shape: verb, table, WHERE, locking."""
    if shape_.startswith("WITH picked AS"):
        return ("claim in one statement: lock due agentrun (FOR UPDATE SKIP LOCKED), UPDATE "
                "them, INSERT their runevent")
    if shape_.startswith("WITH v (run_id, run_attempt") and "picked AS" in shape_:
        return ("settle successes and claim the next in one statement: UPDATE agentrun FROM "
                "VALUES, INSERT their runevent; lock due agentrun (SKIP LOCKED), UPDATE them, "
                "INSERT their runevent")
    if shape_.startswith("WITH v (run_id, run_attempt"):
        return ("settle successes: UPDATE agentrun FROM VALUES"
                + (", INSERT their runevent (one statement)" if "INSERT" in shape_ else ""))
    if shape_.startswith("WITH v (run_id, k"):
        return "INSERT runevent, any number of rows (seq from a MAX(seq) subquery)"
    verb = shape_.split(" ", 1)[0]
    table = re.search(r'(?:FROM|UPDATE|INTO) "(\w+)"', shape_)
    name = table.group(1).removeprefix("django_agentruns_") if table else "?"
    if verb == "INSERT":
        return (f"INSERT {name}" + (" (seq from a MAX(seq) subquery)" if "MAX(" in shape_ else "")
                + (" WHERE NOT EXISTS (...)" if "NOT EXISTS" in shape_ else ""))
    where = shape_.split(" WHERE ", 1)[1] if " WHERE " in shape_ else ""
    where = re.sub(r'"django_agentruns_\w+"\.', "", where).replace('"', "")
    where = re.sub(r" (ORDER BY|LIMIT|FOR UPDATE|GROUP BY|RETURNING).*", "", where)
    if "MAX(" in shape_:
        verb = "SELECT MAX(seq)"
    extra = " FOR UPDATE SKIP LOCKED" if "SKIP LOCKED" in shape_ else ""
    text = f"{verb} {name}" + (f" WHERE {where}" if where else "") + extra
    return text if len(text) <= 150 else text[:147] + "..."


def samples(raw: str) -> Iterator[tuple[str, list[str], int]]:
    """(thread, frames outermost first, count) per line of py-spy's raw output."""
    for line in raw.splitlines():
        stack, _, n_text = line.rpartition(" ")
        frames = stack.split(";")
        thread = re.sub(r"thread \(\d+\): ?", "", frames[0]) or "(unnamed)"
        yield re.sub(r"_\d+$", "_N", thread), frames[1:], int(n_text)


# What a wall-clock sample is doing, judged by the innermost frames: first match wins.
WALL = [
    ("idle: waiting for work", ("Condition.wait", "Event.wait",
                                "_worker (concurrent/futures/thread.py", "Thread.join",
                                "StopSignals._watch (django_agentruns/")),
    ("waiting on PostgreSQL", ("Connection.wait", "Connection.notifies", "_exec_command",
                               "_execute_send", "notifications (django_agentruns/db.py")),
    ("Python: Django ORM", ("django/db/",)),
    ("Python: psycopg", ("psycopg/",)),
    ("Python: logging", ("logging/",)),
    ("Python: django_agentruns", ("django_agentruns/",)),
]


def summarize_wall(raw: str) -> str:
    by_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total: collections.Counter[str] = collections.Counter()
    for thread, frames, n in samples(raw):
        total[thread] += n
        category = "other"
        for name, needles in WALL:
            if any(needle in f for f in frames[-3:] for needle in needles):
                category = name
                break
        by_thread[thread][category] += n
    names = [c for c, _ in WALL] + ["other"]
    lines = ["Wall clock, every thread (250 samples/s, idle included): what each thread is "
             "doing, share of its samples.", "",
             "| thread | samples | " + " | ".join(names) + " |",
             "|---|---:|" + "---:|" * len(names)]
    for thread, n in total.most_common():
        cells = [f"{100 * by_thread[thread][c] / n:.0f}%" for c in names]
        lines.append(f"| {thread} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Where on-CPU time goes: the phase a sample is in (first match from the outermost
# django_agentruns frame inwards), and the library its innermost frame is in.
PHASES = [
    ("settle and claim (transitions.settle_and_claim)",
     "settle_and_claim (django_agentruns/transitions/handover.py"),
    ("claim (transitions.claim)", "claim (django_agentruns/transitions/claiming.py"),
    ("attempt writes (store: transitions.apply_writes)", "apply_writes (django_agentruns/"),
    ("start an attempt (Worker._start: log, submit)", "Worker._start (django_agentruns/"),
    ("burst check (Worker._work_pending)", "Worker._work_pending (django_agentruns/"),
    ("reaper (reaper.reap)", "reap (django_agentruns/runtime/reaper.py"),
    ("lease keeper (renew_many)", "LeaseKeeper._run (django_agentruns/"),
    ("LISTEN thread", "Listener._run (django_agentruns/"),
    ("log the settlement", "log_settlement (django_agentruns/"),
    ("agent call and context", "call_agent (django_agentruns/"),
    ("close_old_connections", "close_old_connections (django/db/"),
]
LIBRARIES = [("Django ORM", "django/db/"), ("psycopg", "psycopg/"), ("logging", "logging/"),
             ("django_agentruns", "django_agentruns/"), ("threading / queue",
                                                         "threading.py"),
             ("concurrent.futures", "concurrent/"), ("uuid", "uuid.py"), ("json", "json/")]


OTHER = "other"


def summarize_cpu(raw: str, runs: int) -> str:
    phases: collections.Counter[str] = collections.Counter()
    libraries: collections.Counter[str] = collections.Counter()
    total = 0
    for _, frames, n in samples(raw):
        total += n
        phase = OTHER
        for name, needle in PHASES:
            if any(needle in f for f in frames):
                phase = name
                break
        phases[phase] += n
        leaf = frames[-1] if frames else ""
        library = next((name for name, needle in LIBRARIES if needle in leaf), "other")
        libraries[library] += n
    ms = 1000 / 250  # one sample stands for 4 ms
    startup = phases.pop(OTHER, 0)
    steady = total - startup
    lines = [f"Holding the GIL only (`py-spy --gil`, 250 samples/s): {steady * ms / runs:.1f} ms "
             f"of Python per run, plus {startup * ms / 1000:.1f} s outside every phase below "
             "(start-up: imports, settings, logging set-up; shutdown).", "",
             "| phase | share of the per-run GIL time | ms per run |", "|---|---:|---:|"]
    for name, n in phases.most_common():
        lines.append(f"| {name} | {100 * n / max(steady, 1):.0f}% | {n * ms / runs:.2f} |")
    lines += ["", "| innermost frame in (start-up included) | share of GIL time |", "|---|---:|"]
    for name, n in libraries.most_common():
        lines.append(f"| {name} | {100 * n / total:.0f}% |")
    return "\n".join(lines)


def report(runs: int, concurrency: int, plain: dict[str, Any], log: StatementLog,
           profiled: dict[str, Any], stats: pstats.Stats | None, spy: str | None) -> str:
    n = plain["runs"] or 1
    db_seconds = sum(log.seconds.values())
    out = [
        f"# Profile: django-agentruns worker, no-op drain ({runs} runs, concurrency {concurrency})",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} by `python -m bench.profile_worker`.",
        "",
        "## Per run (pass 1: in process, statement timing only)",
        "",
        "| measure | value |", "|---|---|",
        f"| runs/s (in process, no cProfile) | {plain['runs_per_s']:.0f} |",
        f"| wall time per run | {1000 * plain['wall'] / n:.2f} ms |",
        f"| CPU time of the worker process per run (all threads: Python, ORM, psycopg) "
        f"| {1000 * plain['cpu'] / n:.2f} ms |",
        f"| of which in the kernel (sockets, thread wake-ups) | "
        f"{1000 * plain['system'] / n:.2f} ms |",
        f"| load average (1 min) at the end | {os.getloadavg()[0]:.1f} |",
        f"| time waiting inside SQL statements per run (all threads) | "
        f"{1000 * db_seconds / n:.2f} ms |",
        f"| time waiting inside COMMIT per run ({log.commits / n:.2f} commits) | "
        f"{1000 * log.commit_seconds / n:.2f} ms |",
        f"| statements per run (BEGIN/COMMIT not counted) | {sum(log.count.values()) / n:.2f} |",
        f"| commits per run (pg_stat_database) | {plain['commits'] / n:.2f} |",
        f"| rows written per run (ins+upd+del) | {plain['rows_written'] / n:.2f} |",
        "",
        "Statements by shape, per run:",
        "",
        "| per run | ms per run | statement |", "|---|---|---|",
    ]
    for key, count in log.count.most_common():
        if count / n < 0.005:
            continue
        text = describe(key)
        out.append(f"| {count / n:.2f} | {1000 * log.seconds[key] / n:.3f} | `{text}` |")
    out += ["", f"## Python hot spots (pass 2: cProfile, {profiled['runs_per_s']:.0f} runs/s "
            "under the profiler)", ""]
    if stats is not None:
        buf = io.StringIO()
        stats.stream = buf  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(25)
        out += ["Top functions by own time:", "", "```", *clip(buf.getvalue()), "```", ""]
        buf = io.StringIO()
        stats.stream = buf  # type: ignore[attr-defined]
        stats.sort_stats("cumulative").print_stats(r"django_agentruns|logging/__init__", 30)
        out += ["django_agentruns and logging, cumulative:", "", "```", *clip(buf.getvalue()),
                "```", ""]
    if spy is not None:
        out += ["## py-spy (passes 3 and 4: a real `runworker --burst` process, all threads)",
                "", spy, ""]
    else:
        out += ["## py-spy", "", "py-spy is not installed; passes 1-2 stand alone.", ""]
    return "\n".join(out)


def clip(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.splitlines()]
    start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
    prefixes = [sysconfig.get_paths()["purelib"] + "/", f"{REPO_ROOT}/"]
    out = []
    for ln in lines[start:]:
        for prefix in prefixes:
            ln = ln.replace(prefix, "")
        if ln.strip():
            out.append(ln)
    return out
