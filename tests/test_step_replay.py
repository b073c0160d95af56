"""Replay and fork at step granularity, and agent versions across a deploy.

`fork(run, replay=True)` re-executes the agent and every step the origin completed
returns the origin's recorded result without calling its function (copied into the fork,
so purging the origin breaks nothing); `agent=` runs other code against those records.
`@agent(version=N, migrate=f)`: runs record their version; a worker with an older
version leaves a newer run queued; newer code migrates an older run's state when it
claims it, or leaves it for a worker with the old code.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command

from django_agentruns import agent, deliver, enqueue, fork, transitions
from django_agentruns.checks import check_pinned_versions
from django_agentruns.models import AgentRun, RunEvent, RunStep, Status
from django_agentruns.ops.visibility import VERSION, why_not_started
from django_agentruns.registry import unregister
from django_agentruns.runtime.worker import Worker
from django_agentruns.transitions.due import compiled_due
from tests.testapp.step_agents import executions


def burst() -> None:
    compiled_due.cache_clear()  # the claim's SQL holds the registered versions
    Worker(burst=True, reap_interval=0).run(install_signals=False)


def recorded_run(n: int = 5) -> AgentRun:
    run = enqueue("tests.step_chain", {"n": n})
    burst()
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED, run.error_message
    assert len(executions(run.pk)) == n
    return run


def test_a_replay_of_a_recorded_run_calls_no_step_and_gives_the_same_output(
        transactional_db: None) -> None:
    origin = recorded_run(5)
    replay = fork(origin.pk, replay=True)
    expected = origin.output  # read before the origin (and its output row) goes
    AgentRun.objects.filter(pk=origin.pk).delete()  # purging the origin breaks nothing
    burst()
    replay.refresh_from_db()
    assert replay.status == Status.SUCCEEDED, replay.error_message
    assert executions(replay.pk) == []
    assert replay.output == expected
    steps = RunStep.objects.filter(run=replay)
    assert steps.count() == 5
    assert {(s.input_tokens, s.cost) for s in steps} == {(0, 0.0)}  # replayed: no usage
    forked = RunEvent.objects.get(run=replay, type=transitions.FORKED)
    assert forked.payload["replay"] is True


def test_a_replay_into_a_changed_agent_executes_only_its_new_steps(
        transactional_db: None) -> None:
    origin = recorded_run(5)
    replay = fork(origin.pk, replay=True, agent="tests.step_chain_more")
    burst()
    replay.refresh_from_db()
    assert (replay.agent, replay.status) == ("tests.step_chain_more", Status.SUCCEEDED)
    assert executions(replay.pk) == [f"run-{replay.pk}/review/1"]
    assert replay.output == {**origin.output, "review": "fine"}


def test_a_fork_without_replay_executes_every_step_again(transactional_db: None) -> None:
    origin = recorded_run(3)
    again = fork(origin.pk)
    burst()
    again.refresh_from_db()
    assert again.status == Status.SUCCEEDED
    assert len(executions(again.pk)) == 3


# --------------------------------------------------------------------------- versions


@pytest.fixture
def versioned() -> Iterator[Any]:
    """Registers tests.versioned at a version (with or without a migrate) on demand."""

    def register(version: int, migrate: Any = None) -> None:
        unregister("tests.versioned")

        @agent("tests.versioned", version=version, migrate=migrate)
        def versioned(ctx):  # type: ignore[no-untyped-def]
            if ctx.state is None:
                ctx.checkpoint({"v1": "state"})
            go = ctx.receive("go")
            return {"state": ctx.state, "go": go}

    yield register
    unregister("tests.versioned")


def test_a_waiting_run_resumes_on_newer_code_after_its_state_is_migrated(
        transactional_db: None, versioned: Any) -> None:
    versioned(1)
    run = enqueue("tests.versioned")
    burst()
    assert AgentRun.objects.get(pk=run.pk).status == Status.WAITING

    versioned(2, migrate=lambda state, old: {"v2": state["v1"], "from": old})
    deliver(run.pk, "go", "now")
    burst()
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED, run.error_message
    assert run.output == {"state": {"v2": "state", "from": 1}, "go": "now"}
    assert run.agent_version == 2
    migrated = RunEvent.objects.get(run=run, type="run.migrated")
    assert migrated.payload == {"version": 2, "from_version": 1}


def test_an_older_run_without_a_migrate_waits_for_the_old_code(
        transactional_db: None, versioned: Any) -> None:
    versioned(1)
    run = enqueue("tests.versioned")
    burst()
    versioned(2)
    deliver(run.pk, "go", "now")
    burst()
    run.refresh_from_db()
    assert (run.status, run.agent_version) == (Status.QUEUED, 1)
    [hold] = [h for h in why_not_started(run) if h.code == VERSION]
    assert "no migrate" in hold.message
    out = io.StringIO()
    call_command("agentruns_versions", stdout=out)
    assert "tests.versioned v1: 1 unfinished run, version 2 here has no migrate" in \
        out.getvalue()
    [warning] = check_pinned_versions(databases=["default"])
    assert warning.id == "agentruns.W009"
    versioned(1)  # a worker with the old code finishes it
    burst()
    assert AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED


def test_a_run_of_a_newer_version_is_not_claimed_by_an_older_worker(
        transactional_db: None, versioned: Any) -> None:
    versioned(3)
    run = enqueue("tests.versioned")
    assert run.agent_version == 3
    versioned(2, migrate=lambda state, old: state)
    burst()
    run.refresh_from_db()
    assert (run.status, run.attempt) == (Status.QUEUED, 0)  # queued, never waiting
    [hold] = [h for h in why_not_started(run) if h.code == VERSION]
    assert "version 3" in hold.message
    assert "version 2" in hold.message


def test_a_runs_steps_are_purged_with_it(transactional_db: None) -> None:
    from datetime import timedelta

    from django_agentruns.ops.retention import purge

    origin = recorded_run(2)
    replay = fork(origin.pk, replay=True)
    assert origin.finished_at is not None
    AgentRun.objects.filter(pk=origin.pk).update(
        finished_at=origin.finished_at - timedelta(days=60))
    assert purge(timedelta(days=30)).runs == 1
    assert not RunStep.objects.filter(run_id=origin.pk).exists()
    assert RunStep.objects.filter(run=replay).count() == 2  # the fork's copies stay
