"""Side-by-side benchmark: django-agentruns against django-tasks-db and procrastinate.

    python -m bench [--quick] [--reps N] [--no-sqlite]

One invocation runs every workload for every engine, interleaved (each repetition
visits the engines in a rotated order), each trial on a fresh PostgreSQL database
copied from a migrated template. It prints a markdown table of medians with the ratio
of ours to the best peer, and writes it to bench/results.md with the machine it ran on.
See bench/README.md for what each workload measures and how.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from bench import fair, history, llm
from bench.drain import drain, enqueue_bulk, enqueue_one
from bench.engines import ENGINES, OURS, OURS_POOL, Engine
from bench.harness import (
    RUN_DB,
    SqliteTarget,
    log,
    run_trial,
)
from bench.pg import PREFIX, Admin, migrate
from bench.plan import FULL, QUICK, Plan, latency
from bench.report import machine, report
from bench.tables import Results, table

RESULTS = Path(__file__).resolve().parent / "results.md"


# --------------------------------------------------------------------------- trials


# --------------------------------------------------------------------------- main


def rotate(rep: int) -> list[Engine]:
    k = rep % len(ENGINES)
    return [*ENGINES[k:], *ENGINES[:k]]


def run_latency(rep: int, plan: Plan, admin: Admin, results: Results, logs: Path,
                note: Callable[[str, Engine, str], None]) -> None:
    """The enqueue-to-start latency rows, every engine (`--only latency`: these alone)."""
    for engine in rotate(rep):
        lat = run_trial(admin, f"latency {engine.key}", latency, engine, plan.latency_rate,
                        plan.latency_seconds, plan.worker_warmup, logs)
        for p in ("p50", "p95", "p99"):
            results.add(f"lat_{p}", engine, lat[p])
        results.pool("lat_p99_all", engine, lat["values"], 99)
        note("latency", engine, f"p50 {lat['p50']:.1f}  p95 {lat['p95']:.1f}  "
             f"p99 {lat['p99']:.1f} ms  ({lat['n']} samples, {lat['missing']} missing, "
             f"load {os.getloadavg()[0]:.2f})")


def run_rep(rep: int, plan: Plan, admin: Admin, results: Results, logs: Path,
            sqlite_template: Path | None, started: float) -> None:
    order = rotate(rep)

    note = functools.partial(_note, rep, plan, started)

    c = plan.drain_concurrency
    for key, processes, concurrency in (("drain1", 1, 1), ("drain4", 4, 1), ("drain1c", 1, c),
                                        ("drain4c", 4, c)):
        for engine in order:
            r = run_trial(admin, f"{key} {engine.key}", drain, engine, "noop",
                          plan.drain_runs, processes, concurrency, plan.drain_cap, logs)
            results.add(key, engine, r["runs_per_s"])
            results.flag(key, engine, r)
            results.add_cpu(key, engine, r)
            results.add(f"commits{processes}{'c' if concurrency > 1 else ''}", engine,
                        r["commits"])
            if key == "drain1":
                results.add("statements1", engine, r.get("statements", math.nan))
                results.add("rows1", engine, r["rows"])
                results.add("rss_drain", engine, r["rss_mb"])
            note(key, engine, f"{r['runs_per_s']:8.1f} runs/s  {r['done']} in "
                 f"{r['elapsed']:.1f}s  commits/run {r['commits']:.2f}  "
                 f"statements/run {r.get('statements', math.nan):.2f}  "
                 f"RSS {r['rss_mb']:.0f} MB")
    for engine in order:
        rate = run_trial(admin, f"enqueue one {engine.key}", enqueue_one, engine,
                         plan.enqueue_one_runs)
        results.add("enq_one", engine, rate)
        note("enqueue one", engine, f"{rate:8.1f} runs/s")
    for engine in order:
        rate = run_trial(admin, f"enqueue bulk {engine.key}", enqueue_bulk, engine,
                         plan.bulk_runs, plan.bulk_batch)
        results.add("enq_bulk", engine, rate)
        note("enqueue bulk", engine, f"{rate:8.1f} runs/s")
    run_latency(rep, plan, admin, results, logs, note)
    from bench import pooler

    if pooler.available():  # skipped, with a note, without pgbouncer
        lat = run_trial(admin, "latency ours via PgBouncer", pooler.pooled_latency, plan, logs)
        results.add("lat_pgb_p50", OURS, lat["p50"])
        results.add("lat_pgb_p99", OURS, lat["p99"])
        note("latency", pooler.OURS_PGBOUNCER, f"p50 {lat['p50']:.1f}  p99 {lat['p99']:.1f} "
             f"ms through PgBouncer ({lat['n']} samples, {lat['missing']} missing)")
    elif rep == 0:
        log("bench: pgbouncer is not installed: no latency row through PgBouncer")
    for kind in ("sleep_sync", "sleep_async"):
        for engine in order:
            if not engine.concurrent:
                concs = [1]
            elif rep == 0:
                concs = list(plan.io_concurrency)
            else:  # later repetitions re-measure the concurrency the sweep found best
                concs = [results.best_concurrency(kind, engine) or plan.io_concurrency[0]]
            runs = plan.io_runs if engine.concurrent else plan.io_serial_runs
            for c in concs:
                r = run_trial(admin, f"{kind} {engine.key} c={c}", drain, engine, kind, runs,
                              1, c, plan.io_cap, logs)
                results.io[(kind, engine.key)][c].append(r["runs_per_s"])
                results.flag(f"io_{kind}@{c}", engine, r)
                results.io_rss[(kind, engine.key)][c].append(r["rss_mb"])
                note(kind, engine, f"c={c:<4} {r['runs_per_s']:8.1f} runs/s  "
                     f"{r['done']} in {r['elapsed']:.1f}s  RSS {r['rss_mb']:.0f} MB"
                     f"{'  (workers left runs unfinished)' if r['incomplete'] else ''}")
            if rep == 0:
                best = results.best_concurrency(kind, engine)
                assert best is not None
                results.chosen[(kind, engine.key)] = best
        # Ours again at the highest concurrency, with a connection pool (see engines.py).
        c = max(plan.io_concurrency)
        r = run_trial(admin, f"{kind} ours+pool", drain, OURS_POOL, kind, plan.io_runs, 1, c,
                      plan.io_cap, logs)
        results.add(f"pool_{kind}", OURS, r["runs_per_s"])
        results.flag(f"pool_{kind}", OURS, r)
        note(kind, OURS_POOL, f"c={c:<4} {r['runs_per_s']:8.1f} runs/s  pool of 16  "
             f"{r['done']} in {r['elapsed']:.1f}s  RSS {r['rss_mb']:.0f} MB")
    if sqlite_template is not None and rep == 0:  # cheap extra rows: one repetition
        target_s = SqliteTarget(sqlite_template)
        try:
            r = drain(target_s, OURS, "noop", plan.drain_runs, 1, 1, plan.drain_cap, logs)
        finally:
            target_s.drop()
        results.add("sqlite_drain1", OURS, r["runs_per_s"])
        results.flag("sqlite_drain1", OURS, r)
        note("sqlite drain1", OURS, f"{r['runs_per_s']:8.1f} runs/s")
        target_s = SqliteTarget(sqlite_template)
        try:
            rate = enqueue_one(target_s, OURS, plan.enqueue_one_runs)
        finally:
            target_s.drop()
        results.add("sqlite_enq_one", OURS, rate)
        note("sqlite enq one", OURS, f"{rate:8.1f} runs/s")
    llm.run_llm(rep, plan, admin, results, logs, started)


def _note(rep: int, plan: Plan, started: float, workload: str, engine: Engine,
          text: str) -> None:
    log(f"[rep {rep + 1}/{plan.reps} {time.monotonic() - started:6.0f}s] "
        f"{workload:<14} {engine.key:<13} {text}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of about 2 minutes")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 1 quick)")
    parser.add_argument("--no-sqlite", action="store_true", help="skip the SQLite extra rows")
    parser.add_argument("--only", choices=["llm", "fair", "history", "latency"], default=None,
                        help="llm: only the LLM-shaped rows (bench/llm.py): their section of "
                             "the output is replaced, the rest kept; fair: fair shares "
                             "(bench/fair.py), printed and written to bench/fair_results.md; "
                             "history: the long-horizon history bench (bench/history.py), "
                             "printed only; latency: the enqueue-to-start latency rows, "
                             "printed only")
    parser.add_argument("--events", type=int, default=1_000_000,
                        help="history: events to fill (measured at 1M and at this many)")
    parser.add_argument("--at", default="1000000",
                        help="history: comma-separated smaller fills to measure at too "
                             "(the same run, so their latencies compare with the largest)")
    parser.add_argument("--layouts", default="plain,partitioned",
                        help="history: the layouts to measure, one after the other")
    parser.add_argument("--span", type=int, default=50_000,
                        help="history: HISTORY_PARTITION of the partitioned layout")
    parser.add_argument("--calls", type=int, default=200,
                        help="history: enqueue and claim calls per probe (its p99 is the "
                             "calls/100-th slowest: more calls, a steadier p99)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.only == "history":
        history.main(args.events, [int(n) for n in args.at.split(",") if n],
                     span=args.span, calls=args.calls, layouts=tuple(args.layouts.split(",")))
        return 0
    plan = QUICK if args.quick else FULL
    if args.reps is not None:
        if args.reps < 1:
            parser.error("--reps must be at least 1")
        plan = replace(plan, reps=args.reps)
    if args.no_sqlite or args.only:
        plan = replace(plan, sqlite=False)
    command = " ".join(["python -m bench", *(["--quick"] if args.quick else []),
                        *([f"--reps {plan.reps}"] if args.reps is not None else []),
                        *([f"--only {args.only}"] if args.only else [])])

    started = time.monotonic()
    load_start = f"{os.getloadavg()[0]:.2f}"
    admin = Admin()
    results = Results()
    with tempfile.TemporaryDirectory(prefix="agentruns-bench-") as tmp:
        logs = Path(tmp)
        try:
            info = machine(admin)
            log(f"bench: {info['CPUs (nproc)']}, PostgreSQL {info['PostgreSQL']}; "
                "migrating the template database")
            admin.make_template()
            sqlite_template = None
            if plan.sqlite:
                sqlite_template = logs / "template.sqlite3"
                migrate(f"sqlite:///{sqlite_template}")
            if args.only == "fair":
                text = fair.run_fair(plan.reps, admin, logs)
                (args.output.parent / "fair_results.md").write_text(text + "\n")
                print(text)
                return 0
            if args.only == "latency":
                for rep in range(plan.reps):
                    run_latency(rep, plan, admin, results, logs, functools.partial(
                        _note, rep, plan, started))
                print(table(results, plan))
                return 0
            for rep in range(plan.reps):
                if args.only == "llm":
                    llm.run_llm(rep, plan, admin, results, logs, started)
                else:
                    run_rep(rep, plan, admin, results, logs, sqlite_template, started)
        finally:
            admin.drop(RUN_DB)
            admin.drop(f"{PREFIX}_tpl")
            admin.close()
    load = (load_start, f"{os.getloadavg()[0]:.2f}")
    section = llm.section(results, plan, {**info, "load": " / ".join(load)}, command)
    if args.only == "llm":
        llm.merge(args.output, section)
        print(llm.table(results, plan))
    else:
        results.finish_io()
        text = report(results, plan, info, load, time.monotonic() - started, command, section)
        args.output.write_text(text + "\n")
        print(table(results, plan))
        print(llm.table(results, plan))
    log(f"bench: wrote {args.output}")
    return 0
