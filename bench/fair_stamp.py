"""Experiment (issue 28): the fair claim if each run carried a virtual start stamped at enqueue.

Not the library's code: a probe of the design in bench/fair_results.md ("Stamped virtual
starts"), to know its price before building it. It adds a column `fair_vstart` and two
indexes to the run table of the database it is given (and drops them at the end), stamps
the runs it enqueues as enqueue would (a group's first new run at the later of its last
queued stamp + 1 / weight and the stamp the claim takes next, each next one 1 / weight
later; here by an UPDATE after the fill, then VACUUM, as enqueue's INSERT would leave no
dead rows), and runs the ordinary claim ordered by (priority, fair_vstart, age): no group
row read or written at claim time. Parts:

- cpu: CPU time per run (this process and its PostgreSQL backend, as `bench.fair_cpu`) of
  a settle-and-claim drain of N no-op runs: `plain` (no fair key, the ordinary claim),
  `stamped` (10 groups, the ordinary claim in stamp order), `fair` (10 groups, today's fair
  claim); interleaved, rotated, medians of REPS;
- late: tenant A's 10,000 runs, 24 starts, then tenant B's 10 (stamped from the stamp
  the claim takes next): the claim that starts B's last run ends at which start after B's
  enqueue (target <= 24; claims of 8, so a multiple of 8);
- weights: A (weight 3) and B (weight 1) 4,000 runs each: A/B among the first 4,000 starts;
- enqueue: what the stamp adds to an enqueue_many of 1,000 and 10,000 runs of one tenant
  (one statement: two index reads per group in the batch; each row's rank in its group
  computed by the client and sent with the row, so the statement needs no window),
  as the wall time of the stamps' SELECT against the same rows read without it.

    DATABASE_URL=postgres://.../a_scratch_db DJANGO_SETTINGS_MODULE=bench.settings \\
        N=1500 REPS=3 python -m bench.fair_stamp

It TRUNCATEs the run tables of that database: give it one of its own (migrated).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import django

django.setup()

from django.db import connection  # noqa: E402
from django.db.models import QuerySet  # noqa: E402
from django.db.models.expressions import RawSQL  # noqa: E402

from bench import fair_cpu  # noqa: E402
from django_agentruns import enqueue_many, transitions  # noqa: E402
from django_agentruns.models import AgentRun  # noqa: E402
from django_agentruns.outcomes import AttemptRef, ScopePolicy  # noqa: E402
from django_agentruns.transitions import due  # noqa: E402

RUNS = "django_agentruns_agentrun"
PARTS = os.environ.get("PARTS", "cpu,late,weights,enqueue").split(",")
_ordinary = due.due_queued


def schema(add: bool) -> None:
    with connection.cursor() as cursor:
        if add:
            cursor.execute(f"ALTER TABLE {RUNS} ADD COLUMN IF NOT EXISTS fair_vstart float8")
            # The claim's order, and each group's last stamp (enqueue's base).
            cursor.execute(f"CREATE INDEX IF NOT EXISTS probe_fair_order ON {RUNS} (queue, "
                           f"priority DESC, fair_vstart, available_at, fired_seq, id) "
                           f"WHERE status = 'queued'")
            cursor.execute(f"CREATE INDEX IF NOT EXISTS probe_fair_last ON {RUNS} (queue, "
                           f"fair_key, fair_vstart) WHERE status = 'queued'")
        else:
            cursor.execute("DROP INDEX IF EXISTS probe_fair_order")
            cursor.execute("DROP INDEX IF EXISTS probe_fair_last")
            cursor.execute(f"ALTER TABLE {RUNS} DROP COLUMN IF EXISTS fair_vstart")


def stamped_order(on: bool) -> None:
    """The ordinary claim's due query, ordered by stamp (on) or as it is (off)."""
    def in_stamp_order(*args: Any, **kwargs: Any) -> QuerySet[AgentRun]:
        return _ordinary(*args, **kwargs).order_by(
            "-priority", RawSQL("fair_vstart", ()).asc(), "available_at", "fired_seq", "id")
    due.due_queued = in_stamp_order if on else _ordinary
    due.compiled_due.cache_clear()


STAMP = (f"UPDATE {RUNS} r SET fair_vstart = s.v FROM (SELECT id, GREATEST("
         f"COALESCE((SELECT MAX(l.fair_vstart) FROM {RUNS} l WHERE l.queue = x.queue AND "
         f"l.fair_key = x.fair_key AND l.status = 'queued'), '-infinity') + w, COALESCE(("
         f"SELECT n.fair_vstart FROM {RUNS} n WHERE n.queue = x.queue AND n.status = "
         f"'queued' AND n.available_at <= now() ORDER BY n.priority DESC, n.fair_vstart "
         f"LIMIT 1), 0)) + (ROW_NUMBER() OVER (PARTITION BY "
         f"x.queue, x.fair_key ORDER BY x.id) - 1) * w AS v FROM (SELECT y.*, (CASE y.fair_key "
         f"WHEN %s THEN %s ELSE 1.0 END) AS w FROM {RUNS} y WHERE y.status = 'queued' AND "
         f"y.fair_vstart IS NULL) x) s WHERE s.id = r.id")


def stamp(heavy: str = "", weight: float = 1.0) -> None:
    """Stamp the runs not stamped yet, as enqueue would have (in one batch per call)."""
    with connection.cursor() as cursor:
        cursor.execute(STAMP, [heavy, 1.0 / weight])


def tenants(counts: dict[str, int]) -> None:
    for tenant, n in counts.items():
        requests = [{"agent": "bench.tenant", "input": {"t": tenant}}] * n
        for i in range(0, n, 1000):
            enqueue_many(requests[i:i + 1000])


def truncate() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE django_agentruns_runevent, django_agentruns_fairgroup, {RUNS} "
                       f"CASCADE")


class Loop:
    """A worker's settle-and-claim loop (claims of 8, no fair weights: the ordinary claim)."""

    def __init__(self) -> None:
        self.previous: list[AgentRun] = []
        self.started: list[str] = []

    def step(self) -> int:
        done = [(AttemptRef(r.pk, r.attempt, "w", 60.0, agent=r.agent), None)
                for r in self.previous]
        _, claimed = transitions.settle_and_claim("w", done, ["default"], 8, ScopePolicy(), {},
                                                  60.0, include_lapsed=False)
        self.started += [r.fair_key for r in claimed]
        self.previous = claimed
        return len(claimed)


def late() -> int:
    truncate()
    tenants({"A": 10_000})
    stamp()
    loop = Loop()
    for _ in range(3):
        loop.step()
    tenants({"B": 10})
    stamp()
    before = len(loop.started)
    while loop.started.count("B") < 10:
        loop.step()
    after = loop.started[before:]
    return len(after) - after[::-1].index("B")


def weights() -> float:
    truncate()
    tenants({"A": 4000, "B": 4000})
    stamp("A", 3.0)
    loop = Loop()
    while len(loop.started) < 4000:
        loop.step()
    first = loop.started[:4000]
    return first.count("A") / first.count("B")


def enqueue_cost(n: int, reps: int = 7) -> tuple[float, float]:
    """Median ms of reading n new rows of tenant T as enqueue's INSERT does, without and
    with their stamps, beside tenant A's 10,000 queued runs."""
    rows = json.dumps([["default", "T", i] for i in range(n)])  # its rank in its group
    read = ("SELECT (r->>0)::varchar AS queue, (r->>1)::varchar AS fair_key, (r->>2)::int AS "
            "k FROM jsonb_array_elements(%s::jsonb) AS rows(r)")
    stamped = (f"WITH v AS MATERIALIZED ({read}), b AS MATERIALIZED (SELECT g.queue, "
               f"g.fair_key, GREATEST(COALESCE((SELECT MAX(l.fair_vstart) FROM {RUNS} l "
               f"WHERE l.queue = g.queue AND l.fair_key = g.fair_key AND l.status = 'queued'), "
               f"'-infinity') + 1.0, COALESCE((SELECT m.fair_vstart FROM {RUNS} m WHERE "
               f"m.queue = g.queue AND m.status = 'queued' AND m.available_at <= now() "
               f"ORDER BY m.priority DESC, m.fair_vstart LIMIT 1), 0)) "
               f"AS base FROM (SELECT DISTINCT queue, fair_key FROM v) g) SELECT COUNT(b.base + "
               f"v.k) FROM v JOIN b ON b.queue = v.queue AND b.fair_key = v.fair_key")
    times: dict[str, list[float]] = {"plain": [], "stamped": []}
    truncate()
    tenants({"A": 10_000})
    stamp()
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM ANALYZE {RUNS}")
        for _ in range(reps):
            for name, sql in (("plain", f"SELECT COUNT(*) FROM ({read}) v"),
                              ("stamped", stamped)):
                start = time.perf_counter()
                cursor.execute(sql, [rows])
                cursor.fetchall()
                times[name].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times["plain"]), statistics.median(times["stamped"])


def cpu() -> None:
    variants = os.environ.get("VARIANTS", "plain,stamped,fair").split(",")
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    fill = fair_cpu.fill

    def vacuumed(fair: bool, stamped: bool) -> int:
        """fair_cpu's backlog, stamped as enqueue would have (then no dead rows: every
        variant's table vacuumed alike)."""
        pid = fill(fair or stamped)
        if stamped:
            stamp()
        with connection.cursor() as cursor:
            cursor.execute(f"VACUUM ANALYZE {RUNS}")
        return int(pid)

    try:
        for rep in range(fair_cpu.REPS):
            for variant in variants[rep % len(variants):] + variants[:rep % len(variants)]:
                stamped_order(variant == "stamped")
                fair_cpu.fill = lambda fair, s=variant == "stamped": vacuumed(fair, s)  # type: ignore[misc]
                # "stamped" claims with the ordinary statement (in stamp order)
                results[variant].append(fair_cpu.drain("plain" if variant == "stamped"
                                                       else variant))
    finally:
        fair_cpu.fill = fill
        stamped_order(False)
    base = statistics.median(c + b for c, b in results[variants[0]])
    for variant, rows in results.items():
        total = statistics.median(c + b for c, b in rows)
        print(f"{variant}: client {statistics.median(c for c, _ in rows):.0f} us/run, backend "
              f"{statistics.median(b for _, b in rows):.0f} us/run, both {total:.0f} us/run "
              f"({total / base - 1:+.1%} vs {variants[0]}); each {[round(c + b) for c, b in rows]}")


def main() -> None:
    schema(True)
    try:
        if "cpu" in PARTS:
            cpu()
        if "late" in PARTS:
            stamped_order(True)
            print(f"late tenant: B's last run started in the claim that ended at start {late()} "
                  f"after its enqueue (<= 24; a claim's runs start at once)")
        if "weights" in PARTS:
            stamped_order(True)
            print(f"weights 3:1, first 4,000 starts: A/B = {weights():.3f} (2.85-3.15)")
        if "enqueue" in PARTS:
            for n in (1000, 10_000):
                plain, stamped = enqueue_cost(n)
                print(f"enqueue of {n:,} runs of one tenant: reading the rows {plain:.2f} ms, "
                      f"with their stamps {stamped:.2f} ms (+{stamped - plain:.2f} ms)")
    finally:
        stamped_order(False)
        truncate()
        schema(False)
    with open("/proc/loadavg") as load:
        print(f"N={fair_cpu.N} reps={fair_cpu.REPS}; load {load.read().strip()}")


if __name__ == "__main__":
    main()
