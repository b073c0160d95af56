"""What the write-path tests share: runs claimed by a test worker (or another), their
emits, their event stories, and another worker's reclaim."""

from __future__ import annotations

import uuid
from typing import Any

from django_agentruns import enqueue, transitions
from django_agentruns.models import AgentRun, RunEvent
from django_agentruns.transitions import AttemptRef, EmitWrite, ScopePolicy

WORKER = "store:1:abcd"


def claim_runs(count: int, worker: str = WORKER, ttl: float = 30.0) -> list[AgentRun]:
    """`count` no-op runs enqueued, then claimed by `worker` with a lease of `ttl`."""
    for i in range(count):
        enqueue("tests.noop", {"i": i})
    runs = transitions.claim(worker, ["default"], count, ScopePolicy(), {}, ttl,
                             include_lapsed=False)
    assert len(runs) == count
    return runs


def claimed(count: int) -> list[AttemptRef]:
    """`claim_runs`, as the refs their attempts write with."""
    return [AttemptRef(r.pk, r.attempt, WORKER, 30.0, r.agent) for r in claim_runs(count)]


def emit(ref: AttemptRef, n: int, type_: str = "step") -> EmitWrite:
    return EmitWrite(ref, uuid.uuid4(), type_, {"n": n})


def story(ref: AttemptRef) -> list[tuple[int, str, Any]]:
    return list(RunEvent.objects.filter(run_id=ref.run_id).order_by("seq")
                .values_list("seq", "type", "payload"))


def reclaim(ref: AttemptRef) -> None:
    """Another worker's attempt took the run (as a reaper reclaim and a new claim do)."""
    AgentRun.objects.filter(pk=ref.run_id).update(claimed_by="other:2:ffff",
                                                  attempt=ref.attempt + 1)
