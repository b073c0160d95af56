"""Checkpoint history and fork: the latest checkpoints' states are kept
(`CHECKPOINT_HISTORY`), and a new run can start from any of them (`fork`), linked to its
origin, which stays as it was; the fork copies only the state it starts from."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from django_agentruns import enqueue, fork, run_now, transitions
from django_agentruns.exceptions import (
    InvalidInputError,
    LimitExceeded,
    RunNotFoundError,
    UnknownAgentError,
)
from django_agentruns.models import AgentRun, RunCheckpoint, RunEvent, Status
from django_agentruns.ops import partitions
from django_agentruns.ops.retention import purge
from django_agentruns.outcomes import AttemptRef, Renewal
from django_agentruns.registry import scope_policy
from tests import helpers
from tests.testapp.models import SideEffect

# Each test runs on plain history tables and on partitioned ones (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("history_layout")


def history(run: AgentRun | int) -> list[tuple[int, object]]:
    pk = run if isinstance(run, int) else run.pk
    return list(RunCheckpoint.objects.filter(run_id=pk).order_by("number")
                .values_list("number", "state"))


def timeline(run: AgentRun) -> list[tuple[int, str, dict[str, object]]]:
    return list(RunEvent.objects.filter(run=run).order_by("seq")
                .values_list("seq", "type", "payload"))


def claim_one(worker: str = "w-test") -> AttemptRef:
    [run] = transitions.claim(worker, ["default"], 1, scope_policy(), {}, 2.0)
    return AttemptRef(run.pk, run.attempt, worker, 2.0)


def test_every_checkpoint_is_kept_not_only_the_last(db: None) -> None:
    run_now("tests.steps", {"steps": 3})
    run = AgentRun.objects.get()
    assert run.checkpoint_count == 3
    assert history(run) == [(1, {"step": 1}), (2, {"step": 2}), (3, {"step": 3})]


def test_a_replayed_or_fenced_checkpoint_adds_no_history(db: None) -> None:
    enqueue("tests.noop")
    ref = claim_one()
    assert transitions.checkpoint(ref, {"a": 1}, 1) is Renewal.OK
    assert transitions.checkpoint(ref, {"a": 1}, 1) is Renewal.OK  # a replay only renews
    stale = AttemptRef(ref.run_id, ref.attempt, "someone-else", 2.0)
    assert transitions.checkpoint(stale, {"a": 2}, 2) is Renewal.LOST
    assert history(ref.run_id) == [(1, {"a": 1})]


def test_the_batched_checkpoint_path_keeps_history_too(db: None) -> None:
    enqueue("tests.noop")
    enqueue("tests.noop")
    a, b = claim_one("w-a"), claim_one("w-b")
    lost = AttemptRef(b.run_id, b.attempt, "w-gone", 2.0)
    with transaction.atomic():
        results = transitions.apply_writes([
            transitions.CheckpointWrite(a, {"x": 1}, 1),
            transitions.CheckpointWrite(lost, {"y": 9}, 1),
            transitions.CheckpointWrite(a, {"x": 2}, 2),
        ])
    assert results == [Renewal.OK, Renewal.LOST, Renewal.OK]
    assert history(a.run_id) == [(1, {"x": 1}), (2, {"x": 2})]
    assert history(b.run_id) == []


def test_fork_starts_from_the_chosen_checkpoint_and_leaves_the_origin_alone(db: None) -> None:
    run_now("tests.steps", {"steps": 4})
    origin = AgentRun.objects.get()
    before = timeline(origin)

    forked = fork(origin.pk, checkpoint=2, by="alice")

    assert forked.pk != origin.pk
    assert forked.status == Status.QUEUED
    assert forked.agent == origin.agent
    assert forked.input == origin.input
    assert forked.forked_from_id == origin.pk
    assert forked.checkpoint_state == {"step": 2}
    assert forked.checkpoint_count == 2
    assert history(forked) == [(2, {"step": 2})]  # only the state it starts from
    [(_seq, type_, payload)] = timeline(forked)
    assert type_ == transitions.FORKED
    assert payload == {"origin": origin.pk, "checkpoint": 2, "by": "alice",
                       "input_replaced": False}
    origin.refresh_from_db()
    assert origin.status == Status.SUCCEEDED
    assert origin.checkpoint_count == 4
    assert timeline(origin) == before
    assert len(history(origin)) == 4


def test_fork_defaults_to_the_last_checkpoint_and_may_replace_the_input(db: None) -> None:
    run_now("tests.steps", {"steps": 2})
    origin = AgentRun.objects.get()
    forked = fork(origin, input={"steps": 5})
    assert forked.checkpoint_count == 2
    assert forked.checkpoint_state == {"step": 2}
    assert forked.input == {"steps": 5}
    # A fork of the fork may start from the checkpoint the fork started from, and from no
    # earlier one: a fork copies none of its origin's history.
    again = fork(forked.pk, checkpoint=2)
    assert again.checkpoint_state == {"step": 2}
    assert again.forked_from_id == forked.pk
    with pytest.raises(InvalidInputError, match="keeps only its latest ones"):
        fork(forked.pk, checkpoint=1)


def test_fork_of_a_run_without_checkpoints_starts_from_scratch(db: None) -> None:
    origin = enqueue("tests.noop", {"a": 1})
    forked = fork(origin.pk)
    assert forked.checkpoint_count == 0
    assert forked.checkpoint_state is None
    assert history(forked) == []


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"checkpoint": 3}, InvalidInputError, "has no checkpoint 3: it saved 2"),
    ({"checkpoint": 0}, InvalidInputError, "checkpoint must be"),
    ({"checkpoint": "1"}, InvalidInputError, "checkpoint must be"),
    ({"input": {"x": object()}}, InvalidInputError, "JSON"),
])
def test_fork_refuses_bad_input_and_writes_nothing(
    db: None, kwargs: dict[str, object], error: type[Exception], match: str,
) -> None:
    run_now("tests.steps", {"steps": 2})
    origin = AgentRun.objects.get()
    with pytest.raises(error, match=match):
        fork(origin.pk, **kwargs)  # type: ignore[arg-type]
    assert AgentRun.objects.count() == 1


def test_fork_of_an_unknown_run_or_agent_is_refused(db: None, settings: object) -> None:
    with pytest.raises(RunNotFoundError):
        fork(12345)
    AgentRun.objects.create(agent="tests.gone", queue="default")
    with pytest.raises(UnknownAgentError):
        fork(AgentRun.objects.get().pk)
    assert AgentRun.objects.count() == 1


def test_a_fork_input_over_the_cap_is_refused(db: None, settings: object) -> None:
    settings.AGENTRUNS = {**settings.AGENTRUNS, "MAX_INPUT_BYTES": 20}  # type: ignore[attr-defined]
    origin = enqueue("tests.noop")
    with pytest.raises(LimitExceeded):
        fork(origin.pk, input={"text": "x" * 100})
    assert AgentRun.objects.count() == 1


def test_purge_removes_the_history_with_the_run_and_unlinks_forks(db: None) -> None:
    run_now("tests.steps", {"steps": 2})
    origin = AgentRun.objects.get()
    forked = fork(origin.pk)
    later = timezone.now() + timedelta(days=2)
    report = purge(timedelta(days=1), at=later)
    assert report.runs == 1
    # Partitioned history outlives its run until the run's span is dropped; the fork, an
    # unfinished run of the same span, keeps the span.
    kept = bool(partitions.partitioned_tables())
    assert RunCheckpoint.objects.filter(run_id=origin.pk).exists() is kept
    forked.refresh_from_db()
    assert forked.forked_from_id is None
    assert history(forked) == [(2, {"step": 2})]  # the fork's own copy stays
    forked.refresh_from_db()
    assert forked.checkpoint_state == {"step": 2}
    again = fork(forked.pk, checkpoint=2)  # and still forks
    assert again.checkpoint_state == {"step": 2}


@pytest.mark.slow
def test_a_worker_runs_a_fork_from_checkpoint_2_of_4(worker_env: dict[str, str]) -> None:
    origin = enqueue("tests.resumable", {"steps": 4})
    with helpers.start_manage(["runworker", "--burst"], worker_env) as worker:
        assert worker.wait(60) == 0, worker.output()
    origin.refresh_from_db()
    assert origin.status == Status.SUCCEEDED
    assert origin.checkpoint_count == 4
    before = timeline(origin)

    forked = fork(origin.pk, checkpoint=2)
    with helpers.start_manage(["runworker", "--burst"], worker_env) as worker:
        assert worker.wait(60) == 0, worker.output()

    forked.refresh_from_db()
    assert forked.status == Status.SUCCEEDED
    notes = list(SideEffect.objects.filter(run_id=forked.pk).order_by("id")
                 .values_list("step", "note"))
    assert notes == [(-1, "resume:2"), (2, ""), (3, "")]  # started at checkpoint 2's state
    assert forked.checkpoint_count == 4
    assert history(forked) == [(n, {"step": n}) for n in range(2, 5)]
    assert [t for _, t, _ in timeline(forked)][:2] == [transitions.FORKED, transitions.STARTED]
    origin.refresh_from_db()
    assert origin.status == Status.SUCCEEDED
    assert timeline(origin) == before


def test_a_fork_keeps_its_origins_limit_key(db: None) -> None:
    """A fork counts against the same limit as its origin: it used to have no key, and so
    passed every limit and closed key."""
    keyed = enqueue("tests.keyed", {"key": "acme"})
    overridden = enqueue("tests.keyed_openai", limit_key="azure")
    assert fork(keyed.pk).limit_key == "acme"
    assert fork(overridden.pk).limit_key == "azure"
    # A new input: an agent whose key is computed from its input computes it again.
    assert fork(keyed.pk, input={"key": "globex"}).limit_key == "globex"
    assert fork(overridden.pk, input={"x": 1}).limit_key == "azure"
