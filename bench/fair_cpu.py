"""Fair shares' cost in CPU time, which a loaded machine's noise spares (issue 28).

A worker's claim loop without the worker: settle the previous batch and claim the next
(`transitions.settle_and_claim`, as `Worker._settle_and_claim` calls it) until N no-op runs
are drained, on PostgreSQL. Per run: this process's CPU time and its PostgreSQL backend's
(read from /proc, so the server must be local), variants interleaved in a rotated order,
medians of REPS:

- plain: runs without a fair key (no group row: the ordinary claim, in age order);
- fair: every run in one of 10 groups (the claim in stamp order, in the same statement as
  the settle);
- fair2: the same in two statements, settle then claim.

    DATABASE_URL=postgres://.../a_scratch_db DJANGO_SETTINGS_MODULE=bench.settings \\
        N=1500 B=8 REPS=3 python -m bench.fair_cpu

It TRUNCATEs the run tables of that database: give it one of its own (migrated).
"""

from __future__ import annotations

import os
import statistics
import time

import django

django.setup()

from django.db import connection  # noqa: E402

from django_agentruns import enqueue_many, transitions  # noqa: E402
from django_agentruns.models import AgentRun  # noqa: E402
from django_agentruns.outcomes import AttemptRef, ScopePolicy  # noqa: E402

N = int(os.environ.get("N", "1500"))
BATCH = int(os.environ.get("B", "8"))
REPS = int(os.environ.get("REPS", "3"))
VARIANTS = os.environ.get("VARIANTS", "plain,fair,fair2").split(",")
TICK = os.sysconf("SC_CLK_TCK")


def backend_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def fill(fair: bool) -> int:
    """N queued runs (10 groups, or none), analyzed; the backend's pid."""
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE django_agentruns_runevent, django_agentruns_fairgroup, "
                       "django_agentruns_agentrun CASCADE")
    requests = [{"agent": "bench.tenant", "input": {"t": f"t{i % 10}"}} if fair
                else {"agent": "bench.noop"} for i in range(N)]
    for i in range(0, N, 1000):
        enqueue_many(requests[i:i + 1000])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_agentruns_agentrun")
        cursor.execute("ANALYZE django_agentruns_fairgroup")
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def drain(variant: str) -> tuple[float, float]:
    """(client, backend) CPU microseconds per run."""
    pid = fill(variant != "plain")
    fair = variant != "plain"
    previous: list[AgentRun] = []
    settled_total = 0
    client, backend = time.process_time(), backend_cpu(pid)
    while True:
        done = [(AttemptRef(r.pk, r.attempt, "w", 60.0, agent=r.agent), None) for r in previous]
        if variant == "fair2":
            settled = transitions.settle_succeeded_many("w", done) if done else {}
            claimed = transitions.claim("w", ["default"], BATCH, ScopePolicy(), {}, 60.0,
                                        include_lapsed=False, fair=fair)
        else:
            settled, claimed = transitions.settle_and_claim(
                "w", done, ["default"], BATCH, ScopePolicy(), {}, 60.0, include_lapsed=False,
                fair=fair)
        settled_total += len(settled)
        if not claimed and not previous:
            break
        previous = claimed
    assert settled_total == N, settled_total
    return ((time.process_time() - client) / N * 1e6, (backend_cpu(pid) - backend) / N * 1e6)


def main() -> None:
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for rep in range(REPS):
        for variant in VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]:
            results[variant].append(drain(variant))
    base = statistics.median(c + b for c, b in results[VARIANTS[0]])
    for variant, rows in results.items():
        total = statistics.median(c + b for c, b in rows)
        print(f"{variant}: client {statistics.median(c for c, _ in rows):.0f} us/run, backend "
              f"{statistics.median(b for _, b in rows):.0f} us/run, both {total:.0f} us/run "
              f"({total / base - 1:+.1%} vs {VARIANTS[0]})")
    with open("/proc/loadavg") as load:
        print(f"N={N} B={BATCH} reps={REPS}; load {load.read().strip()}")


if __name__ == "__main__":
    main()
