"""Interleaved A/B of the worker's own CPU per no-op run: two source trees, one drain each
in turn, a fresh PostgreSQL database per drain.

    BENCH_DB_PREFIX=agentruns_x python -m bench.cpu_ab A_TREE B_TREE \
        [--runs 3000] [--concurrency 1] [--reps 3] [--kind llm_sync]

Each drain is a child process importing the package from its tree (PYTHONPATH), running
`Worker(burst=True)` in process with the package logger at INFO into the void (as
`bench.profile_worker`'s pass 1, without its statement wrapper). Per drain: worker CPU per
run (user + system, all threads), the CPU of each thread role (the main claim loop, the
attempt pool, the store's writers, the keeper, the listener), runs/s, commits per run
(`pg_stat_database`, read from outside), and the load average. Prints one line a drain
and the medians; `--json` writes every drain. `--kind` drains another agent of
`bench/benchapp` (`llm_sync`, `llm_async`: the LLM-shaped runs of 1.2 s) and adds its
share of the possible rate, first start to last finish as the database stamped them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def _role(name: str) -> str:
    return re.sub(r"[-_]?\d+(_\d+)?$", "", name)


def child(concurrency: int, out: Path) -> int:
    """One drain in this process: DATABASE_URL names the database, PYTHONPATH the tree."""
    import gc
    import resource
    import threading
    import time
    from collections import Counter

    import django

    django.setup()
    import logging

    logging.getLogger("django_agentruns").setLevel(logging.INFO)
    sink = open(os.devnull, "w")  # noqa: SIM115
    logging.getLogger().handlers = [logging.StreamHandler(sink)]
    per_role: Counter[str] = Counter()
    counted: set[int | None] = set()
    lock = threading.Lock()
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        try:
            original(self)
        finally:
            with lock:
                if self.ident not in counted:
                    counted.add(self.ident)
                    per_role[_role(self.name)] += time.thread_time()

    threading.Thread.run = run  # type: ignore[method-assign]
    gc_time: Counter[int] = Counter()
    gc_count: Counter[int] = Counter()
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.thread_time()
        else:
            gc_time[info["generation"]] += time.thread_time() - gc_started[0]
            gc_count[info["generation"]] += 1

    from django_agentruns.runtime.worker import Worker

    worker = Worker(["default"], concurrency, burst=True)
    main_start = time.thread_time()
    before = resource.getrusage(resource.RUSAGE_SELF)
    gc.callbacks.append(on_gc)
    start = time.perf_counter()
    stats = worker.run(install_signals=False)
    wall = time.perf_counter() - start
    gc.callbacks.remove(on_gc)
    after = resource.getrusage(resource.RUSAGE_SELF)
    per_role["main"] += time.thread_time() - main_start
    with lock:  # threads still alive (the pool's, shut down without waiting)
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and thread.ident not in counted \
                    and thread.ident is not None:
                counted.add(thread.ident)
                with contextlib.suppress(OSError, ProcessLookupError):
                    clock = time.pthread_getcpuclockid(thread.ident)
                    per_role[_role(thread.name)] += time.clock_gettime(clock)
    out.write_text(json.dumps({
        "runs": sum(stats.settled.values()), "wall": wall,
        "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "system": after.ru_stime - before.ru_stime, "roles": dict(per_role),
        "gc": {str(g): [gc_count[g], gc_time[g]] for g in sorted(gc_count)},
        "package": __import__("django_agentruns").__file__,
    }))
    return 0


def drain(admin: Any, name: str, tree: Path, runs: int, concurrency: int,
          tmp: Path, kind: str = "noop") -> dict[str, Any]:
    from bench.pg import django_env
    from bench.profile_worker import prefill

    url = admin.fresh(name)
    prefill(url, runs, kind)
    admin.wait_idle(name)
    before = admin.stats(name)
    out = tmp / "drain.json"
    env = django_env(url)
    env["PYTHONPATH"] = str(tree)
    subprocess.run([sys.executable, str(HERE), "--child", "--concurrency", str(concurrency),
                    "--out", str(out)], env=env, cwd=tree, check=True)
    admin.wait_idle(name)
    after = admin.stats(name)
    data = json.loads(out.read_text())
    assert data["package"].startswith(str(tree)), data["package"]
    n = data["runs"]
    of_possible = None
    if kind.startswith("llm"):
        import psycopg

        from bench.llm import RUN_SECONDS, SPAN_SQL

        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(SPAN_SQL["ours"]).fetchone()
        of_possible = n * RUN_SECONDS / concurrency / float(row[0]) if row and row[0] else None
    return {"of_possible": of_possible, "tree": str(tree), "runs": n,
            "cpu_ms": 1000 * data["cpu"] / n,
            "sys_ms": 1000 * data["system"] / n, "runs_per_s": n / data["wall"],
            "commits": (after.commits - before.commits) / n,
            "roles_ms": {k: round(1000 * v / n, 3) for k, v in sorted(data["roles"].items())},
            "gc_ms": round(1000 * sum(t for _, t in data["gc"].values()) / n, 3),
            "gc": data["gc"],
            "load": Path("/proc/loadavg").read_text().split()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("trees", nargs="*", type=Path)
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kind", default="noop", help="the bench agent drained")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.concurrency, args.out)
    from bench.pg import PREFIX, Admin

    trees = [t.resolve() for t in args.trees]
    if len(trees) != 2:
        parser.error("two trees: A and B")
    name = f"{PREFIX}_cpu"
    admin = Admin()
    admin.make_template()
    results: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.reps):
                order = (0, 1) if rep % 2 == 0 else (1, 0)
                for side in order:
                    r = drain(admin, name, trees[side], args.runs, args.concurrency, Path(tmp),
                              args.kind)
                    r["side"] = "AB"[side]
                    results.append(r)
                    possible = "" if r["of_possible"] is None else \
                        f" {r['of_possible']:.3f} of possible"
                    print(f"{r['side']} cpu/run {r['cpu_ms']:.3f} ms (sys {r['sys_ms']:.3f})"
                          f"{possible}"
                          f" {r['runs_per_s']:.0f} runs/s commits/run {r['commits']:.2f}"
                          f" load {r['load']} gc {r['gc_ms']:.3f} ms {r['gc']}"
                          f" roles {r['roles_ms']}", flush=True)
    finally:
        admin.drop(name)
        admin.drop(f"{PREFIX}_tpl")
        admin.close()
    for side in "AB":
        mine = [r for r in results if r["side"] == side]
        print(f"{side}: cpu/run median {statistics.median(r['cpu_ms'] for r in mine):.3f} "
              f"(min {min(r['cpu_ms'] for r in mine):.3f}) ms, runs/s median "
              f"{statistics.median(r['runs_per_s'] for r in mine):.0f}, commits/run "
              f"{statistics.median(r['commits'] for r in mine):.2f}"
              + (f", of possible median "
                 f"{statistics.median(r['of_possible'] for r in mine):.3f}"
                 if mine[0]["of_possible"] is not None else ""))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    if "--child" in sys.argv:
        sys.path.pop(0)  # this file's folder: the tree's package comes from PYTHONPATH
    raise SystemExit(main())
