"""Enqueue's cost in checkouts side by side, taking turns: client and server CPU per run.

On a shared, noisy machine separate runs drift with the load by more than the differences
sought (issue 29's 5 %). Here one child process per checkout, each on a fresh database
of its own (copied from that checkout's migrated template), waits for its turn; the
parent hands out short blocks in shuffled order, round after round, so every checkout
sees the same load. Each block reports the client's thread CPU, the CPU of its
connection's server process (`/proc/<backend pid>/schedstat`, same machine) and the wall
time; medians over the rounds are printed per mode.

    python -m bench.enqueue_ab [--rounds 20] new=/path/a:prefix_a old=/path/b:prefix_b ...

Modes: `enqueue` one by one with the default input and with a small one (100 a block),
`enqueue_many` of 500 with inputs (2 a block). BENCH_PREPARED=0 measures without
prepared statements (the package's default).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

INPUT = {"question": "What is the refund policy for order 12345?", "user": "u-42", "lang": "en"}
MODES = (("one_empty", 100, 1), ("one_input", 100, 1), ("bulk_input", 2, 500))


def child() -> None:
    """Run the blocks the parent asks for ("mode count" lines); answer with the CPU."""
    here = Path(__file__).resolve().parent  # run by path: bench/ must not shadow anything
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import django

    django.setup()
    from django.db import connection

    import django_agentruns
    from django_agentruns import RunRequest, enqueue, enqueue_many

    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        stat = Path(f"/proc/{cursor.fetchone()[0]}/schedstat")

    def server() -> float:
        return int(stat.read_text().split()[0]) / 1e9

    calls: dict[str, Any] = {
        "one_empty": lambda: enqueue("bench.noop", None),
        "one_input": lambda: enqueue("bench.noop", INPUT),
        "bulk_input": lambda: enqueue_many([RunRequest("bench.noop", INPUT)] * 500),
    }
    for call in calls.values():
        call()  # warm up: statements prepared, caches filled
    print("ready", django_agentruns.__file__, flush=True)
    for line in sys.stdin:
        mode, count = line.split()
        call = calls[mode]
        cpu, srv, wall = time.thread_time(), server(), time.perf_counter()
        for _ in range(int(count)):
            call()
        print(json.dumps([time.thread_time() - cpu, server() - srv,
                          time.perf_counter() - wall]), flush=True)


def start(name: str, checkout: str, prefix: str) -> subprocess.Popen[str]:
    """A child for `checkout` on a fresh database (its template made once per prefix)."""
    env = {**os.environ, "BENCH_DB_PREFIX": prefix}
    make = ("import os\nfrom bench.pg import Admin, PREFIX, TEMPLATE\na = Admin()\n"
            "if os.environ.get('REMAKE') or not a.value(\"SELECT 1 FROM pg_database WHERE "
            "datname = '\" + TEMPLATE + \"'\"):\n    a.make_template()\n"
            "print(a.fresh(PREFIX + '_ab'))\n")
    url = subprocess.run([sys.executable, "-c", make], env={**env, "PYTHONPATH": checkout},
                         cwd=checkout, capture_output=True, text=True,
                         check=True).stdout.split()[-1]
    env.update(DATABASE_URL=url, DJANGO_SETTINGS_MODULE="bench.settings", PYTHONPATH=checkout,
               PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child"],
                            env=env, cwd=checkout, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready = proc.stdout.readline().split()
    assert ready[0] == "ready", (name, ready)
    assert ready[1].startswith(checkout), (name, ready)
    return proc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("checkouts", nargs="*", help="name=/path/to/checkout:db_prefix")
    args = parser.parse_args()
    if args.child:
        child()
        return 0
    procs = {}
    for spec in args.checkouts:
        name, rest = spec.split("=", 1)
        checkout, prefix = rest.rsplit(":", 1)
        procs[name] = start(name, checkout, prefix)
    per_run: dict[tuple[str, str], list[tuple[float, float, float]]] = {
        (name, mode): [] for name in procs for mode, _, _ in MODES}
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    for _ in range(args.rounds):
        order = list(procs)
        random.shuffle(order)
        for mode, count, runs in MODES:
            for name in order:
                stdin, stdout = procs[name].stdin, procs[name].stdout
                assert stdin is not None
                assert stdout is not None
                stdin.write(f"{mode} {count}\n")
                stdin.flush()
                cpu, srv, wall = json.loads(stdout.readline())
                n = count * runs
                per_run[(name, mode)].append((1e6 * cpu / n, 1e6 * srv / n, 1e6 * wall / n))
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    result: dict[str, Any] = {"load_before": load_before, "rounds": args.rounds,
                              "load_after": Path("/proc/loadavg").read_text().split()[:3]}
    for (name, mode), xs in per_run.items():
        result.setdefault(mode, {})[name] = {
            "client_us": round(statistics.median(x[0] for x in xs), 1),
            "server_us": round(statistics.median(x[1] for x in xs), 1),
            "cpu_us": round(statistics.median(x[0] + x[1] for x in xs), 1),
            "runs_per_s": round(1e6 / statistics.median(x[2] for x in xs))}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
