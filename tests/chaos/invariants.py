"""What must hold after any amount of chaos, checked from the database alone.

Every check reads the tables a quiescent run left behind: the runs, their event streams
and the `SideEffect` rows the agents wrote (one per step, committed together with the
step's checkpoint). Each failed check is a `violation`; `Checker.checks` counts the checks
made, so a summary can show that the work was done. The checks of one run at a time (its
lifecycle, outcome and side effects) are `tests.chaos.run_checks`'s; this module holds
the plan's records, `check_all` and the checks across runs.

Two clocks are used, each only where it is sound:

- **event ids** (one sequence for all runs, taken at INSERT): a claim that saw an earlier
  run's settlement committed inserts its `run.started` after that settlement's event, so
  the ids order a scope's starts and settlements causally, whichever process wrote them;
- **timestamps** (all processes on one machine, one clock): a lease is always written as
  ``<time of the write> + TTL`` by the write that also records the event, and a takeover
  needs ``lease_expires < now``; a retry is due no earlier than its settlement. So a
  takeover's event must come more than a TTL after the last event of the attempt it took
  over, and a fenced side effect of attempt n must be older than attempt n+1's start.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django_agentruns import transitions as t
from django_agentruns.models import AgentRun, Reason, RunEvent, RunStep, Status
from tests.chaos.run_checks import (
    TERMINAL_EVENTS,
    Attempt,
    check_effects,
    check_lifecycle,
    check_outcome,
)
from tests.chaos.waits import check_waits
from tests.testapp.chaos_agents import CALL_NOTE, EFFECT_NOTE
from tests.testapp.models import SideEffect


@dataclass(frozen=True)
class PlannedRun:
    """What the harness asked of one run, so the outcome can be judged."""

    kind: str  # plain | flaky | fatal | doomed | slow | ordered | waits | keyed | snoozy
    #            | durable
    agent: str
    input: dict[str, Any]
    scope: str = ""
    fired_seq: int = 0
    priority: int = 0

    @property
    def steps(self) -> int:
        return int(self.input.get("steps", 3))

    def allowed_dead_letters(self) -> set[str]:
        """Reasons this run may be dead-lettered with (retries_exhausted: kills can do it)."""
        if self.kind == "fatal":
            return {Reason.NOT_RETRYABLE, Reason.RETRIES_EXHAUSTED}
        return {Reason.RETRIES_EXHAUSTED}


@dataclass
class Checker:
    checks: int = 0
    violations: list[str] = field(default_factory=list)

    def check(self, ok: bool, message: str) -> bool:
        self.checks += 1
        if not ok:
            self.violations.append(message)
        return ok


def check_all(
    plan: Mapping[int, PlannedRun],
    cancels: Mapping[int, str],
    lease_ttls: Mapping[str, float],
    *,
    timeouts: Mapping[str, float | None] | None = None,
    log_text: Iterable[str] = (),
) -> Checker:
    """Check every guarantee on every planned run; return the checker with its findings.

    The database must hold the harness's runs only (a test database of its own).

    `cancels` maps a run to what `cancel()` answered for it; `lease_ttls` gives each agent's
    lease; `log_text` is the workers' output, scanned for constraint violations.
    """
    checker = Checker()
    # The database is the harness's own: every row in it belongs to the plan.
    runs = {r.pk: r for r in AgentRun.objects.all()}
    checker.check(runs.keys() == plan.keys(),
                  f"runs missing: {sorted(plan.keys() - runs.keys())[:20]}, "
                  f"runs nobody planned: {sorted(runs.keys() - plan.keys())[:20]}")
    events: dict[int, list[RunEvent]] = defaultdict(list)
    for event in RunEvent.objects.order_by("run_id", "seq"):
        events[event.run_id].append(event)
    effects: dict[int, list[SideEffect]] = defaultdict(list)
    for effect in SideEffect.objects.filter(note=EFFECT_NOTE):
        effects[effect.run_id].append(effect)

    check_event_identity(checker, events)
    attempts: dict[int, dict[int, Attempt]] = {}
    for run_id, planned in plan.items():
        run = runs.get(run_id)
        if run is None:
            continue
        ttl = timedelta(seconds=lease_ttls[planned.agent])
        timeout = (timeouts or {}).get(planned.agent)
        attempts[run_id] = check_lifecycle(checker, run, events[run_id], ttl, timeout)
        check_outcome(checker, run, planned, cancels.get(run_id))
        check_effects(checker, run, planned, events[run_id], effects[run_id], attempts[run_id])
    check_firing_order(checker, plan, events)
    check_durable_steps(checker, {pk: p for pk, p in plan.items() if p.kind == "durable"},
                        runs)
    check_waits(checker, {pk: p for pk, p in plan.items() if p.kind == "waits"}, runs, events)
    for text in log_text:
        checker.check("IntegrityError" not in text,
                      f"a worker met an IntegrityError (an event collision?):\n{_excerpt(text)}")
    return checker


def check_event_identity(checker: Checker, events: Mapping[int, list[RunEvent]]) -> None:
    """No duplicate event ids; each run's sequence is 1..n with no gap or collision."""
    ids = Counter(e.event_id for stream in events.values() for e in stream)
    duplicated = [str(i) for i, n in ids.items() if n > 1]
    checker.check(not duplicated, f"duplicate event ids: {duplicated[:10]}")
    for run_id, stream in events.items():
        seqs = [e.seq for e in stream]
        checker.check(seqs == list(range(1, len(seqs) + 1)),
                      f"run {run_id}: event sequence has gaps or collisions: {seqs}")


def check_durable_steps(checker: Checker, plan: Mapping[int, PlannedRun],
                        runs: Mapping[int, AgentRun]) -> None:
    """No completed step is executed twice: once a step's end is recorded (done, by
    attempt A), no attempt after A executes it, nor A itself after that moment. A
    succeeded run has every step done, each occurrence the step's own (resumed attempts
    count on from their checkpoint)."""
    calls: dict[tuple[int, int], list[SideEffect]] = defaultdict(list)
    for call in SideEffect.objects.filter(note=CALL_NOTE, run_id__in=list(plan)):
        calls[(call.run_id, call.step)].append(call)
    steps = defaultdict(list)
    for step in RunStep.objects.filter(run_id__in=list(plan)).order_by("occurrence"):
        steps[step.run_id].append(step)
    for run_id, planned in plan.items():
        rid = f"run {run_id} (durable)"
        for step in steps[run_id]:
            if step.status != RunStep.State.DONE:
                continue
            assert step.finished_at is not None
            again = [c for c in calls[(run_id, step.occurrence - 1)]
                     if c.attempt > step.attempt or c.created_at > step.finished_at]
            checker.check(not again, f"{rid}: step call/{step.occurrence}, done by attempt "
                                     f"{step.attempt}, executed again by attempts "
                                     f"{[c.attempt for c in again]}")
        run = runs.get(run_id)
        if run is not None and run.status == Status.SUCCEEDED:
            done = [(s.name, s.occurrence) for s in steps[run_id]
                    if s.status == RunStep.State.DONE]
            checker.check(done == [("call", n) for n in range(1, planned.steps + 1)],
                          f"{rid} succeeded with done steps {done}")


def check_firing_order(checker: Checker, plan: Mapping[int, PlannedRun],
                       events: Mapping[int, list[RunEvent]]) -> None:
    """In an ordered scope, no run starts before every earlier run has settled."""
    scopes: dict[tuple[str, str], list[int]] = defaultdict(list)
    for run_id, planned in plan.items():
        if planned.kind == "ordered":
            scopes[(planned.agent, planned.scope)].append(run_id)
    for (_agent, scope), run_ids in scopes.items():
        run_ids.sort(key=lambda r: (plan[r].fired_seq, r))
        settled_by = 0  # highest terminal event id of the runs so far
        earlier: list[int] = []
        for run_id in run_ids:
            starts = [e.id for e in events.get(run_id, []) if e.type == t.STARTED]
            if starts and earlier:
                checker.check(min(starts) > settled_by,
                              f"scope {scope!r}: run {run_id} started (event id {min(starts)}) "
                              f"before runs {earlier} had all settled (last id {settled_by})")
            ends = [e.id for e in events.get(run_id, []) if e.type in TERMINAL_EVENTS]
            # A run that never settled is reported as lost; it holds the scope for ever.
            settled_by = max([settled_by, *ends]) if ends else 2**62
            earlier.append(run_id)


def _excerpt(text: str) -> str:
    at = text.find("IntegrityError")
    return text[max(0, at - 1500): at + 500]
