"""Run many multi-step runs through real worker processes while breaking things.

`Chaos.run()` enqueues a planned mix of runs, starts `runworker` subprocesses and then,
until every run has settled (or the chaos phase is over):

- SIGKILLs a random worker about once a second and starts a new one;
- freezes a random worker (SIGSTOP) for longer than a lease, then thaws it (SIGCONT), so
  its attempts wake up after another worker took their runs over;
- runs ``manage.py reap`` in a loop, as cron would;
- SIGTERMs one busy worker (graceful stop) and expects it to exit 0;
- once, ends every session of the test database ("terminate", the default), closing this
  process's own connections around it and waiting until the server answers again; or, in
  "cluster" mode, restarts a private PostgreSQL server the test started for itself
  (`tests.chaos.private`; the machine's server is never restarted); or, in "pgbouncer"
  mode, restarts the PgBouncer the workers connect through (`tests.pgbouncer`);
- cancels a few runs, queued, running or waiting;
- runs a deliverer process (`manage.py chaos_deliver`) that sends the waiting runs
  (`tests.chaos_waits`) their payloads at random times, before, during or after their wait;
- enqueues more runs as it goes.

Then it kills what is left, drains the backlog with fresh workers, stops them with SIGTERM
(exit 0 expected), and checks the database with `invariants.check_all`.

The worker processes and the signals they get are `tests.chaos.workers`'s.

The database must be a test database the caller owns (pytest's, or the one
``python -m tests.chaos`` creates): the harness writes to it from many processes.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections.abc import Callable

from django.db import connection, connections

from django_agentruns import RunRequest, cancel, enqueue_many, set_limit
from django_agentruns.models import TERMINAL, AgentRun, RunEvent
from django_agentruns.registry import get_agent
from tests import helpers
from tests.chaos.invariants import PlannedRun, check_all
from tests.chaos.plan import CHAOS_LIMITS, ChaosConfig, ChaosReport, make_plan
from tests.chaos.support import (
    KeySampler,
    _connection_params,
    _outcomes,
    guarded,
    wait_for_postgres,
)
from tests.chaos.workers import ChaosWorkers
from tests.pgbouncer import PgBouncer
from tests.private_postgres import PrivateServer
from tests.testapp.chaos_agents import (
    CHAOS,
    CHAOS_ASYNC,
    CHAOS_ORDERED,
    CHAOS_SLOW,
    CHAOS_WAITS,
)

# Summary lines of every chaos run in this process, for pytest's terminal summary.
SUMMARIES: list[str] = []


class Chaos(ChaosWorkers):
    def __init__(self, config: ChaosConfig, env: dict[str, str],
                 log: Callable[[str], None] | None = None,
                 bouncer: PgBouncer | None = None,
                 server: PrivateServer | None = None) -> None:
        if (config.pg_restart == "pgbouncer") != (bouncer is not None):
            raise ValueError("pg_restart='pgbouncer' goes with a bouncer, and only it")
        if config.pg_restart == "cluster" and server is None:
            raise ValueError("pg_restart='cluster' restarts a private server only, never the "
                             "machine's: pass the PrivateServer the chaos runs on")
        self.config = config
        self.bouncer = bouncer
        self.server = server
        self.rng = random.Random(config.seed)
        self.env = {**env, "AGENTRUNS_TEST_SETTINGS": json.dumps(config.worker_settings())}
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.report = ChaosReport()
        self.plan: dict[int, PlannedRun] = {}
        self.pending: list[PlannedRun] = []  # the trickle, enqueued during the chaos
        self.slow: list[PlannedRun] = []  # enqueued one by one during the chaos
        self.cancels: dict[int, str] = {}
        self.workers: list[helpers.ManageProcess] = []
        # Frozen workers and the timers that thaw them: a timer, not this loop, since this
        # loop may itself wait on a lock the frozen worker holds (SQLite's write lock).
        self.frozen: dict[helpers.ManageProcess, threading.Timer] = {}
        self.stopping: list[helpers.ManageProcess] = []  # SIGTERMed, must exit 0
        self.reaper: helpers.ManageProcess | None = None
        self.deliverer: helpers.ManageProcess | None = None
        self.next_reap = 0.0
        self.logs: list[str] = []
        # pid -> until when (monotonic) SIGKILL spares it: a worker running a slow attempt 1,
        # so that attempt lives to be taken over and then tries to write (see chaos_agents).
        self.spared: dict[int, float] = {}

    # ------------------------------------------------------------------ the whole run

    def run(self) -> ChaosReport:
        started = time.monotonic()
        planned = make_plan(self.config.runs, self.rng)
        ordered = [p for p in planned if p.kind == "ordered"]
        slow = [p for p in planned if p.kind == "slow"]
        rest = [p for p in planned if p.kind not in ("ordered", "slow")]
        self.rng.shuffle(rest)
        n_trickle = int(len(rest) * self.config.trickle)
        self.pending = rest[:n_trickle]
        # One slow run every couple of seconds: a slow attempt holds a worker's slot until
        # it is taken over, and the takeover needs a free slot somewhere.
        self.slow = slow
        for key, limit in CHAOS_LIMITS.items():
            set_limit(key, limit)
        self._enqueue(ordered + rest[n_trickle:])
        sampler = KeySampler(CHAOS_LIMITS)
        sampler.start()
        try:
            self._chaos_phase()
            self._drain()
        finally:
            sampler.stop()
            self._cleanup()
        self.report.problems += sampler.violations
        self.report.harness_checks += sampler.samples
        self.report.key_peaks = sampler.peaks
        self.report.seconds = time.monotonic() - started
        self.report.runs = len(self.plan)
        self.report.checker = check_all(
            self.plan, self.cancels, self._lease_ttls(), log_text=self.logs,
            timeouts={name: get_agent(name).timeout for name in self._lease_ttls()})
        self.report.statuses = _outcomes()
        self.report.abandoned = RunEvent.objects.filter(type="run.abandoned").count()
        self.report.waited = RunEvent.objects.filter(type="run.waiting").count()
        self.report.fenced = sum(text.count("nothing recorded") for text in self.logs)
        SUMMARIES.extend([self.report.summary(), self.report.details()])
        return self.report

    def _lease_ttls(self) -> dict[str, float]:
        return {name: float(get_agent(name).lease_ttl or self.config.lease_ttl)
                for name in (CHAOS, CHAOS_ORDERED, CHAOS_SLOW, CHAOS_ASYNC, CHAOS_WAITS)}

    def _enqueue(self, runs: list[PlannedRun]) -> None:
        created = enqueue_many([RunRequest(p.agent, p.input, scope=p.scope, priority=p.priority,
                                           fired_seq=p.fired_seq) for p in runs])
        for run, planned in zip(created, runs, strict=True):
            self.plan[run.pk] = planned

    def _enqueue_slow(self) -> None:
        self._enqueue(self.slow[:1])
        del self.slow[:1]

    def _enqueue_next(self, size: int = 20) -> None:
        """Enqueue the next few runs of the trickle (kept for later if the database is away)."""
        self._enqueue(self.pending[:size])
        del self.pending[:size]

    # ------------------------------------------------------------------ chaos phase

    def _chaos_phase(self) -> None:
        cfg = self.config
        self.deliverer = helpers.start_manage(["chaos_deliver"], self.env)
        for _ in range(cfg.workers):
            self._start_worker()
        begin = time.monotonic()
        next_kill = begin + self._interval(cfg.kill_every)
        next_freeze = begin + self._interval(cfg.freeze_every) if cfg.freeze_every else None
        next_cancel = begin + self._interval(cfg.cancel_every) if cfg.cancel_every else None
        next_trickle = begin + 1.0
        next_slow = begin + 1.0
        restart_due = connection.vendor == "postgresql" and cfg.pg_restart != "none"
        sigterm_due = cfg.sigterm
        progress = 0.0
        next_progress = begin
        while True:
            now = time.monotonic()
            if now >= next_progress:
                progress = guarded(self._progress, progress)
                guarded(self._spare_slow, None)
                next_progress = now + 0.5
            if (progress >= 1.0 and not self.pending and not self.slow) \
                    or now - begin > cfg.chaos_seconds:
                break
            self._collect_stopped()
            self._reap_loop(now)
            if now >= next_kill:
                self._kill_one()
                next_kill = now + self._interval(cfg.kill_every)
            if next_freeze is not None and now >= next_freeze:
                self._freeze_one()
                next_freeze = now + self._interval(cfg.freeze_every)
            if next_cancel is not None and now >= next_cancel:
                guarded(self._cancel_one, None)
                next_cancel = now + self._interval(cfg.cancel_every)
            if self.pending and now >= next_trickle:
                guarded(self._enqueue_next, None)
                next_trickle = now + 0.5
            if self.slow and now >= next_slow:
                guarded(self._enqueue_slow, None)
                next_slow = now + 2.0
            # A loaded machine may settle slowly: SIGTERM once a fifth has settled or
            # 0.4 of the phase has passed, whichever comes first (as the restart).
            if sigterm_due and (progress >= 0.2 or now - begin > cfg.chaos_seconds * 0.4) \
                    and self._sigterm_busy():
                sigterm_due = False
            if restart_due and (progress >= 0.4 or now - begin > cfg.chaos_seconds * 0.4):
                self._restart_postgres()
                restart_due = False
            time.sleep(0.05)
        self.log(f"chaos phase over after {time.monotonic() - begin:.0f}s, "
                 f"{progress:.0%} settled")
        self.report.harness_checks += 2
        if restart_due:
            self.report.problems.append("the PostgreSQL restart never happened")
        if sigterm_due:
            self.report.problems.append("no worker was busy to SIGTERM")

    def _interval(self, mean: float) -> float:
        return self.rng.uniform(0.5 * mean, 1.5 * mean)

    def _progress(self) -> float:
        if not self.plan:
            return 0.0
        done = AgentRun.objects.filter(status__in=TERMINAL).count()
        return done / len(self.plan)

    # ------------------------------------------------------------------ other faults

    def _reap_loop(self, now: float) -> None:
        """`manage.py reap` one after another, a second apart, as a cron job would."""
        if self.reaper is not None and self.reaper.returncode is not None:
            self.report.reaps += 1
            if self.reaper.returncode != 0:
                self.report.reap_failures += 1  # the database was away: cron tries again
            self.reaper.close()
            self.reaper = None
            self.next_reap = now + 1.0
        if self.reaper is None and now >= self.next_reap:
            self.reaper = helpers.start_manage(["reap"], self.env)

    def _cancel_one(self) -> None:
        live = list(AgentRun.objects.exclude(
            status__in=TERMINAL).exclude(pk__in=list(self.cancels)).values_list("pk",
                                                                                  flat=True))
        if live:
            run_id = self.rng.choice(live)
            self.cancels[run_id] = cancel(run_id, reason="chaos").value
            self.report.cancels += 1

    def _restart_postgres(self) -> None:
        """Restart the server (or, in "terminate" mode, end every session on this database)."""
        self.log(f"restarting {'PgBouncer' if self.bouncer else 'PostgreSQL'} "
                 f"({self.config.pg_restart})")
        if self.bouncer is not None:
            # The workers' connections (all but their direct LISTEN) die with it; the
            # server and this process's direct connections carry on.
            self.bouncer.restart()
            self.report.restarts += 1
            return
        params = _connection_params()
        connections.close_all()  # this process's own sessions die with the server
        if self.config.pg_restart == "cluster":
            if self.server is None:
                raise ValueError("pg_restart='cluster' restarts a private server only: "
                                 "run the chaos on one (tests.chaos.private)")
            self.server.restart()
        else:
            import psycopg

            with psycopg.connect(**params, autocommit=True) as conn:
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                             "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        wait_for_postgres(params)
        self.report.restarts += 1

    # ------------------------------------------------------------------ drain

    def _drain(self) -> None:
        self._thaw_all()
        self._collect_stopped(timeout=self.config.grace + 10)
        for worker in list(self.workers):
            if worker.returncode is None:
                worker.kill()
            self._retire(worker)
        if self.pending or self.slow:
            self._enqueue(self.pending + self.slow)
            self.pending, self.slow = [], []
        drainers = [self._start_worker(grace=5.0) for _ in range(self.config.drain_workers)]
        for worker in drainers:  # serving (signal handlers in place) before any SIGTERM
            helpers.wait_until(lambda w=worker: "serving queues" in w.stderr, timeout=60,
                               message="a drain worker to start serving")
        deadline = time.monotonic() + self.config.drain_timeout
        while time.monotonic() < deadline:
            if guarded(self._progress, 0.0) >= 1.0:
                break
            self._reap_loop(time.monotonic())
            time.sleep(0.2)
        else:
            self.log(f"drain: not every run settled within {self.config.drain_timeout}s")
        self.report.harness_checks += 1
        if self.deliverer is not None and self.deliverer.returncode is not None:
            self.report.problems.append(f"the deliverer exited {self.deliverer.returncode}:\n"
                                        f"{self.deliverer.stderr[-3000:]}")
        self.stopping.extend(drainers)
        for worker in drainers:
            worker.terminate()
        self._collect_stopped(timeout=15)

    def _cleanup(self) -> None:
        self._thaw_all()
        for worker in [*self.workers, *self.stopping]:
            if worker.returncode is None:
                worker.kill()
            self._retire(worker)
        self.stopping.clear()
        if self.reaper is not None:
            self.reaper.close()
            self.reaper = None
        if self.deliverer is not None:
            self.deliverer.close()
            self.deliverer = None
