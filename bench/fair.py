"""Fair shares (issue 28), ours alone on PostgreSQL: `python -m bench --only fair`.

- late tenant: A enqueues 10,000 runs; once one worker (concurrency 8) is busy with them,
  B enqueues 10. Where B's last run starts among the starts after B's enqueue committed
  (target: within the first 24).
- weights 3:1: A and B each enqueue 5,000 runs, FAIR_WEIGHTS {"A": 3}; the split of the
  first 4,000 starts (target: A/B within 5 % of 3).
- no-op cost: 5,000 no-op runs drained by one worker (concurrency 8), runs/s from the first
  start to the last finish, medians of `reps`, variants interleaved: without fair keys on
  main's code (/work/main, or BENCH_BASELINE_REPO), without fair keys here (target: within
  3 %), every run with a fair key (10 groups) here (target: within 10 %).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.harness import RUN_DB, log, stop_workers
from bench.pg import REPO_ROOT, Admin, django_env

BASELINE = Path(os.environ.get("BENCH_BASELINE_REPO", "/work/main"))
FLOOD, LATE, DRAIN = 10_000, 10, 5_000


def _enqueue(url: str, groups: list[str | None], counts: list[int], **env: str) -> float:
    """Enqueue `counts[i]` runs of group `groups[i]` (bench.tenant; None: bench.noop, which
    main's code has too) from a client process (`env`: more settings, as the weights,
    which apply at enqueue); returns the database's time after the last commit."""
    code = ("import json, sys, django; django.setup(); "
            "from django.db import connection; from django_agentruns import enqueue_many; "
            "spec = json.loads(sys.argv[1]); "
            "reqs = [{'agent': 'bench.tenant', 'input': {'t': g}} if g "
            "else {'agent': 'bench.noop'} "
            "for g, n in spec for _ in range(n)]; "
            "[enqueue_many(reqs[i:i + 1000]) for i in range(0, len(reqs), 1000)]; "
            "c = connection.cursor(); c.execute('SELECT extract(epoch FROM clock_timestamp())'); "
            "print(c.fetchone()[0])")
    spec = json.dumps(list(zip(groups, counts, strict=True)))
    out = subprocess.run([sys.executable, "-c", code, spec],
                         env=django_env(url, **env), cwd=REPO_ROOT, check=True,
                         capture_output=True,
                         text=True)
    return float(out.stdout.strip().splitlines()[-1])


def _worker(url: str, concurrency: int, burst: bool, logs: Path, *, repo: Path = REPO_ROOT,
            **env: str) -> subprocess.Popen[bytes]:
    environment = django_env(url, **env)
    environment["PYTHONPATH"] = str(repo)
    with open(logs / "fair-worker.log", "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "django", "runworker", "--queues", "default",
             "--concurrency", str(concurrency), *(["--burst"] if burst else [])],
            env=environment, cwd=repo, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)


def _value(url: str, sql: str, params: Any = None) -> Any:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(sql, params).fetchone()
        return row[0] if row else None


def _wait(url: str, sql: str, at_least: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while int(_value(url, sql)) < at_least:
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench.fair: timed out waiting for {sql}")
        time.sleep(0.02)


STARTED = "SELECT count(*) FROM django_agentruns_agentrun WHERE started_at IS NOT NULL"


def late_tenant(admin: Admin, logs: Path) -> int:
    url = admin.fresh(RUN_DB)
    _enqueue(url, ["A"], [FLOOD])
    worker = _worker(url, 8, False, logs)
    try:
        _wait(url, STARTED, 200)
        committed = _enqueue(url, ["B"], [LATE])
        _wait(url, STARTED + " AND fair_key = 'B'", LATE)
    finally:
        stop_workers([worker], wait_first=0.0)
    return int(_value(url, "SELECT count(*) FROM django_agentruns_agentrun WHERE "
                           "started_at >= to_timestamp(%s) AND started_at <= (SELECT "
                           "max(started_at) FROM django_agentruns_agentrun WHERE fair_key = 'B')",
                      [committed]))


def weights(admin: Admin, logs: Path, starts: int = 4000) -> float:
    url = admin.fresh(RUN_DB)
    weighted = {"BENCH_FAIR_WEIGHTS": json.dumps({"A": 3})}
    _enqueue(url, ["A", "B"], [5000, 5000], **weighted)
    worker = _worker(url, 8, False, logs, **weighted)
    try:
        _wait(url, STARTED, starts)
    finally:
        stop_workers([worker], wait_first=0.0)
    a = int(_value(url, "SELECT count(*) FROM (SELECT fair_key FROM django_agentruns_agentrun "
                        "WHERE started_at IS NOT NULL ORDER BY started_at, id LIMIT %s) s "
                        "WHERE fair_key = 'A'", [starts]))
    return a / (starts - a)


def drain_rate(admin: Admin, logs: Path, variant: str) -> float:
    url = admin.fresh(RUN_DB)
    if variant == "all fair":
        _enqueue(url, [f"t{i}" for i in range(10)], [DRAIN // 10] * 10)
    else:
        _enqueue(url, [None], [DRAIN])
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE")
    worker = _worker(url, 8, True, logs, **({"repo": BASELINE} if variant == "main" else {}))
    try:
        worker.wait(timeout=600)
    finally:
        stop_workers([worker], wait_first=0.0)
    seconds = float(_value(url, "SELECT extract(epoch FROM max(finished_at) - min(started_at)) "
                                "FROM django_agentruns_agentrun"))
    done = int(_value(url, "SELECT count(*) FROM django_agentruns_agentrun "
                           "WHERE status = 'succeeded'"))
    return done / seconds


VARIANTS = ("main", "no fair key", "all fair")


def run_fair(reps: int, admin: Admin, logs: Path) -> str:
    """Every part; BENCH_FAIR_DRAIN_ONLY=1: only the no-op cost rows;
    BENCH_FAIR_TARGETS_ONLY=1: all but them."""
    only_drain = os.environ.get("BENCH_FAIR_DRAIN_ONLY") == "1"
    late = [] if only_drain else [late_tenant(admin, logs) for _ in range(reps)]
    log(f"bench.fair: late tenant's last start at {late}")
    ratio = [] if only_drain else [weights(admin, logs) for _ in range(reps)]
    log(f"bench.fair: weights 3:1 split {ratio}")
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    targets_only = os.environ.get("BENCH_FAIR_TARGETS_ONLY") == "1"  # no cost rows
    for rep in range(0 if targets_only else reps):
        for variant in VARIANTS[rep % 3:] + VARIANTS[:rep % 3]:  # interleaved, rotated
            rates[variant].append(drain_rate(admin, logs, variant))
            log(f"bench.fair: {variant} {rates[variant][-1]:.0f} runs/s")
    base = statistics.median(rates["main"]) if rates["main"] else 0.0
    lines = [
        "## Fair shares (ours, PostgreSQL; `python -m bench --only fair`)", "",
        "| measure | medians (each repetition) | target |", "|---|---|---|",
    ]
    if late and ratio:
        lines += [
            f"| B's 10 runs enqueued behind A's 10,000: B's last start among the starts after "
            f"its commit | {statistics.median(late):.0f} ({', '.join(map(str, late))}) | <= 24 |",
            f"| weights 3:1, first 4,000 starts: A/B | {statistics.median(ratio):.3f} "
            f"({', '.join(f'{r:.3f}' for r in ratio)}) | 2.85-3.15 |"]
    targets = {"main": "-", "no fair key": ">= -3 %", "all fair": ">= -10 %"}
    for variant in VARIANTS if base else ():
        median = statistics.median(rates[variant])
        lines.append(f"| no-op drain {DRAIN:,} runs, 1 worker c=8, {variant} (runs/s) | "
                     f"{median:,.0f} ({', '.join(f'{r:,.0f}' for r in rates[variant])}); "
                     f"{median / base - 1:+.1%} vs main | {targets[variant]} |")
    lines.append(f"\nload average {os.getloadavg()[0]:.2f} at the end; {reps} repetitions.")
    return "\n".join(lines)
