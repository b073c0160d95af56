"""Where django-agentruns' worker spends its time in a no-op drain (PostgreSQL).

    python -m bench.profile_worker [--runs 2000] [--concurrency 1] [--no-py-spy]

Four passes, each on a fresh database holding `--runs` queued no-op runs:

1. In process, `Worker(burst=True).run(install_signals=False)` with a Django execute
   wrapper on every connection: runs/s, and per run the statements (by shape), the time
   spent inside them, commits and rows written (`pg_stat_database`, read from outside).
2. The same under cProfile (on Python 3.12+ one profiler sees every thread): hot spots;
   time blocked on the server shows as psycopg's `wait`.
3. py-spy, if installed, sampling a real `runworker --burst` process, all threads, wall
   clock: what each thread waits on.
4. py-spy again, GIL holders only: Python time per run by phase (claim, settle, ...) and by
   library (Django ORM, psycopg, logging, ours).

Writes bench/profile.md and prints it.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import json
import os
import pstats
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.pg import PREFIX, REPO_ROOT, TEMPLATE, Admin, django_env

DB_NAME = f"{PREFIX}_prof"
OUT = Path(__file__).resolve().parent / "profile.md"


def prefill(url: str, runs: int) -> None:
    """Queue the runs, then ANALYZE (as `python -m bench` does: planner statistics, as
    autovacuum keeps them for a table in service)."""
    subprocess.run([sys.executable, "-m", "bench.client", "ours", "prefill", "noop", str(runs)],
                   env=django_env(url), cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE")


@functools.lru_cache(maxsize=4096)
def shape(sql: str) -> str:
    """A statement's shape: literals and IN-lists folded, so the same query groups.

    Cached: the worker sends the same parametrized text run after run, and six regex
    passes per statement (about 0.4 ms per run) were counted as the worker's own CPU."""
    s = re.sub(r"'[^']*'", "?", sql)
    s = re.sub(r"\b\d+(\.\d+)?\b", "?", s)
    s = re.sub(r"\((\s*%s(::\w+)?\s*,?)+\)", "(...)", s)
    s = re.sub(r"(\(\.\.\.\)(, )?)+", "(...)", s)
    s = re.sub(r"(\(\?(, \?)*\)(, )?)+", "(...)", s)
    s = re.sub(r"\s+", " ", s)
    return s


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


class StatementLog:
    def __init__(self) -> None:
        self.count: collections.Counter[str] = collections.Counter()
        self.seconds: collections.Counter[str] = collections.Counter()
        self.commits = 0
        self.commit_seconds = 0.0
        self.lock = threading.Lock()

    def time_commits(self) -> None:
        """Time Django's COMMITs too: they do not pass through execute wrappers."""
        from django.db.backends.base.base import BaseDatabaseWrapper

        original = BaseDatabaseWrapper._commit
        log = self

        def _commit(self: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(self)
            finally:
                spent = time.perf_counter() - start
                with log.lock:
                    log.commits += 1
                    log.commit_seconds += spent

        BaseDatabaseWrapper._commit = _commit  # type: ignore[method-assign]

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool,
                 context: dict[str, Any]) -> Any:
        start = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            spent = time.perf_counter() - start
            key = shape(sql)
            with self.lock:
                self.count[key] += 1
                self.seconds[key] += spent


def setup_django() -> None:
    import django

    django.setup()
    import logging

    # runworker leaves the package logger at INFO: do the same, into the void, so the
    # cost of formatting two log lines per run is measured as in a real worker.
    logging.getLogger("django_agentruns").setLevel(logging.INFO)
    sink = open(os.environ.get("BENCH_PROFILE_LOG", os.devnull), "w")  # noqa: SIM115
    logging.getLogger().handlers = [logging.StreamHandler(sink)]


def child(mode: str, concurrency: int, out: Path) -> int:
    """One drain in this process (DATABASE_URL names the database); results to `out`."""
    setup_django()
    from django.db.backends.signals import connection_created

    from django_agentruns.runtime.worker import Worker

    log = StatementLog()

    def on_connect(sender: Any, connection: Any, **kwargs: Any) -> None:
        connection.execute_wrappers.append(log)

    connection_created.connect(on_connect)
    log.time_commits()
    worker = Worker(["default"], concurrency, burst=True)
    # On Python 3.12+ cProfile hooks sys.monitoring, which is process-wide: one profiler
    # sees the main loop, the attempt threads, the keeper and the listener alike.
    prof = cProfile.Profile() if mode == "cprofile" else None
    cpu_start = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    if prof is not None:
        prof.enable()
    stats = worker.run(install_signals=False)
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - start
    cpu_end = resource.getrusage(resource.RUSAGE_SELF)
    system = cpu_end.ru_stime - cpu_start.ru_stime
    cpu = (cpu_end.ru_utime - cpu_start.ru_utime) + system
    if prof is not None:
        prof.dump_stats(str(out.with_suffix(".pstats")))
    out.write_text(json.dumps({
        "runs": sum(stats.settled.values()), "wall": wall, "cpu": cpu, "system": system,
        "count": dict(log.count), "seconds": dict(log.seconds),
        "commits": log.commits, "commit_seconds": log.commit_seconds,
    }))
    return 0


def drain(admin: Admin, runs: int, concurrency: int, mode: str,
          tmp: Path) -> tuple[dict[str, Any], StatementLog, pstats.Stats | None]:
    """A fresh database, `runs` queued no-op runs, one child process draining them."""
    url = admin.fresh(DB_NAME)
    prefill(url, runs)
    admin.wait_idle(DB_NAME)
    before = admin.stats(DB_NAME)
    out = tmp / f"{mode}.json"
    subprocess.run([sys.executable, "-m", "bench.profile_worker", "--child", mode,
                    "--concurrency", str(concurrency), "--out", str(out)],
                   env=django_env(url), cwd=REPO_ROOT, check=True)
    admin.wait_idle(DB_NAME)
    after = admin.stats(DB_NAME)
    data = json.loads(out.read_text())
    log = StatementLog()
    log.count.update(data["count"])
    log.seconds.update(data["seconds"])
    log.commits, log.commit_seconds = data["commits"], data["commit_seconds"]
    result = {"runs": data["runs"], "wall": data["wall"], "cpu": data["cpu"],
              "system": data.get("system", 0.0),
              "runs_per_s": data["runs"] / data["wall"],
              "commits": after.commits - before.commits,
              "rows_written": after.rows_written - before.rows_written}
    pstats_file = out.with_suffix(".pstats")
    return result, log, pstats.Stats(str(pstats_file)) if pstats_file.exists() else None


def pyspy(admin: Admin, runs: int, concurrency: int) -> str | None:
    """Two samplings of a real `runworker --burst`: wall clock (idle threads included),
    then on-CPU only."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        return None
    out = []
    for idle in (True, False):
        url = admin.fresh(DB_NAME)
        prefill(url, runs)
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "raw.txt"
            proc = subprocess.run(
                [exe, "record", "--format", "raw", "--rate", "250", "--threads",
                 *(["--idle"] if idle else ["--gil"]), "--output", str(raw), "--",
                 sys.executable, "-m", "django", "runworker", "--queues", "default",
                 "--concurrency", str(concurrency), "--burst"],
                env=django_env(url), cwd=REPO_ROOT, capture_output=True, text=True,
                check=False)
            if not raw.exists():
                return f"py-spy failed: {proc.stderr.strip()[-500:]}"
            out.append(summarize_wall(raw.read_text()) if idle
                       else summarize_cpu(raw.read_text(), runs))
    return "\n\n".join(out)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--no-py-spy", action="store_true")
    parser.add_argument("--keep-template", action="store_true",
                        help="reuse the migrated template database and leave it in place")
    parser.add_argument("--child", choices=["plain", "cprofile"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.concurrency, args.out)
    admin = Admin()
    try:
        if not args.keep_template:
            admin.make_template()
        with tempfile.TemporaryDirectory() as tmp:
            plain, log, _ = drain(admin, args.runs, args.concurrency, "plain", Path(tmp))
            profiled, _, stats = drain(admin, args.runs, args.concurrency, "cprofile", Path(tmp))
            spy = None if args.no_py_spy else pyspy(admin, args.runs, args.concurrency)
            text = report(args.runs, args.concurrency, plain, log, profiled, stats, spy)
        OUT.write_text(text + "\n")
        print(text)
    finally:
        admin.drop(DB_NAME)
        if not args.keep_template:
            admin.drop(TEMPLATE)
        admin.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
