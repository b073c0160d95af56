"""Issue #29's narrow row, measured: a no-op drain's worker CPU per run and rate, and
enqueue's rate, each with the default input ({}) and with a small one, for this checkout.
Run it from two checkouts in turn (main's and a branch's), with distinct database
prefixes, and compare medians.

    BENCH_DB_PREFIX=agentruns_bench_x python -m bench.narrow_io [--runs 3000] [--concurrency 16]

Prints one JSON line (with the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.pg import REPO_ROOT, Admin, django_env

DB_NAME_SUFFIX = "_nio"
INPUT = {"question": "What is the refund policy for order 12345?", "user": "u-42", "lang": "en"}


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def child_fill(runs: int, with_input: bool) -> None:
    import django

    django.setup()
    from django_agentruns import RunRequest, enqueue_many

    for done in range(0, runs, 1000):
        enqueue_many([RunRequest("bench.noop", {**INPUT, "n": done + i} if with_input else None)
                      for i in range(min(1000, runs - done))])


def child_enqueue(count: int, out: Path) -> None:
    import django

    django.setup()
    from django_agentruns import RunRequest, enqueue, enqueue_many

    result: dict[str, float] = {}
    for name, payload in (("empty", None), ("input", INPUT)):
        enqueue("bench.noop", payload)  # warm up
        cpu, start = time.process_time(), time.perf_counter()
        for _ in range(count):
            enqueue("bench.noop", payload)
        result[f"one_{name}_per_s"] = count / (time.perf_counter() - start)
        result[f"one_{name}_cpu_us"] = 1e6 * (time.process_time() - cpu) / count
    start = time.perf_counter()
    for _ in range(10):
        enqueue_many([RunRequest("bench.noop", INPUT)] * 500)
    result["bulk_input_per_s"] = 5000 / (time.perf_counter() - start)
    out.write_text(json.dumps(result))


def drain(admin: Admin, name: str, runs: int, concurrency: int, with_input: bool,
          tmp: Path) -> dict[str, float]:
    import psycopg

    url = admin.fresh(name)
    subprocess.run([sys.executable, "-m", "bench.narrow_io", "--child-fill", str(runs),
                    *(["--with-input"] if with_input else [])],
                   env=django_env(url), cwd=REPO_ROOT, check=True)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE")
    admin.wait_idle(name)
    out = tmp / "drain.json"
    subprocess.run([sys.executable, "-m", "bench.profile_worker", "--child", "plain",
                    "--concurrency", str(concurrency), "--out", str(out)],
                   env=django_env(url), cwd=REPO_ROOT, check=True)
    data = json.loads(out.read_text())
    return {"cpu_ms_per_run": 1000 * data["cpu"] / data["runs"],
            "runs_per_s": data["runs"] / data["wall"], "runs": data["runs"]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--enqueues", type=int, default=1500)
    parser.add_argument("--child-fill", type=int)
    parser.add_argument("--with-input", action="store_true")
    parser.add_argument("--child-enqueue", type=Path)
    args = parser.parse_args()
    if args.child_fill:
        child_fill(args.child_fill, args.with_input)
        return 0
    if args.child_enqueue:
        child_enqueue(args.enqueues, args.child_enqueue)
        return 0
    from bench.pg import PREFIX

    name = PREFIX + DB_NAME_SUFFIX
    admin = Admin()
    result: dict[str, Any] = {"load_before": loadavg()}
    try:
        admin.make_template()
        with tempfile.TemporaryDirectory() as tmp:
            for with_input in (False, True):
                key = "drain_input" if with_input else "drain_empty"
                result[key] = drain(admin, name, args.runs, args.concurrency, with_input,
                                    Path(tmp))
            url = admin.fresh(name)
            out = Path(tmp) / "enqueue.json"
            subprocess.run([sys.executable, "-m", "bench.narrow_io", "--enqueues",
                            str(args.enqueues), "--child-enqueue", str(out)],
                           env=django_env(url), cwd=REPO_ROOT, check=True)
            result["enqueue"] = json.loads(out.read_text())
    finally:
        admin.drop(name)
        from bench.pg import TEMPLATE

        admin.drop(TEMPLATE)
        admin.close()
    result["load_after"] = loadavg()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
