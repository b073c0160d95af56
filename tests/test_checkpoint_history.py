"""Checkpoint history is bounded: a run keeps its latest `CHECKPOINT_HISTORY` states (None:
all), older ones deleted in the transaction that saves a new one, on the one-write and
the batched path; a fork from a kept checkpoint still works, and a growing state's history
stays bounded."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import transaction

from django_agentruns import enqueue, fork, run_now, transitions
from django_agentruns.exceptions import InvalidInputError
from django_agentruns.models import AgentRun, RunCheckpoint
from django_agentruns.outcomes import AttemptRef, Renewal
from django_agentruns.registry import scope_policy

# Each test runs on plain history tables and on partitioned ones (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("history_layout")


def numbers(run_id: int) -> list[int]:
    return list(RunCheckpoint.objects.filter(run_id=run_id).order_by("number")
                .values_list("number", flat=True))


def keep(settings: Any, n: int | None) -> None:
    settings.AGENTRUNS = {**settings.AGENTRUNS, "CHECKPOINT_HISTORY": n}


def claim_one(worker: str = "w-test") -> AttemptRef:
    [run] = transitions.claim(worker, ["default"], 1, scope_policy(), {}, 2.0)
    return AttemptRef(run.pk, run.attempt, worker, 2.0)


def test_the_default_keeps_the_latest_20(db: None) -> None:
    enqueue("tests.noop")
    ref = claim_one()
    for n in range(1, 26):
        assert transitions.checkpoint(ref, {"n": n}, n) is Renewal.OK
    assert numbers(ref.run_id) == list(range(6, 26))
    assert AgentRun.objects.get().checkpoint_state == {"n": 25}


def test_a_run_keeps_its_latest_states_and_forks_from_them(db: None, settings: Any) -> None:
    keep(settings, 3)
    run_now("tests.steps", {"steps": 6})
    origin = AgentRun.objects.get()
    assert origin.checkpoint_count == 6
    assert numbers(origin.pk) == [4, 5, 6]
    forked = fork(origin.pk, checkpoint=4)
    assert forked.checkpoint_state == {"step": 4}
    assert numbers(forked.pk) == [4]
    with pytest.raises(InvalidInputError, match="has no checkpoint 3: it saved 6 and keeps"):
        fork(origin.pk, checkpoint=3)


def test_none_keeps_every_state(db: None, settings: Any) -> None:
    keep(settings, None)
    run_now("tests.steps", {"steps": 25})
    assert numbers(AgentRun.objects.get().pk) == list(range(1, 26))


def test_the_batched_path_trims_too(db: None, settings: Any) -> None:
    keep(settings, 2)
    enqueue("tests.noop")
    enqueue("tests.noop")
    a, b = claim_one("w-a"), claim_one("w-b")
    with transaction.atomic():
        results = transitions.apply_writes(
            [transitions.CheckpointWrite(a, {"x": n}, n) for n in range(1, 5)]
            + [transitions.CheckpointWrite(b, {"y": 1}, 1)])
    assert results == [Renewal.OK] * 5
    assert numbers(a.run_id) == [3, 4]
    assert numbers(b.run_id) == [1]  # another run's history is not touched
    with transaction.atomic():
        transitions.apply_writes([transitions.CheckpointWrite(a, {"x": 5}, 5)])
    assert numbers(a.run_id) == [4, 5]


def test_a_lowered_setting_trims_the_older_states_at_the_next_checkpoint(
    db: None, settings: Any,
) -> None:
    keep(settings, 10)
    enqueue("tests.noop")
    ref = claim_one()
    for n in range(1, 9):
        transitions.checkpoint(ref, {"n": n}, n)
    keep(settings, 2)
    transitions.checkpoint(ref, {"n": 9}, 9)
    assert numbers(ref.run_id) == [8, 9]


def test_a_growing_state_keeps_a_bounded_history(db: None) -> None:
    """The case of issue 29: a state that grows by 1 KB a checkpoint, 200 checkpoints, was
    about 20 MB of history with every state kept; the latest 20 are under 4 MB."""
    enqueue("tests.noop")
    ref = claim_one()
    chunk = "x" * 1000
    for n in range(1, 201):
        assert transitions.checkpoint(ref, {"log": chunk * n}, n) is Renewal.OK
    states = list(RunCheckpoint.objects.filter(run_id=ref.run_id).values_list("state",
                                                                              flat=True))
    kept = sum(len(json.dumps(state)) for state in states)
    assert len(states) == 20
    assert kept < 4_000_000, kept
    every = sum(len(json.dumps({"log": chunk * n})) for n in range(1, 201))
    assert every > 20_000_000  # what keeping all of them would have stored
    forked = fork(ref.run_id, checkpoint=190)
    assert forked.checkpoint_state == {"log": chunk * 190}
