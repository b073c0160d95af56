"""What the write-path tests share: runs claimed by a test worker, their emits, their
event stories, and another worker's reclaim."""

from __future__ import annotations

import uuid
from typing import Any

from django_agentruns import enqueue, transitions
from django_agentruns.models import AgentRun, RunEvent
from django_agentruns.transitions import AttemptRef, EmitWrite, ScopePolicy

WORKER = "store:1:abcd"


def claimed(count: int) -> list[AttemptRef]:
    for i in range(count):
        enqueue("tests.noop", {"i": i})
    runs = transitions.claim(WORKER, ["default"], count, ScopePolicy(), {}, 30.0,
                             include_lapsed=False)
    assert len(runs) == count
    return [AttemptRef(r.pk, r.attempt, WORKER, 30.0, r.agent) for r in runs]


def emit(ref: AttemptRef, n: int, type_: str = "step") -> EmitWrite:
    return EmitWrite(ref, uuid.uuid4(), type_, {"n": n})


def story(ref: AttemptRef) -> list[tuple[int, str, Any]]:
    return list(RunEvent.objects.filter(run_id=ref.run_id).order_by("seq")
                .values_list("seq", "type", "payload"))


def reclaim(ref: AttemptRef) -> None:
    """Another worker's attempt took the run (as a reaper reclaim and a new claim do)."""
    AgentRun.objects.filter(pk=ref.run_id).update(claimed_by="other:2:ffff",
                                                  attempt=ref.attempt + 1)
