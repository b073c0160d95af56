"""The cost of a durable step, small and quick: the LLM-shaped async agent with its three
calls as steps (`llm_steps_async`) beside the same with plain calls (`llm_async`), drained
in this process by one burst worker, trials interleaved, PostgreSQL.

    DATABASE_URL=postgres://.../NAME python -m bench.step_probe [--runs 2000]
        [--concurrency 1000] [--reps 3] [--call 0.4] [--profile steps|plain]

Prints per trial the worker process's CPU per run (all threads) and runs/s, and the
medians' ratios: at concurrency 1,000 one process is CPU-bound, so CPU per run is what a
step costs, whatever else loads the machine (state `/proc/loadavg` beside runs/s).
`--profile` writes a cProfile of one more trial of that variant to `.tmp/step_probe.pstats`.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import resource
import statistics
import time
from pathlib import Path

KINDS = {"plain": "llm_async", "steps": "llm_steps_async"}
EXTRA = {"emits6": "probe_emits6"}
"""Variants for a closer look (`--extra`): the plain agent with an emit in place of each
step's end (six writes a run, as the steps agent makes)."""


def setup() -> None:
    """Django with the benchmark's settings, our app alone (the peers' packages need not be
    installed), and the benchmark's agents."""
    import django
    from django.conf import settings

    from bench import settings as bench_settings

    values = {k: getattr(bench_settings, k) for k in dir(bench_settings) if k.isupper()}
    values["INSTALLED_APPS"] = ["django.contrib.contenttypes", "django.contrib.auth",
                                "django_agentruns"]
    values.pop("TASKS", None)
    settings.configure(**values)
    django.setup()
    import asyncio

    from bench.benchapp import agents
    from django_agentruns import RunContext, agent

    @agent("bench.probe_emits6")
    async def probe_emits6(ctx: RunContext) -> None:
        for step in range(3):
            await asyncio.sleep(agents.LLM_CALL)
            await ctx.aemit("model", {"tokens": 256})
            await ctx.aemit("llm.step", {"step": step, "tokens": 256})


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def trial(kind: str, runs: int, concurrency: int,
          profile: cProfile.Profile | None = None) -> tuple[float, float]:
    """Queue `runs` of `kind`, drain them; (CPU ms per run, runs/s)."""
    from django.db import connection

    from django_agentruns import RunRequest, enqueue_many
    from django_agentruns.runtime.worker import Worker

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE django_agentruns_agentrun CASCADE")
    for done in range(0, runs, 500):
        enqueue_many([RunRequest(f"bench.{kind}")] * min(500, runs - done))
    connection.close()
    worker = Worker(["default"], concurrency, burst=True)
    cpu, start = _cpu(), time.perf_counter()
    if profile is not None:
        profile.enable()
    stats = worker.run(install_signals=False)
    if profile is not None:
        profile.disable()
    wall, cpu = time.perf_counter() - start, _cpu() - cpu
    done = sum(stats.settled.values())
    assert done == runs, (kind, stats.settled)
    return 1000 * cpu / done, done / wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--call", type=float, default=0.4, help="seconds of one model call")
    parser.add_argument("--profile", choices=sorted(KINDS))
    parser.add_argument("--only", choices=sorted(KINDS))
    parser.add_argument("--extra", action="store_true", help="the variants of EXTRA too")
    args = parser.parse_args()
    import logging

    setup()
    logging.getLogger("django_agentruns").setLevel(logging.INFO)
    logging.getLogger().handlers = [logging.StreamHandler(open(os.devnull, "w"))]  # noqa: SIM115
    from bench.benchapp import agents

    agents.LLM_CALL = args.call
    trial(KINDS["plain"], min(args.runs, 200), args.concurrency)  # warm up
    kinds = {**KINDS, **(EXTRA if args.extra else {})}
    seen: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for rep in range(args.reps):
        order = list(kinds)[rep % 2:] + list(kinds)[:rep % 2]
        for variant in order:
            if args.only and variant != args.only:
                continue
            cpu, rate = trial(kinds[variant], args.runs, args.concurrency)
            seen[variant].append((cpu, rate))
            print(f"rep {rep + 1} {variant:<5} CPU {cpu:5.2f} ms/run  {rate:6.1f} runs/s  "
                  f"load {Path('/proc/loadavg').read_text().split()[0]}", flush=True)
    for variant in EXTRA if args.extra else ():
        print(f"median {variant}: CPU ms/run {statistics.median(c for c, _ in seen[variant]):.2f}"
              f" runs/s {statistics.median(r for _, r in seen[variant]):.1f}")
    if not args.only:
        cpu = {k: statistics.median(c for c, _ in v) for k, v in seen.items()}
        rate = {k: statistics.median(r for _, r in v) for k, v in seen.items()}
        print(f"medians: CPU ms/run plain {cpu['plain']:.2f} steps {cpu['steps']:.2f} "
              f"(a step: {(cpu['steps'] - cpu['plain']) / 3:.3f} ms); CPU ratio "
              f"{cpu['plain'] / cpu['steps']:.2f}; runs/s ratio "
              f"{rate['steps'] / rate['plain']:.2f}")
    if args.profile:
        prof = cProfile.Profile()
        trial(KINDS[args.profile], args.runs, args.concurrency, prof)
        Path(".tmp").mkdir(exist_ok=True)
        prof.dump_stats(".tmp/step_probe.pstats")


if __name__ == "__main__":
    main()
