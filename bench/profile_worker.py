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

Writes bench/profile.md (`bench.profile_report` writes the page) and prints it.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import json
import os
import pstats
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.pg import PREFIX, REPO_ROOT, TEMPLATE, Admin, django_env
from bench.profile_report import report, summarize_cpu, summarize_wall

DB_NAME = f"{PREFIX}_prof"
OUT = Path(__file__).resolve().parent / "profile.md"


def prefill(url: str, runs: int, kind: str = "noop") -> None:
    """Queue the runs (of the bench agent `kind`), then ANALYZE (as `python -m bench`
    does: planner statistics, as autovacuum keeps them for a table in service)."""
    subprocess.run([sys.executable, "-m", "bench.client", "ours", "prefill", kind, str(runs)],
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
