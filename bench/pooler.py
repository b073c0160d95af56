"""The latency rows through PgBouncer: ours behind a transaction pooler, LISTEN direct.

    python -m bench.pooler [--seconds 10] [--rate 20]    # these rows alone, printed

A trial is `plan.latency` (one idle worker, an open-loop producer) on a fresh database,
with a private PgBouncer (tests/pgbouncer.py: Debian's pgbouncer, transaction mode, its
own port and config; never the system service) in front of the server: the worker and
the producer connect through it, the worker's listener directly (`LISTEN_DATABASE`).
PREPARED_STATEMENTS is off there: PgBouncer before 1.21 has no prepared statements in
transaction mode. `--degraded` adds the same trial without LISTEN_DATABASE, where every
wake-up is lost and a run waits for the worker's next poll.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

from bench.engines import OURS, Engine
from bench.harness import RUN_DB, PgTarget, log, run_trial
from bench.pg import SERVER_URL, TEMPLATE, Admin, db_url
from bench.plan import FULL, Plan, latency
from tests.pgbouncer import PgBouncer, binary

POOLED = "BENCH_LISTEN_URL"
"""The direct URL of the listener (bench/settings.py makes it the `listen` alias)."""

OURS_PGBOUNCER = Engine("ours", "django-agentruns through PgBouncer", OURS.table,
                        OURS.pending, concurrent=True,
                        env=((POOLED, db_url(RUN_DB)), ("BENCH_PREPARED", "0")))
OURS_PGBOUNCER_DEGRADED = replace(OURS_PGBOUNCER, env=(("BENCH_PREPARED", "0"),))


def available() -> bool:
    return binary() is not None


def pooled_latency(target: PgTarget, plan: Plan, logs: Path,
                   engine: Engine = OURS_PGBOUNCER) -> dict[str, float]:
    """`plan.latency` on `target` (a trial's fresh database) reached through a new PgBouncer."""
    server = urlsplit(SERVER_URL)
    with PgBouncer(server.hostname or "127.0.0.1", server.port or 5432) as bouncer:
        direct = target.url
        target.url = bouncer.route(direct)
        try:
            return latency(target, engine, plan.latency_rate, plan.latency_seconds,
                           plan.worker_warmup, logs)
        finally:
            target.url = direct
            bouncer.kill_database(RUN_DB)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=FULL.latency_seconds)
    parser.add_argument("--rate", type=float, default=FULL.latency_rate)
    parser.add_argument("--degraded", action="store_true",
                        help="also measure through PgBouncer without LISTEN_DATABASE")
    args = parser.parse_args(argv)
    if not available():
        log("bench.pooler: pgbouncer is not installed (apt-get install -y pgbouncer)")
        return 1
    plan = replace(FULL, latency_seconds=args.seconds, latency_rate=args.rate)
    admin = Admin()
    rows: list[tuple[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="agentruns-bench-") as tmp:
        logs = Path(tmp)
        try:
            admin.make_template()
            rows.append(("direct", run_trial(admin, "latency ours", latency, OURS,
                                             plan.latency_rate, plan.latency_seconds,
                                             plan.worker_warmup, logs)))
            rows.append(("PgBouncer (transaction), LISTEN_DATABASE direct",
                         run_trial(admin, "latency via PgBouncer", pooled_latency, plan, logs)))
            if args.degraded:
                rows.append(("PgBouncer (transaction), no LISTEN_DATABASE",
                             run_trial(admin, "latency via PgBouncer, degraded",
                                       pooled_latency, plan, logs, OURS_PGBOUNCER_DEGRADED)))
        finally:
            admin.drop(RUN_DB)
            admin.drop(TEMPLATE)
            admin.close()
    print(f"| enqueue→start latency, idle worker, {plan.latency_rate:g}/s for "
          f"{plan.latency_seconds:g} s | p50 (ms) | p95 (ms) | p99 (ms) | samples |")
    print("|---|---:|---:|---:|---:|")
    for label, r in rows:
        print(f"| {label} | {r['p50']:.1f} | {r['p95']:.1f} | {r['p99']:.1f} | {r['n']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
