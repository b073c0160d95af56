"""The chaos suite's invariants of waiting runs (guarantee 12), from the database alone.

- No delivered payload is lost: a waiting run that succeeded received exactly its own
  payload (the agent dead-letters itself otherwise), and every run of the mix got one.
- No run waits for a payload that was delivered: in each run's stream no `run.waiting`
  follows its `run.delivered`, and no run is left `waiting` with its payload stored.
- Resumed exactly once per delivery: at most one `run.resumed`, and only after a
  `run.delivered`; the first payload stands whatever the deliverer sent again.
- Waiting costs no budget: a resume is no `run.retrying`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from django_agentruns import transitions as t
from django_agentruns.models import AgentRun, RunWait, Status
from tests.testapp.chaos_agents import WAIT_KEY

if TYPE_CHECKING:
    from django_agentruns.models import RunEvent
    from tests.chaos.invariants import Checker, PlannedRun


def check_waits(checker: Checker, plan: Mapping[int, PlannedRun],
                runs: Mapping[int, AgentRun], events: Mapping[int, list[RunEvent]]) -> None:
    waits = {w.run_id: w for w in RunWait.objects.filter(run_id__in=list(plan), key=WAIT_KEY)}
    for run_id in plan:
        run = runs.get(run_id)
        if run is None:
            continue
        rid = f"run {run_id} (waits)"
        wait = waits.get(run_id)
        stream = [e.type for e in events.get(run_id, [])]
        delivered = wait is not None and wait.delivered_at is not None
        if run.status == Status.SUCCEEDED:
            checker.check(delivered, f"{rid} succeeded, but no payload was delivered")
        if delivered:
            assert wait is not None
            checker.check(wait.payload == {"run": run_id},
                          f"{rid}: the stored payload is {wait.payload!r}, not the first one")
        checker.check(run.status != Status.WAITING,
                      f"{rid} still waits (payload delivered: {delivered})")
        checker.check(stream.count(t.waiting.DELIVERED) <= 1,
                      f"{rid}: delivered more than once: {stream}")
        checker.check(stream.count(t.waiting.RESUMED) <= 1,
                      f"{rid}: resumed more than once for its one key: {stream}")
        if t.waiting.DELIVERED in stream:
            first = stream.index(t.waiting.DELIVERED)
            checker.check(t.waiting.WAITING not in stream[first:],
                          f"{rid} waited for a payload already delivered: {stream}")
        if t.waiting.RESUMED in stream:
            checker.check(t.waiting.DELIVERED in stream[:stream.index(t.waiting.RESUMED)],
                          f"{rid} resumed before any delivery: {stream}")
