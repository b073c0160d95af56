"""Time the due query against a deep ordered scope, with and without the scope-head index.

Builds, in a throwaway database, one scope of an ordered agent holding 20,000 succeeded
runs and 200 waiting ones, beside 50 other scopes with a few queued runs each. Then times
the due query as a worker asks it (`transitions.due_queued(..., agents)[:limit]`, its
agents baked in) two ways, the median of --reps runs:

* SQL: the compiled statement executed on a cursor, rows fetched (the database's cost);
* ORM: the queryset built, compiled and evaluated into model instances.

The fastest repetition is printed too: on a busy host the median carries the wait for a CPU.

Each is measured with the scope-head index (`agentruns_scope_head`), then with it dropped,
then it is recreated. Run on SQLite (a temporary file) and PostgreSQL (a database created
and dropped here, `agentruns_bench_h5` by default, on the server of $DATABASE_URL or
127.0.0.1:5432):

    python bench/due_query.py                  # both engines
    python bench/due_query.py --engine sqlite --reps 200 --explain

Not a test: it prints a table. Targets: <= 1 ms SQL, <= 5 ms ORM on both engines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REPO_ROOT = Path(__file__).resolve().parent.parent
AGENT = "bench.ordered"
QUEUE = "default"
INDEX = "agentruns_scope_head"
DEFAULT_PG_DB = "agentruns_bench_h5"


# --------------------------------------------------------------------------- one engine


def setup_django(database_url: str) -> None:
    sys.path.insert(0, str(REPO_ROOT))
    import django
    import environ
    from django.conf import settings

    db = environ.Env.db_url_config(database_url)
    settings.configure(
        DATABASES={"default": db}, INSTALLED_APPS=["django_agentruns"], USE_TZ=True,
        TIME_ZONE="UTC", DEFAULT_AUTO_FIELD="django.db.models.BigAutoField", AGENTRUNS={})
    django.setup()

    from django_agentruns import agent

    @agent(AGENT, ordered=True)
    def ordered(ctx: Any) -> None:  # never runs: only its policy matters here
        return None


def build(succeeded: int, waiting: int, other_scopes: int, per_scope: int) -> int:
    from django.core.management import call_command
    from django.utils import timezone

    from django_agentruns.models import AgentRun, Status

    call_command("migrate", verbosity=0)
    now = timezone.now()
    long_ago = now - timedelta(days=1)

    def run(scope: str, seq: int, status: str, due_in: float) -> AgentRun:
        return AgentRun(agent=AGENT, queue=QUEUE, scope=scope, fired_seq=seq, status=status,
                        available_at=now + timedelta(seconds=due_in), created_at=long_ago,
                        finished_at=long_ago if status == Status.SUCCEEDED else None)

    rows = [run("deep", i, Status.SUCCEEDED, -86400) for i in range(succeeded)]
    # The deep scope's waiting runs fell due first, so its head is among the first rows.
    rows += [run("deep", succeeded + i, Status.QUEUED, -3600) for i in range(waiting)]
    rows += [run(f"scope-{s:02d}", i, Status.QUEUED, -60 + s)
             for s in range(other_scopes) for i in range(per_scope)]
    AgentRun.objects.bulk_create(rows, batch_size=900)  # SQLite's variable limit
    analyze()
    return len(rows)


def analyze() -> None:
    """Statistics for the planner; on PostgreSQL a vacuum too, as autovacuum would have
    done by the time a table holds this much history (index-only scans need it)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE" if connection.vendor == "sqlite"
                       else "VACUUM ANALYZE django_agentruns_agentrun")


def set_index(present: bool) -> None:
    from django.db import connection

    from django_agentruns.models import AgentRun

    index = next(i for i in AgentRun._meta.indexes if i.name == INDEX)
    with connection.schema_editor() as editor:
        if present:
            editor.add_index(AgentRun, index)
        else:
            editor.remove_index(AgentRun, index)
    analyze()


def timed_ms(func: Callable[[], object], reps: int) -> tuple[float, float]:
    """(median, fastest) of `reps` calls, in ms; the fastest shows the cost on a quiet host."""
    func()  # warm caches and the connection
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        func()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, min(times) * 1000


def measure(reps: int, limit: int, explain: bool) -> dict[str, Any]:
    from django.db import connection
    from django.utils import timezone

    from django_agentruns import transitions
    from django_agentruns.registry import all_agents, scope_policy

    policy = scope_policy()
    agents = frozenset(all_agents())  # a worker claims only runs of its own agents
    at = timezone.now()

    def queryset() -> Any:
        return transitions.due_queued([QUEUE], at, policy, agents)[:limit]

    sql, params = queryset().query.sql_with_params()

    def raw() -> list[tuple[Any, ...]]:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchall()

    def orm() -> list[Any]:
        return list(queryset())

    found = orm()
    heads = {r.scope for r in found}
    assert len(found) == len(heads) == limit, "one run per scope, up to the limit"
    assert "deep" in heads, "the deep scope's head is due"
    result: dict[str, Any] = {"sql_ms": timed_ms(raw, reps), "orm_ms": timed_ms(orm, reps),
                              "rows": len(found)}
    if explain:
        prefix = "EXPLAIN QUERY PLAN " if connection.vendor == "sqlite" else "EXPLAIN ANALYZE "
        with connection.cursor() as cursor:
            cursor.execute(prefix + sql, params)
            result["plan"] = "\n".join(" ".join(str(c) for c in row) for row in cursor.fetchall())
    return result


def engine_main(args: argparse.Namespace) -> None:
    """In a child process: one engine, one database, printed as one JSON line."""
    setup_django(args.database_url)
    from django.db import connection

    total = build(args.succeeded, args.waiting, args.scopes, args.per_scope)
    with_index = measure(args.reps, args.limit, args.explain)
    set_index(False)
    try:
        without = measure(5 if args.quick_without else args.reps, args.limit, args.explain)
    finally:
        set_index(True)
    print(json.dumps({"engine": connection.vendor, "version": _version(), "rows": total,
                      "with": with_index, "without": without}))


def _version() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT sqlite_version()" if connection.vendor == "sqlite"
                       else "SHOW server_version")
        return str(cursor.fetchone()[0]).split()[0]


# --------------------------------------------------------------------------- the harness


def pg_urls(base: str, name: str) -> tuple[str, str]:
    """(maintenance URL, benchmark database URL) on the server `base` points at."""
    parts = urlsplit(base)
    return (urlunsplit(parts._replace(path="/postgres")),
            urlunsplit(parts._replace(path=f"/{name}")))


def pg_admin(url: str, statement: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement)


def run_engine(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    child = [sys.executable, str(Path(__file__).resolve()), "--child", "--reps", str(args.reps),
             "--limit", str(args.limit), "--succeeded", str(args.succeeded), "--waiting",
             str(args.waiting), "--scopes", str(args.scopes), "--per-scope", str(args.per_scope)]
    if args.explain:
        child.append("--explain")
    if args.quick_without:
        child.append("--quick-without")
    tmp = tempfile.mkdtemp(prefix="agentruns-bench-")
    cleanup: Callable[[], None]
    if engine == "sqlite":
        url = f"sqlite:///{tmp}/due.sqlite3"
        cleanup = lambda: None  # noqa: E731 - the directory goes below
    else:
        base = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
        if not base.startswith(("postgres://", "postgresql://")):
            base = "postgres://postgres@127.0.0.1:5432/postgres"
        admin, url = pg_urls(base, args.pg_database)
        pg_admin(admin, f'DROP DATABASE IF EXISTS "{args.pg_database}"')
        pg_admin(admin, f'CREATE DATABASE "{args.pg_database}"')
        cleanup = lambda: pg_admin(admin, f'DROP DATABASE IF EXISTS "{args.pg_database}"')  # noqa: E731
    try:
        done = subprocess.run([*child, "--database-url", url], capture_output=True, text=True,
                              cwd=REPO_ROOT, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{engine} benchmark failed:\n{done.stdout}\n{done.stderr}")
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def report(results: list[dict[str, Any]], args: argparse.Namespace, load: str) -> None:
    without = 5 if args.quick_without else args.reps
    print(f"due query, limit {args.limit}: one scope with {args.succeeded:,} succeeded and "
          f"{args.waiting} waiting runs, {args.scopes} other scopes x {args.per_scope} queued "
          f"runs; median (fastest) of {args.reps} repetitions, {without} without the index; "
          f"load average {load}, {os.cpu_count()} CPUs")
    print()
    print("| engine | scope-head index | SQL ms, median (fastest) | ORM ms, median (fastest) |")
    print("| --- | --- | ---: | ---: |")
    for r in results:
        name = f"{'SQLite' if r['engine'] == 'sqlite' else 'PostgreSQL'} {r['version']}"
        for key in ("with", "without"):
            sql, orm = r[key]["sql_ms"], r[key]["orm_ms"]
            print(f"| {name} | {key} | {sql[0]:.3f} ({sql[1]:.3f}) | {orm[0]:.3f} ({orm[1]:.3f}) |")
    if args.explain:
        for r in results:
            for key in ("with", "without"):
                print(f"\n{r['engine']}, {key} the index:\n{r[key]['plan']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--limit", type=int, default=32, help="Rows asked (CLAIM_BATCH).")
    parser.add_argument("--succeeded", type=int, default=20_000)
    parser.add_argument("--waiting", type=int, default=200)
    parser.add_argument("--scopes", type=int, default=50)
    parser.add_argument("--per-scope", type=int, default=3)
    parser.add_argument("--pg-database", default=DEFAULT_PG_DB)
    parser.add_argument("--explain", action="store_true", help="Print each query plan too.")
    parser.add_argument("--quick-without", action="store_true",
                        help="Fewer repetitions without the index (it can be slow).")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--database-url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        engine_main(args)
        return 0
    engines = ["sqlite", "postgres"] if args.engine == "both" else [args.engine]
    before = os.getloadavg()[0]
    results = [run_engine(e, args) for e in engines]
    report(results, args, f"{before:.1f} -> {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
