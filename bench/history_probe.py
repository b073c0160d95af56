"""Enqueue and claim latency, one call at a time, in the database of `DATABASE_URL`: the
history bench (bench/history.py) runs it after each fill step. Prints one JSON line."""

from __future__ import annotations

import json
import statistics
import sys
import time

import django


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]


def main(calls: int) -> dict[str, float]:
    django.setup()
    from django_agentruns import enqueue, transitions
    from django_agentruns.registry import scope_policy

    for _ in range(20):  # warm the connection and the plans
        enqueue("bench.noop", queue="history-probe-warm")
    enq, claim = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        enqueue("bench.noop", queue="history-probe")
        enq.append((time.perf_counter() - t0) * 1000)
    for _ in range(calls):
        t0 = time.perf_counter()
        taken = transitions.claim("probe", ["history-probe"], 1, scope_policy(), {}, 60.0)
        claim.append((time.perf_counter() - t0) * 1000)
        assert len(taken) == 1
    # Finished, as a real worker would leave them: the next probe starts from no backlog.
    from django.utils import timezone

    from django_agentruns.models import AgentRun
    AgentRun.objects.filter(queue__startswith="history-probe").update(
        status="succeeded", reason="completed", finished_at=timezone.now(), claimed_by="")
    return {"enqueue_p50_ms": statistics.median(enq), "enqueue_p99_ms": percentile(enq, 0.99),
            "claim_p50_ms": statistics.median(claim), "claim_p99_ms": percentile(claim, 0.99)}


def drop() -> tuple[float, int]:
    """Seconds and WAL bytes (server-wide: other sessions' too) of `partitions.drop()`."""
    django.setup()
    from django.db import connection

    from django_agentruns.ops import partitions

    lsn = "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn"
    with connection.cursor() as cursor:
        cursor.execute(lsn)
        wal0, t0 = int(cursor.fetchone()[0]), time.perf_counter()
        dropped = partitions.drop().dropped
        took = time.perf_counter() - t0
        cursor.execute(lsn)
        wal = int(cursor.fetchone()[0]) - wal0
    assert dropped, "nothing dropped"
    return took, wal


if __name__ == "__main__":
    if sys.argv[1:2] == ["drop"]:
        print(json.dumps(drop()))
    else:
        print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)))
