"""Long-horizon history bench (`python -m bench --only history`): claim and enqueue latency
over a large history, plain tables against partitioned ones (`HISTORY_PARTITION`), and
dropping one partition of history against deleting the same runs' rows.

Each layout is filled and measured in a database of its own, dropped before the next.
The fill is set-based SQL (INSERT ... SELECT generate_series), never the worker: finished
runs of an LLM-shaped agent, EVENTS_PER_RUN events of about 500 bytes of JSON each, one
checkpoint of about STATE_BYTES of state (the run row keeps only its number, as the engine
does), and an input and an output payload row each (not columns of the run row either).
Latencies are measured by a Django process (bench.history_probe) one call at a time,
after each fill step. At the largest fill the no-op drain and the LLM-shaped async rate
are measured on the filled database against an empty one of the same layout, alternating
between the two (`RATE_ROUNDS` times each), so the ratio is same-run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psycopg

from bench import history_probe, llm
from bench.drain import drain
from bench.engines import OURS
from bench.harness import PgTarget, log
from bench.pg import PREFIX as DB_PREFIX
from bench.pg import REPO_ROOT, Admin, db_url, django_env, migrate

EVENTS_PER_RUN = 10
STATE_BYTES = 3000
EVENT_BYTES = 500
BYTES_PER_EVENT = 1700
"""Disk per event filled, all tables, indexes and WAL in flight (measured: about 1.2 KB
stored per event at these sizes; WAL and headroom on top)."""
BATCH_RUNS = 20_000
DRAIN_RUNS, DRAIN_CONCURRENCY = 5_000, 16
LLM_RUNS, LLM_CONCURRENCY = 2_000, 500
RATE_ROUNDS = 3
PREFIX = f"{DB_PREFIX}_history"
"""From BENCH_DB_PREFIX, as every bench database: two benches on one server must not drop
each other's databases."""
LAYOUTS = ("plain", "partitioned")

# A run's rows deleted before it on plain tables (as purge does): its payloads too (its
# input and output; the plain payload table has a foreign key to the run).
HISTORY = ("django_agentruns_runevent", "django_agentruns_runcheckpoint",
           "django_agentruns_runpayload")


@dataclass
class LayoutResult:
    layout: str
    points: dict[int, dict[str, float]] = field(default_factory=dict)
    drop: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, float] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    fills: dict[int, dict[str, float]] = field(default_factory=dict)


def needed_bytes(events: int) -> int:
    return events * BYTES_PER_EVENT


def check_disk(events: int, path: str = "/") -> tuple[int, int]:
    """(needed, free) bytes; one layout's database exists at a time."""
    return needed_bytes(events), shutil.disk_usage(path).free


def fill(conn: psycopg.Connection[Any], runs: int, layout_env: dict[str, str]) -> None:
    """Add `runs` finished runs with their events and a checkpoint each, in batches."""
    # Random text, as a model's messages are: a repeated string would compress to nothing
    # in TOAST and make the sizes meaningless. md5 gives 32 characters a call.
    # The subqueries name an outer column, or PostgreSQL would run them once for all rows,
    # and an inner one, or the aggregate would belong to the outer query.
    def state(row: str) -> str:
        return ("jsonb_build_object('step', 7, 'messages', (SELECT jsonb_agg(md5(random()::text"
                f" || {row} || i)) FROM generate_series(1, {STATE_BYTES // 34}) i))")

    payload = ("jsonb_build_object('role', 'assistant', 'tool', 'search', 'text', (SELECT "
               "string_agg(md5(random()::text || r || '.' || s || i), ' ') FROM generate_series(1, "
               f"{(EVENT_BYTES - 60) // 33}) i))")
    done = 0
    while done < runs:
        n = min(BATCH_RUNS, runs - done)
        with conn.transaction():
            ids = [r[0] for r in conn.execute(
                "INSERT INTO django_agentruns_agentrun (agent, queue, priority, scope, fired_seq,"
                " status, reason, attempt, requeue_count, max_requeues,"
                " claimed_by, available_at, limit_key, snooze_count, input_tokens,"
                " output_tokens, cost, checkpoint_count, agent_version,"
                " cancel_reason, error_type, error_message, created_at,"
                " started_at, finished_at, wait_key, spawn_key, dedupe_key,"
                " release_dedupe_at_start, fair_key, steps_copied)"
                " SELECT 'bench.llm', 'history', 0, '', 0,"
                " 'succeeded', 'completed', 1, 0, 3, '', now(), '', 0, 900, 300, 0.01,"
                " 1, 1, '', '', '', now() - interval '40 days',"
                " now() - interval '40 days', now() - interval '40 days', '', '', '', false,"
                " '', false"
                " FROM generate_series(1, %s) g RETURNING id", [n]).fetchall()]
        if layout_env.get("BENCH_HISTORY_PARTITION"):
            subprocess.run([sys.executable, "-m", "django", "partitions", "ensure"],
                           env=layout_env, cwd=REPO_ROOT, check=True,
                           stdout=subprocess.DEVNULL)
        with conn.transaction():
            conn.execute(
                "INSERT INTO django_agentruns_runevent (run_id, seq, event_id, type, payload,"
                " attempt, created_at) SELECT r, s, gen_random_uuid(), 'llm.message',"
                f" {payload}, 1, now() FROM unnest(%s::bigint[]) r, generate_series(1, %s) s",
                [ids, EVENTS_PER_RUN])
            conn.execute(
                "INSERT INTO django_agentruns_runcheckpoint (run_id, number, state, created_at)"
                f" SELECT r, 1, {state('r')}, now() FROM unnest(%s::bigint[]) r", [ids])
            # The input and the output: payload rows, not columns of the run row.
            conn.execute(
                "INSERT INTO django_agentruns_runpayload (run_id, kind, value, created_at)"
                " SELECT r, k.kind, k.value::jsonb, now() FROM unnest(%s::bigint[]) r,"
                " (VALUES ('input', '{\"ticket\": 1}'), ('output', '{\"label\": 1}'))"
                " AS k(kind, value)", [ids])
        done += n
    conn.execute("VACUUM ANALYZE")


PROBE_BLOCK = 20
"""Calls a probe makes at a turn: the filled and the empty database's probes take turns by
blocks this small, in shuffled order, so that a burst of load falls on both alike."""


def probe_pair(env: dict[str, str], empty_env: dict[str, str],
               calls: int) -> dict[str, dict[str, float]]:
    """One round: a probe process on each database, taking turns (PROBE_BLOCK calls at a
    time, enqueues then claims); each one's p50 and p99."""
    procs = {which: subprocess.Popen([sys.executable, "-m", "bench.history_probe"], env=e,
                                     cwd=REPO_ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
             for which, e in (("filled", env), ("empty", empty_env))}
    took: dict[str, dict[str, list[float]]] = {w: {"enqueue": [], "claim": []} for w in procs}
    try:
        for what in ("enqueue", "claim"):
            for start in range(0, calls, PROBE_BLOCK):
                order = list(procs)
                random.shuffle(order)
                for which in order:
                    took[which][what] += json.loads(
                        _ask(procs[which], f"{what} {min(PROBE_BLOCK, calls - start)}"))
        for proc in procs.values():
            assert _ask(proc, "finish").strip() == "ok"
    finally:
        for proc in procs.values():
            if proc.stdin:
                proc.stdin.close()
            if proc.wait(timeout=60):
                raise RuntimeError(f"a history probe exited with {proc.returncode}")
    return {which: {f"{what}_{name}_ms": f(values) for what, values in by.items()
                    for name, f in (("p50", statistics.median),
                                    ("p99", lambda v: history_probe.percentile(v, 0.99)))}
            for which, by in took.items()}


def _ask(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(f"{line}\n")
    proc.stdin.flush()
    return proc.stdout.readline()


def probe(env: dict[str, str], empty_env: dict[str, str], calls: int,
          rounds: int = 3) -> dict[str, float]:
    """Medians over `rounds` rounds of each figure on the filled database and on the empty
    one of the same layout, their probes taking turns call block by call block
    (`probe_pair`): the filled / empty ratio, taken under the same load, is the figure
    that can show growth; the load average (1 min) after each round, median, min, max."""
    seen: dict[str, list[dict[str, float]]] = {"filled": [], "empty": []}
    loads = []
    for _ in range(rounds):
        for which, figures in probe_pair(env, empty_env, calls).items():
            seen[which].append(figures)
        loads.append(os.getloadavg()[0])
    out: dict[str, float] = {}
    for which, runs in seen.items():
        med = {k: statistics.median(s[k] for s in runs) for k in runs[0]}
        out.update(med if which == "filled" else {f"empty_{k}": v for k, v in med.items()})
    for key in ("enqueue_p50_ms", "enqueue_p99_ms", "claim_p50_ms", "claim_p99_ms"):
        out[f"{key}_over_empty"] = out[key] / out[f"empty_{key}"]
    out.update(load1=statistics.median(loads), load1_min=min(loads), load1_max=max(loads))
    return out


def wal_lsn(admin: Admin) -> int:
    return int(admin.value("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn"))


def measure_drop(admin: Admin, conn: psycopg.Connection[Any], layout: str, env: dict[str, str],
                 span: int) -> dict[str, float]:
    """Purge the runs of the oldest span, then time getting rid of their history: the
    partitions' drop, or the plain tables' DELETE by batches of 1,000 runs (as purge did)."""
    # The first span holding filled runs only (the probes' runs came before the fill).
    first = conn.execute("SELECT min(id) FROM django_agentruns_agentrun WHERE agent = "
                         "'bench.llm'").fetchone()[0]
    lo = (int(first) // span + 1) * span
    hi = lo + span
    rows = int(conn.execute("SELECT count(*) FROM django_agentruns_runevent WHERE run_id >= %s"
                            " AND run_id < %s", [lo, hi]).fetchone()[0])
    runs = "DELETE FROM django_agentruns_agentrun WHERE id >= %s AND id < %s"
    if layout == "partitioned":  # purge deletes the runs, then drops what they leave
        conn.execute(runs, [lo, hi])
    conn.execute("CHECKPOINT")
    if layout == "partitioned":  # ops.partitions.drop, timed in its own process
        out = subprocess.run([sys.executable, "-m", "bench.history_probe", "drop"], env=env,
                             cwd=REPO_ROOT, check=True, capture_output=True, text=True)
        took, wal = json.loads(out.stdout.strip().splitlines()[-1])
    else:  # the owned rows first, by batches of 1,000 runs, as purge deletes them
        wal0, t0 = wal_lsn(admin), time.perf_counter()
        for start in range(lo, hi, 1000):
            with conn.transaction():
                for table in HISTORY:
                    conn.execute(f"DELETE FROM {table} WHERE run_id >= %s AND run_id < %s",
                                 [start, min(hi, start + 1000)])
        took, wal = time.perf_counter() - t0, wal_lsn(admin) - wal0
        conn.execute(runs, [lo, hi])
    time.sleep(1.5)  # the backend's counters reach pg_stat a moment after its commit
    conn.execute("SELECT pg_stat_clear_snapshot()")
    dead = conn.execute("SELECT COALESCE(sum(n_dead_tup), 0) FROM pg_stat_user_tables WHERE "
                        "relname LIKE 'django_agentruns_runevent%%' OR relname LIKE "
                        "'django_agentruns_runcheckpoint%%'").fetchone()[0]
    return {"span_runs": span, "event_rows": rows, "seconds": took, "wal_bytes": wal,
            "dead_tuples": int(dead)}


def sizes(conn: psycopg.Connection[Any]) -> dict[str, float]:
    runs = int(conn.execute("SELECT count(*) FROM django_agentruns_agentrun").fetchone()[0])
    out: dict[str, float] = {"runs": runs}
    for table in ("django_agentruns_agentrun", *HISTORY):
        total = conn.execute(
            "SELECT COALESCE(sum(pg_total_relation_size(relid)), 0), "
            "COALESCE(sum(pg_indexes_size(relid)), 0) FROM (SELECT relid FROM "
            "pg_partition_tree(%s::regclass) UNION SELECT %s::regclass) t",
            [table, table]).fetchone()
        out[f"{table}_mb_per_m_runs"] = float(total[0]) / 2**20 * 1e6 / max(runs, 1)
        out[f"{table}_index_mb_per_m_runs"] = float(total[1]) / 2**20 * 1e6 / max(runs, 1)
    return out


def rates(admin: Admin, filled: str, empty: str, span: int | None) -> dict[str, float]:
    """The no-op drain (one process at concurrency DRAIN_CONCURRENCY) and the LLM-shaped
    async rate (LLM_CONCURRENCY) on the filled database and on an empty one, alternating:
    medians, and filled / empty (the issue's target: within 10 %)."""
    engine = OURS
    if span:
        engine = replace(OURS, env=(*OURS.env, ("BENCH_HISTORY_PARTITION", str(span))))
    seen: dict[str, list[float]] = {}
    limit = llm.connection_limit(admin)
    with tempfile.TemporaryDirectory(prefix="agentruns-history-") as tmp:
        logs = Path(tmp)
        for round_ in range(RATE_ROUNDS):
            for which, name in (("empty", empty), ("filled", filled)):
                target = PgTarget(admin, name, fresh=False)
                noop = drain(target, engine, "noop", DRAIN_RUNS, 1, DRAIN_CONCURRENCY, 120.0,
                             logs)["runs_per_s"]
                agents = llm.trial(target, engine, "llm_async", LLM_CONCURRENCY, LLM_RUNS,
                                   120.0, limit, logs)["runs_per_s"]
                seen.setdefault(f"drain_{which}", []).append(noop)
                seen.setdefault(f"llm_{which}", []).append(agents)
                log(f"  round {round_ + 1}: {which}: no-op drain {noop:.0f} runs/s, "
                    f"LLM-shaped {agents:.0f} runs/s (load {os.getloadavg()[0]:.1f})")
    out = {k: statistics.median(v) for k, v in seen.items()}
    for kind in ("drain", "llm"):
        out[f"{kind}_filled_over_empty"] = out[f"{kind}_filled"] / out[f"{kind}_empty"]
    return out


def run_layout(layout: str, points: list[int], span: int, calls: int) -> LayoutResult:
    admin = Admin()
    name, empty = f"{PREFIX}_{layout}", f"{PREFIX}_{layout}_empty"
    extra = {"BENCH_HISTORY_PARTITION": str(span)} if layout == "partitioned" else {}
    env = django_env(db_url(name), **extra)
    empty_env = django_env(db_url(empty), **extra)
    result = LayoutResult(layout)
    try:
        for db in (name, empty):
            admin.drop(db)
            admin.execute(f'CREATE DATABASE "{db}"')
            subprocess.run([sys.executable, "-m", "django", "migrate", "--verbosity", "0"],
                           env=django_env(db_url(db), **extra), cwd=REPO_ROOT, check=True)
        result.points[0] = probe(env, empty_env, calls)
        print(f"  {layout} at 0: {result.points[0]}", flush=True)
        filled = 0
        with psycopg.connect(db_url(name), autocommit=True) as conn:
            for events in points:
                runs = (events - filled) // EVENTS_PER_RUN
                started, load0 = time.perf_counter(), os.getloadavg()[0]
                fill(conn, runs, env)
                filled = events
                result.fills[events] = {
                    "seconds": time.perf_counter() - started, "load1_start": load0,
                    "load1_end": os.getloadavg()[0],
                    "db_bytes": float(conn.execute(
                        "SELECT pg_database_size(current_database())").fetchone()[0])}
                print(f"  {layout}: filled {events:,} events: {result.fills[events]}",
                      flush=True)
                result.points[events] = probe(env, empty_env, calls)
                print(f"  {layout} at {events:,}: {result.points[events]}", flush=True)
            result.sizes = sizes(conn)
            result.rates = rates(admin, name, empty, span if layout == "partitioned" else None)
            print(f"  {layout} rates at {points[-1]:,} events: {result.rates}", flush=True)
            result.drop = measure_drop(admin, conn, layout, env, span)
            print(f"  {layout} drop: {result.drop}", flush=True)
    finally:
        admin.drop(name)
        admin.drop(empty)
        admin.close()
    return result


def main(events: int, points: list[int] | None = None, span: int = 50_000,
         calls: int = 200, layouts: tuple[str, ...] = LAYOUTS) -> list[LayoutResult]:
    points = sorted({p for p in (points or [1_000_000]) if 0 < p < events} | {events})
    runs = points[-1] // EVENTS_PER_RUN
    if "partitioned" in layouts and span * 2 > runs:
        raise SystemExit(f"refused: --span {span:,} is over half the {runs:,} runs the fill "
                         "makes; the drop needs a whole span of purged runs below the "
                         "newest (pass a smaller --span or more --events)")
    needed, free = check_disk(points[-1])
    print(f"history bench: {points[-1]:,} events, about {needed / 2**30:.1f} GiB of disk "
          f"needed per layout (one at a time); {free / 2**30:.1f} GiB free", flush=True)
    if free < 1.5 * needed:
        raise SystemExit(f"refused: free disk ({free / 2**30:.1f} GiB) is under 1.5 times "
                         f"what the fill needs ({needed / 2**30:.1f} GiB); pass fewer --events")
    results = [run_layout(layout, points, span, calls) for layout in layouts]
    print(json.dumps([r.__dict__ for r in results], indent=1))
    return results


_ = migrate  # the harness's template path is not used: each layout migrates its own database
