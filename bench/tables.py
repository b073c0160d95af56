"""The benchmark's results and the markdown tables made of them: the main table (medians,
ratio of ours to the better peer), CPU per run, the I/O sweep."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from bench.engines import ENGINES, OURS, PEERS, Engine
from bench.plan import Plan

HIGHER, LOWER = "↑", "↓"

ROWS: list[tuple[str, str, str, str]] = [
    # key, label, better, unit format
    ("drain1", "no-op drain of {drain_n} runs, 1 worker process, concurrency 1 (runs/s)",
     HIGHER, "rate"),
    ("drain4", "no-op drain of {drain_n} runs, 4 worker processes, concurrency 1 (runs/s)",
     HIGHER, "rate"),
    ("drain1c", "no-op drain of {drain_n} runs, 1 worker process, concurrency {drain_c} "
     "(runs/s)", HIGHER, "rate"),
    ("drain4c", "no-op drain of {drain_n} runs, 4 worker processes, concurrency {drain_c} "
     "(runs/s)", HIGHER, "rate"),
    ("enq_one", "enqueue one by one, a transaction each (runs/s)", HIGHER, "rate"),
    ("enq_bulk", "enqueue in bulk, {batch} per transaction (runs/s)", HIGHER, "rate"),
    ("lat_p50", "enqueue→start latency p50, idle worker, {rate:g}/s (ms)", LOWER, "ms"),
    ("lat_p95", "enqueue→start latency p95 (ms)", LOWER, "ms"),
    ("lat_p99", "enqueue→start latency p99 (ms)", LOWER, "ms"),
    ("lat_p99_all", "enqueue→start latency p99 of every repetition's samples together (ms)",
     LOWER, "ms"),
    ("lat_pgb_p50", "enqueue→start latency p50 through PgBouncer (transaction mode), "
     "LISTEN_DATABASE direct, ours only (ms)", LOWER, "ms"),
    ("lat_pgb_p99", "enqueue→start latency p99 through PgBouncer, LISTEN_DATABASE direct "
     "(ms)", LOWER, "ms"),
    ("io_sleep_sync", "I/O-bound 100 ms sync agent, 1 process, best concurrency (runs/s)",
     HIGHER, "rate"),
    ("io_sleep_async", "I/O-bound 100 ms async agent, 1 process, best concurrency (runs/s)",
     HIGHER, "rate"),
    ("pool_sleep_sync", "I/O-bound sync, ours with Django's pool of 16 connections, c={pool_c} "
     "(runs/s)", HIGHER, "rate"),
    ("pool_sleep_async", "I/O-bound async, ours with Django's pool of 16 connections, "
     "c={pool_c} (runs/s)", HIGHER, "rate"),
    ("commits1", "worker commits per run, no-op drain, 1 process", LOWER, "per"),
    ("commits4", "worker commits per run, no-op drain, 4 processes", LOWER, "per"),
    ("commits1c", "worker commits per run, no-op drain, 1 process, concurrency {drain_c}",
     LOWER, "per"),
    ("commits4c", "worker commits per run, no-op drain, 4 processes, concurrency {drain_c}",
     LOWER, "per"),
    ("statements1", "worker SQL statements per run, no-op drain, 1 process", LOWER, "per"),
    ("rows1", "rows written per run, no-op drain, 1 process", LOWER, "per"),
    ("rss_drain", "worker peak RSS, no-op drain, 1 process (MB)", LOWER, "mb"),
    ("rss_io", "worker peak RSS, I/O async at best concurrency (MB)", LOWER, "mb"),
    ("sqlite_drain1", "SQLite (ours only): no-op drain, 1 worker process (runs/s)", HIGHER,
     "rate"),
    ("sqlite_enq_one", "SQLite (ours only): enqueue one by one (runs/s)", HIGHER, "rate"),
]


class Results:
    def __init__(self) -> None:
        self.values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        # I/O sweeps: (kind, engine) -> concurrency -> runs/s per rep; and peak RSS
        self.io: dict[tuple[str, str], dict[int, list[float]]] = defaultdict(
            lambda: defaultdict(list))
        self.io_rss: dict[tuple[str, str], dict[int, list[float]]] = defaultdict(
            lambda: defaultdict(list))
        self.cpu: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        # Rows of pooled samples (`pool`): key -> engine -> every repetition's samples.
        self.samples: dict[str, dict[str, list[float]]] = defaultdict(
            lambda: defaultdict(list))
        self.capped: set[str] = set()
        self.incomplete: set[str] = set()
        # The concurrency the first repetition's sweep found best, kept for the others.
        self.chosen: dict[tuple[str, str], int] = {}

    def flag(self, key: str, engine: Engine, result: dict[str, Any]) -> None:
        if result.get("capped"):
            self.capped.add(f"{key}:{engine.key}")
        if result.get("incomplete"):
            self.incomplete.add(f"{key}:{engine.key}")

    def add(self, key: str, engine: Engine, value: float) -> None:
        self.values[key][engine.key].append(value)

    def pool(self, key: str, engine: Engine, samples: list[float], p: float) -> None:
        """Row `key`: the p-th percentile of every repetition's `samples` so far, together."""
        from bench.plan import percentile

        pooled = self.samples[key][engine.key]
        pooled.extend(samples)
        self.values[key][engine.key] = [percentile(pooled, p)]

    def best_concurrency(self, kind: str, engine: Engine) -> int | None:
        if (kind, engine.key) in self.chosen:
            return self.chosen[(kind, engine.key)]
        sweep = self.io.get((kind, engine.key))
        if not sweep:
            return None
        return max(sweep, key=lambda c: statistics.median(sweep[c]))

    def finish_io(self) -> None:
        """Turn each engine's I/O sweep into its best-concurrency row."""
        for (kind, key), sweep in self.io.items():
            engine = next(e for e in ENGINES if e.key == key)
            best = self.best_concurrency(kind, engine)
            assert best is not None
            self.values[f"io_{kind}"][key] = list(sweep[best])
            for flags in (self.capped, self.incomplete):
                if f"io_{kind}@{best}:{key}" in flags:
                    flags.add(f"io_{kind}:{key}")
            if kind == "sleep_async":
                self.values["rss_io"][key] = list(self.io_rss[(kind, key)][best])

    def add_cpu(self, key: str, engine: Engine, result: dict[str, Any]) -> None:
        """A trial's CPU per run (`CpuMeter`), under `cpu_<part>:<row key>`."""
        for part in CPU_PARTS:
            if f"cpu_{part}" in result:
                self.cpu[f"cpu_{part}:{key}"][engine.key].append(result[f"cpu_{part}"])

    def median(self, key: str, engine: Engine) -> float | None:
        values = self.values.get(key, {}).get(engine.key)
        return statistics.median(values) if values else None


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "rate":
        return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"
    if unit == "ms":
        return f"{value:,.1f}"
    if unit == "per":
        return f"{value:.2f}"
    return f"{value:.0f}"


def table(results: Results, plan: Plan) -> str:
    lines = ["| workload | ours | django-tasks-db | procrastinate | ratio ours / best peer |",
             "|---|---:|---:|---:|---:|"]
    for key, label, better, unit in ROWS:
        if key not in results.values:
            continue
        label = label.format(batch=f"{plan.bulk_batch:,}", rate=plan.latency_rate,
                             pool_c=max(plan.io_concurrency), drain_c=plan.drain_concurrency,
                             drain_n=f"{plan.drain_runs:,}")
        cells = []
        for engine in ENGINES:
            text = fmt(results.median(key, engine), unit)
            if key.startswith("io_") and results.median(key, engine) is not None:
                kind = key[3:]
                best = results.best_concurrency(kind, engine)
                text += f" (c={best})" if engine.concurrent else " (c=1)"
            if f"{key}:{engine.key}" in results.capped:
                text += "*"
            if f"{key}:{engine.key}" in results.incomplete:
                text += "†"
            cells.append(text)
        ours = results.median(key, OURS)
        # The pool rows are ours alone: they compare with the peers' I/O rows.
        peer_key = key.replace("pool_", "io_", 1)
        peers = [v for v in (results.median(peer_key, e) for e in PEERS) if v is not None]
        if ours is None or not peers:
            ratio = "—"
        else:
            best_peer = max(peers) if better == HIGHER else min(peers)
            ratio = f"{ours / best_peer:.2f}x" if best_peer else "—"
        lines.append(f"| {label} {better} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


CPU_PARTS = ("worker", "postgres", "harness")


def cpu_table(results: Results, labels: dict[str, str]) -> str:
    """CPU ms per run finished, medians: worker / PostgreSQL / harness, per engine."""
    lines = ["| workload | " + " | ".join(e.label for e in ENGINES) + " |",
             "|---|" + "---:|" * len(ENGINES)]
    for key, label in labels.items():
        cells = []
        for engine in ENGINES:
            parts = [results.cpu.get(f"cpu_{p}:{key}", {}).get(engine.key) for p in CPU_PARTS]
            cells.append(" / ".join(f"{statistics.median(v):.2f}" for v in parts if v)
                         if all(parts) else "—")
        if any(c != "—" for c in cells):
            lines.append(f"| {label.replace(' (runs/s)', '')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(results: Results) -> str:
    concs = sorted({c for sweep in results.io.values() for c in sweep})
    lines = ["| agent | engine | " + " | ".join(f"c={c}" for c in concs) + " |",
             "|---|---|" + "---:|" * len(concs)]
    for kind in ("sleep_sync", "sleep_async"):
        for engine in ENGINES:
            sweep = results.io.get((kind, engine.key), {})
            cells = []
            for c in concs:
                text = fmt(statistics.median(sweep[c]), "rate") if c in sweep else "—"
                if f"io_{kind}@{c}:{engine.key}" in results.capped:
                    text += "*"
                if f"io_{kind}@{c}:{engine.key}" in results.incomplete:
                    text += "†"
                cells.append(text)
            lines.append(f"| {kind} | {engine.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
