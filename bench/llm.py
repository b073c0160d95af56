"""The LLM-shaped workload: runs that wait on three model calls and write between them.

A run makes three model calls of 0.4 s (sleeps), emits an event after each and saves a
checkpoint after the second: 1.2 s of waiting and four writes, so workers with C slots in
all can at best finish C / 1.2 runs a second. Each trial queues a fixed number of runs,
starts one worker command (`--processes P` of `--concurrency C/P` each for ours) and times
from the first run's start to the last one's finish as the database stamped them, ramp-up
and tail included (or to the cap); meanwhile a sampler records the workers' connections to
the server and the RSS of each process. The harness shares the machine's cores with what
it measures, so it looks lightly: the queue every 100 ms (only to know when to stop), and
for a supervisor's children once a second (a walk of every process costs 2.5 ms: every
25 ms it took a tenth of a core from the workers). procrastinate is the peer, with a job
that writes one row per step into a table of its own through the ORM
(`bench/benchapp/tasks.py`); django-tasks-db runs one task at a time and sits this one out.

    python -m bench --only llm    # these rows alone; their section of results.md replaced

The `steps_*` rows run the same calls as durable steps (`ctx.step`, ours only): their
rate beside the plain rows' is the cost of a step.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import psutil
import psycopg

from bench.engines import OURS, PROCRASTINATE, Engine
from bench.harness import (
    CpuMeter,
    PgTarget,
    client,
    log,
    run_trial,
    start_workers,
    stop_workers,
)
from bench.pg import SERVER_URL, Admin, db_url, django_env

if TYPE_CHECKING:
    from bench.plan import Plan
    from bench.run import Results

RUN_SECONDS = 1.2
"""Three model calls of 0.4 s: the shortest a run can take."""
ENGINES = (OURS, PROCRASTINATE)
EVENTS_SQL = {
    "ours": "SELECT count(*) FROM django_agentruns_runevent WHERE type = 'llm.step'",
    "procrastinate": "SELECT count(*) FROM bench_step",
}
SPAN_SQL = {
    "ours": "SELECT extract(epoch FROM max(finished_at) - min(started_at)) "
            "FROM django_agentruns_agentrun",
    "procrastinate": "SELECT extract(epoch FROM max(at) FILTER (WHERE type IN "
                     "('succeeded', 'failed')) - min(at) FILTER (WHERE type = 'started')) "
                     "FROM procrastinate_events",
}
"""First start to last finish, as the database stamped them (a trial that emptied its
queue): the polls below only tell the harness when to stop looking."""
POLL = 0.1  # seconds between two looks at the queue
SAMPLE = 0.025  # seconds between two samples of the worker's connections and RSS
CHILDREN_EVERY = 40  # samples between two looks for a supervisor's children (1 s)
START_TIMEOUT = 60.0  # seconds a worker gets to claim its first run
BEGIN, END = "<!-- llm:begin -->", "<!-- llm:end -->"
STEPS = "llm_steps_"  # the kinds whose calls are durable steps


@dataclass(frozen=True)
class Goal:
    """The throughput ratio to procrastinate, and the ceilings, a row of ours must meet."""

    ratio: float
    connections: int
    rss_mb: float | None = None


GOALS = {("llm_async", 1000, 1): Goal(0.8, 8, 300), ("llm_async", 1000, 2): Goal(0.9, 8, 300),
         ("llm_sync", 200, 1): Goal(0.9, 8)}
"""(agent, slots in all, processes): the ratio, and connections and RSS per process."""


class Sampler(threading.Thread):
    """Peak connections and RSS of one worker process (with its children), every 25 ms.

    Connections are the `pg_stat_activity` rows carrying the worker's application name,
    which libpq takes from ``PGAPPNAME`` in the worker's environment, so every library's
    connections (Django's, procrastinate's pool) carry it; cross-checked with the worker's
    TCP sockets to the server's port in case a library names its own. Past `limit`
    connections `over` is set and the harness stops the trial, rather than exhaust the
    connections of a server others use.
    """

    def __init__(self, pid: int, app: str, limit: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.app = app
        self.limit = limit
        self.port = urlsplit(SERVER_URL).port or 5432
        self.connections = 0
        self.rss_each = 0  # the largest one process's RSS (a supervisor's children apart)
        self.named = 0  # the peak of pg_stat_activity alone
        self.sockets = 0  # the peak of the socket scan alone
        self.rss = 0
        self.over = False
        self._stop_event = threading.Event()
        self._children: list[psutil.Process] = []

    def run(self) -> None:
        with psycopg.connect(db_url("postgres"), autocommit=True) as conn:
            tick = 0
            while not self._stop_event.is_set():
                row = conn.execute("SELECT count(*) FROM pg_stat_activity "
                                   "WHERE application_name = %s", [self.app]).fetchone()
                named = int(row[0]) if row else 0
                sockets = 0
                if tick % CHILDREN_EVERY == 0:  # a walk of every process: about 2.5 ms
                    with contextlib.suppress(psutil.Error):
                        self._children = self.process.children(recursive=True)
                processes = [self.process, *self._children]
                rss = 0
                for p in processes:
                    with contextlib.suppress(psutil.Error):
                        one = p.memory_info().rss
                        rss += one
                        self.rss_each = max(self.rss_each, one)
                        if tick % 8 == 0:  # a socket scan costs more: every 200 ms
                            sockets += sum(1 for c in p.net_connections("tcp")
                                           if c.raddr and c.raddr.port == self.port)
                seen = max(named, sockets)
                self.named = max(self.named, named)
                self.sockets = max(self.sockets, sockets)
                self.connections = max(self.connections, seen)
                self.rss = max(self.rss, rss)
                self.over = self.over or seen > self.limit
                tick += 1
                self._stop_event.wait(SAMPLE)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(10)


def connection_limit(admin: Admin) -> int:
    """Connections a worker may hold before its trial is stopped: a quarter of the server's
    `max_connections` unless ``BENCH_MAX_WORKER_CONNECTIONS`` says otherwise."""
    configured = os.environ.get("BENCH_MAX_WORKER_CONNECTIONS")
    if configured:
        return int(configured)
    return int(admin.value("SHOW max_connections")) // 4


def trial(target: PgTarget, engine: Engine, kind: str, concurrency: int, runs: int,
          cap: float, limit: int, logs: Path, processes: int = 1) -> dict[str, Any]:
    """`runs` queued runs of `kind`, one worker command of `processes` processes at
    `concurrency` each; timed from the first run's start to the last one's finish as the
    database stamped them (`SPAN_SQL`), or, stopped at `cap` seconds, from the first
    start seen by a poll (the queued count drops) to the cap."""
    client(target.url, engine, "prefill", kind, str(runs))
    target.analyze()
    target.settle()
    app = f"agentruns-bench-{engine.key}-{os.getpid()}"
    env = django_env(target.url, PGAPPNAME=app, **dict(engine.env))
    queued_sql = f"SELECT count(*) FROM {engine.table} WHERE status = '{engine.pending[0]}'"
    logfile = logs / f"{engine.key}-{kind}-{concurrency}x{processes}.log"
    target.open_poller()
    meter = CpuMeter(target.name)
    launched = time.perf_counter()
    workers = start_workers(engine, 1, concurrency, True, env, logfile, processes)
    sampler = Sampler(workers[0].pid, app, limit)
    sampler.start()
    remaining, start = runs, None
    try:
        while True:
            now = time.perf_counter()
            exited = workers[0].poll() is not None
            if start is None:
                if target.count(queued_sql) < runs:
                    start = now  # the first claim, give or take one poll
                elif exited or now - launched > START_TIMEOUT:
                    break
            else:
                remaining = target.count(engine.pending_sql())
                if remaining == 0 or now - start >= cap or sampler.over or exited:
                    break
            time.sleep(POLL)
        events = target.count(EVENTS_SQL[engine.key])
        stamped = target.seconds(SPAN_SQL[engine.key]) if not remaining else None
        # Exit codes before the stop: a worker stopped at the cap may be killed in the end.
        failed = workers[0].poll() not in (0, None)
    finally:
        if remaining:  # measured: no need to wait for the runs in flight
            with contextlib.suppress(ProcessLookupError):
                workers[0].kill()
        stop_workers(workers, wait_first=30.0)
        sampler.stop()
        target.close_poller()
        cpu = meter.stop()
    if start is None or failed or (remaining == runs and not sampler.over):
        tail = logfile.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{engine.key} {kind}: no run finished "
                           f"(exit {workers[0].returncode}):\n{tail}")
    elapsed = stamped or now - start
    rate = (runs - remaining) / elapsed
    return {"runs_per_s": rate, "ratio": rate / (processes * concurrency / RUN_SECONDS),
            "events_per_s": events / elapsed, "connections": sampler.connections / processes,
            "named": sampler.named, "sockets": sampler.sockets,
            "rss_mb": sampler.rss_each / 2**20, "done": runs - remaining, "elapsed": elapsed,
            "capped": remaining > 0 and elapsed >= cap, "over": sampler.over,
            "incomplete": remaining > 0 and elapsed < cap and not sampler.over,
            **{f"cpu_{k}": 1000 * v / max(runs - remaining, 1) for k, v in cpu.items()}}


METRICS = ("runs_per_s", "ratio", "events_per_s", "connections", "rss_mb")


def key(kind: str, concurrency: int, metric: str, processes: int = 1) -> str:
    """`concurrency`: slots in all (per process times processes)."""
    suffix = f"x{processes}p" if processes > 1 else ""
    return f"{kind}@{concurrency}{suffix}_{metric}"  # kinds start with llm_


def run_llm(rep: int, plan: Plan, admin: Admin, results: Results, logs: Path,
            started: float) -> None:
    """One repetition of every LLM row, the engines' order rotated by repetition."""
    limit = connection_limit(admin)
    order = ENGINES[rep % 2:] + ENGINES[:rep % 2]
    for kind, per_process, processes, runs in plan.llm_configs:
        concurrency = per_process * processes
        for engine in order:
            if (processes > 1 or kind.startswith(STEPS)) and engine is not OURS:
                continue  # durable steps are ours alone; the peer's rows run one process
            r = run_trial(admin, f"{kind} c={per_process}x{processes} {engine.key}", trial,
                          engine, kind, per_process, runs, plan.llm_cap, limit, logs,
                          processes)
            for metric in METRICS:
                results.add(key(kind, concurrency, metric, processes), engine, float(r[metric]))
            results.flag(key(kind, concurrency, "runs_per_s", processes), engine, r)
            results.add_cpu(key(kind, concurrency, "runs_per_s", processes), engine, r)
            if r["over"]:
                results.capped.add(f"{key(kind, concurrency, 'over', processes)}:{engine.key}")
            log(f"[rep {rep + 1}/{plan.reps} {time.monotonic() - started:6.0f}s] "
                f"{kind:<14} {engine.key:<13} c={per_process}x{processes:<3} "
                f"{r['runs_per_s']:7.1f} runs/s "
                f"({r['ratio']:.2f} of {concurrency / RUN_SECONDS:.0f})  "
                f"{r['events_per_s']:7.1f} events/s  {r['connections']:.0f} connections per "
                f"process ({r['named']} named, {r['sockets']} sockets in all)  "
                f"RSS {r['rss_mb']:.0f} MB per process  {r['done']} of {runs} in "
                f"{r['elapsed']:.1f}s  CPU ms/run worker {r['cpu_worker']:.2f} "
                f"postgres {r['cpu_postgres']:.2f} harness {r['cpu_harness']:.2f}"
                f"{'  (stopped: over the connection limit)' if r['over'] else ''}")


def table(results: Results, plan: Plan) -> str:
    lines = ["| agent | runs | processes x concurrency | engine | runs/s ↑ | of possible ↑ | "
             "events/s ↑ | peak connections per process ↓ | peak RSS per process (MB) ↓ | "
             "target (ours) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for kind, per_process, processes, runs in plan.llm_configs:
        c = per_process * processes
        for engine in ENGINES:
            med = {m: results.median(key(kind, c, m, processes), engine) for m in METRICS}
            if med["runs_per_s"] is None:
                continue
            flag = ""
            name = key(kind, c, "runs_per_s", processes)
            if f"{name}:{engine.key}" in results.capped:
                flag += "*"
            if f"{name}:{engine.key}" in results.incomplete:
                flag += "†"
            if f"{key(kind, c, 'over', processes)}:{engine.key}" in results.capped:
                flag += "‡"
            goal = GOALS.get((kind, c, processes)) if engine is OURS else None
            lines.append(
                f"| {kind.replace('llm_', '')} | {runs:,} | {processes} x {per_process:,} | "
                f"{engine.label} | {rate(med['runs_per_s'])}{flag} | "
                f"{med['ratio']:.2f} of {c / RUN_SECONDS:,.0f} | "
                f"{rate(med['events_per_s'])} | {med['connections']:.0f} | "
                f"{med['rss_mb']:.0f} | {verdict(goal, med)} |")
    return "\n".join(lines)


def cpu_table(results: Results, plan: Plan) -> str:
    """CPU ms per run finished, medians: worker / PostgreSQL / harness."""
    lines = ["| agent | runs | processes x concurrency | engine | worker | PostgreSQL | "
             "harness |", "|---|---:|---:|---|---:|---:|---:|"]
    for kind, per_process, processes, runs in plan.llm_configs:
        row = key(kind, per_process * processes, "runs_per_s", processes)
        for engine in ENGINES:
            parts = [results.cpu.get(f"cpu_{p}:{row}", {}).get(engine.key)
                     for p in ("worker", "postgres", "harness")]
            if not all(parts):
                continue
            cells = " | ".join(f"{statistics.median(v or [0]):.2f}" for v in parts)
            lines.append(f"| {kind.replace('llm_', '')} | {runs:,} | {processes} x "
                         f"{per_process:,} | {engine.label} | {cells} |")
    return "\n".join(lines)


def rate(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def verdict(goal: Goal | None, med: dict[str, float | None]) -> str:
    if goal is None:
        return ""
    wanted = [f"≥ {goal.ratio:.2f}", f"≤ {goal.connections} connections"]
    met = (med["ratio"] or 0) >= goal.ratio and (med["connections"] or 0) <= goal.connections
    if goal.rss_mb is not None:
        wanted.append(f"≤ {goal.rss_mb:.0f} MB")
        met = met and (med["rss_mb"] or 0) <= goal.rss_mb
    return f"{', '.join(wanted)}: {'met' if met else '**not met**'}"


def section(results: Results, plan: Plan, info: dict[str, str], command: str) -> str:
    """The results.md section of these rows, between markers so `--only llm` can replace
    it alone."""
    raw = {k: {e: [round(x, 3) for x in xs] for e, xs in v.items()}
           for k, v in results.values.items() if k.startswith("llm_")}
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([
        BEGIN,
        "## LLM-shaped agents",
        "",
        f"Run {when} with `{command}`: {plan.reps} repetition(s), medians. A run makes three "
        f"model calls of 0.4 s (sleeps), emits an event after each and checkpoints after the "
        f"second; procrastinate's job writes one row per step to a table of its own through "
        f"the ORM (it has no checkpoint). Each row queues the runs it states and is timed "
        f"from the first run's start to the last one's finish as the database stamped them "
        f"(ramp-up and tail included), cap {plan.llm_cap:g} s. *Of possible*: runs/s over "
        "all slots / 1.2 s. *Events/s*: the "
        "agent's events (procrastinate: its step rows) over the same time. Connections: the "
        "worker's rows in `pg_stat_activity` (application name from `PGAPPNAME`), sampled "
        f"every 25 ms, divided by the processes; RSS of the largest process. Server "
        f"{server()}: PostgreSQL "
        f"{info.get('PostgreSQL', '?')}, max_connections "
        f"{info.get('max_connections (server-wide)', '?')}, "
        f"CPUs {info.get('CPUs (nproc)', '?')}, load average {info.get('load', '?')}.",
        "",
        table(results, plan),
        "",
        "CPU per run finished (ms, medians): the worker processes (start-up included), the "
        "PostgreSQL backends serving the trial's database, the harness timing it.",
        "",
        cpu_table(results, plan),
        "",
        "`*` the cap struck first: runs finished / time. `†` the worker exited with runs "
        "unfinished. `‡` stopped when the worker held more connections than "
        "`BENCH_MAX_WORKER_CONNECTIONS` (default a quarter of the server's `max_connections`).",
        "",
        "```json",
        json.dumps(raw)[:8000],
        "```",
        END,
    ])


def server() -> str:
    parts = urlsplit(SERVER_URL)
    return f"{parts.hostname}:{parts.port or 5432}"


def merge(path: Path, text: str) -> None:
    """Replace the LLM section of `path` (or append it), keeping the rest."""
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + text + rest.split(END, 1)[1]
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text + "\n"
    path.write_text(new)

