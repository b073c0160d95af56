"""Enqueue and claim latency, one call at a time, in the database of `DATABASE_URL`: the
history bench (bench/history.py) runs two of these, one on the filled database and one on
an empty one, and has them take turns by blocks of calls, so that both see the same load.

Serves lines on stdin: `enqueue N` and `claim N` make N calls and answer a JSON list of
their latencies (ms); `finish` marks the probe's runs finished, as a worker would leave
them (the next probe starts from no backlog), answers `ok` and exits."""

from __future__ import annotations

import json
import sys
import time

import django


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]


def serve() -> None:
    django.setup()
    from django.utils import timezone

    from django_agentruns import enqueue, transitions
    from django_agentruns.models import AgentRun
    from django_agentruns.registry import scope_policy

    def one_enqueue() -> None:
        enqueue("bench.noop", queue="history-probe")

    def one_claim() -> None:
        taken = transitions.claim("probe", ["history-probe"], 1, scope_policy(), {}, 60.0)
        assert len(taken) == 1

    for _ in range(20):  # warm the connection and the plans
        enqueue("bench.noop", queue="history-probe-warm")
    calls = {"enqueue": one_enqueue, "claim": one_claim}
    for line in sys.stdin:
        what, _, count = line.strip().partition(" ")
        if what == "finish":
            AgentRun.objects.filter(queue__startswith="history-probe").update(
                status="succeeded", reason="completed", finished_at=timezone.now(),
                claimed_by="")
            print("ok", flush=True)
            return
        took = []
        for _ in range(int(count)):
            t0 = time.perf_counter()
            calls[what]()
            took.append((time.perf_counter() - t0) * 1000)
        print(json.dumps(took), flush=True)


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
        serve()
