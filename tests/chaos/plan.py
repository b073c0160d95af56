"""What a chaos run does and what it found: its settings, the planned mix of runs, the
report."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from django.db import connection

from tests.chaos.invariants import Checker, PlannedRun
from tests.testapp.chaos_agents import (
    CHAOS,
    CHAOS_ASYNC,
    CHAOS_ORDERED,
    CHAOS_SLOW,
    CHAOS_WAITS,
)

# Limit keys of the chaos runs of kind "keyed", and their limits.
CHAOS_LIMITS = {"chaos-key-a": 2, "chaos-key-b": 3}


@dataclass
class ChaosConfig:
    runs: int = 500
    workers: int = 3
    concurrency: int = 4
    seed: int | None = None
    chaos_seconds: float = 90.0  # the fault phase ends at this, or when every run settled
    kill_every: float = 1.0  # mean seconds between SIGKILLs
    freeze_every: float = 6.0  # mean seconds between freezes; 0: none
    cancel_every: float = 4.0  # mean seconds between cancels; 0: none
    pg_restart: str = "terminate"  # terminate | cluster (a private server) | pgbouncer | none
    sigterm: bool = True
    trickle: float = 0.25  # fraction of the runs enqueued during the chaos, not up front
    drain_workers: int = 2
    drain_timeout: float = 120.0
    lease_ttl: float = 2.0
    grace: float = 0.3  # a SIGTERMed chaos worker's grace: short, so attempts are abandoned

    def worker_settings(self) -> dict[str, Any]:
        return {"LEASE_TTL": self.lease_ttl, "POLL_INTERVAL": 0.1, "REAP_INTERVAL": 1.0,
                "BACKOFF_BASE": 0.05, "BACKOFF_CAP": 0.4, "CLAIM_BATCH": 4}


@dataclass
class ChaosReport:
    runs: int = 0
    kills: int = 0
    restarts: int = 0
    sigterms: int = 0
    freezes: int = 0
    cancels: int = 0
    reaps: int = 0
    reap_failures: int = 0
    workers_started: int = 0
    seconds: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    abandoned: int = 0
    key_peaks: dict[str, int] = field(default_factory=dict)  # most running of a key seen
    fenced: int = 0  # attempts whose worker logged "lease lost ... nothing recorded"
    waited: int = 0  # run.waiting events: attempts that ended waiting for their delivery
    checker: Checker = field(default_factory=Checker)
    problems: list[str] = field(default_factory=list)  # harness-level violations
    harness_checks: int = 0

    @property
    def violations(self) -> list[str]:
        return self.problems + self.checker.violations

    @property
    def checks(self) -> int:
        return self.checker.checks + self.harness_checks

    def summary(self) -> str:
        return (f"chaos: runs={self.runs} kills={self.kills} restarts={self.restarts} "
                f"sigterms={self.sigterms} checks={self.checks} "
                f"violations={len(self.violations)}")

    def details(self) -> str:
        return (f"chaos details ({connection.vendor}): {self.seconds:.0f}s, "
                f"{self.workers_started} workers started, freezes={self.freezes} "
                f"cancels={self.cancels} reaps={self.reaps} (failed {self.reap_failures}), "
                f"abandoned attempts={self.abandoned}, stale attempts fenced off="
                f"{self.fenced}, waits={self.waited}, outcomes={self.statuses}, "
                f"key peaks={self.key_peaks} "
                f"(limits {CHAOS_LIMITS})")


def make_plan(runs: int, rng: random.Random) -> list[PlannedRun]:
    """A mix of runs: ordered scopes, transient and fatal failures, slow past the lease."""
    plan: list[PlannedRun] = []

    def base() -> dict[str, Any]:
        return {"steps": rng.randint(2, 4), "sleep": rng.choice([0.02, 0.05, 0.1])}

    n_ordered = runs // 5
    scope_size = 5
    for i in range(n_ordered):
        spec = base()
        if rng.random() < 0.25:
            spec |= {"fail": "transient", "fail_at": rng.randrange(spec["steps"]),
                     "fail_attempts": 1}
        plan.append(PlannedRun("ordered", CHAOS_ORDERED, spec, scope=f"scope-{i // scope_size}",
                               fired_seq=i % scope_size))
    kinds = (["flaky"] * 14 + ["fatal"] * 6 + ["doomed"] * 4 + ["slow"] * 5
             + ["waits"] * 8 + ["plain"] * 21 + ["keyed"] * 12 + ["snoozy"] * 4
             + ["durable"] * 6)
    for _ in range(runs - n_ordered):
        kind = rng.choice(kinds)
        spec = base()
        agent = CHAOS
        priority = 0
        if kind == "flaky":
            spec |= {"fail": "transient", "fail_at": rng.randrange(spec["steps"]),
                     "fail_attempts": rng.randint(1, 2)}
        elif kind == "fatal":
            spec |= {"fail": "fatal", "fail_at": rng.randrange(spec["steps"])}
        elif kind == "doomed":
            spec |= {"fail": "transient", "fail_at": 0, "fail_attempts": 1000}
        elif kind == "waits":
            agent = CHAOS_WAITS
            spec |= {"wait_at": rng.randrange(spec["steps"])}
        elif kind == "keyed":  # limited keys; some meet a 429 that closes their key
            spec |= {"key": rng.choice(sorted(CHAOS_LIMITS))}
            if rng.random() < 0.2:
                spec |= {"snooze_at": rng.randrange(spec["steps"]), "snoozes": 1}
        elif kind == "durable":  # durable steps, resumed from checkpoints; some flaky
            spec |= {"durable": True}
            if rng.random() < 0.3:
                spec |= {"fail": "transient", "fail_at": rng.randrange(spec["steps"]),
                         "fail_attempts": 1}
        elif kind == "snoozy":
            spec |= {"snooze_at": rng.randrange(spec["steps"]), "snoozes": rng.randint(1, 3)}
        elif kind == "slow":
            agent = CHAOS_SLOW
            # Waits for the takeover; gives up (and is stopped or fenced off) after 10 s.
            spec |= {"steps": 3, "sleep": 0.02, "slow_at": rng.choice([1, 3]), "slow": 10,
                     "finish": 0.5}
            priority = 10  # taken over at once by whichever worker has a free slot
        if kind not in ("slow", "waits") and rng.random() < 0.3:
            agent = CHAOS_ASYNC  # the same run as a coroutine, writing through the store
        plan.append(PlannedRun(kind, agent, spec, priority=priority))
    return plan
