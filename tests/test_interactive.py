"""Interactive runs: `run_now` executes an agent in the caller's thread, without a lease.

The run and its events are recorded like any other run; a failure reaches the caller as
the agent's own exception and is not retried (reason `error`); the reaper and workers
never touch the run, since it holds no lease to lapse. These tests run inside the test's
transaction (`django_db`), as `run_now` would inside a view's: every write, an async
agent's included, must join the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from django_agentruns import (
    CancelResult,
    InvalidInputError,
    NotRetryable,
    RunCancelledError,
    RunContext,
    agent,
    cancel,
    run_now,
    transitions,
)
from django_agentruns.exceptions import AttemptTimeout
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.registry import unregister
from django_agentruns.runtime import reaper
from django_agentruns.transitions import ScopePolicy
from tests.testapp.agents import record
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db


def the_run(agent_name: str) -> AgentRun:
    return AgentRun.objects.get(agent=agent_name)


def events(run_id: int) -> list[tuple[int, str, dict[str, Any]]]:
    return list(RunEvent.objects.filter(run_id=run_id).order_by("seq")
                .values_list("seq", "type", "payload"))


def claim_anything(at_offset: timedelta) -> list[AgentRun]:
    """What a worker's claim would take at now + `at_offset`, lapsed leases included."""
    return transitions.claim("other-worker", ["default"], 100, ScopePolicy(), {}, 2.0,
                             at=transitions.now() + at_offset)


@pytest.fixture
def local_agent() -> Iterator[list[str]]:
    """Names of agents a test registers; unregistered afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        unregister(name)


# --------------------------------------------------------------------------- success


def test_run_now_returns_the_output_and_records_the_run_and_its_events() -> None:
    assert run_now("tests.steps", {"steps": 2}, scope="s1") == {"steps": 2}

    row = the_run("tests.steps")
    assert (row.status, row.reason, row.output) == (Status.SUCCEEDED, Reason.COMPLETED,
                                                    {"steps": 2})
    assert (row.attempt, row.requeue_count, row.scope) == (1, 0, "s1")
    assert row.claimed_by.startswith("interactive:")
    assert row.lease_expires is None
    assert row.started_at is not None
    assert row.finished_at is not None
    assert (row.checkpoint_state, row.checkpoint_count) == ({"step": 2}, 2)
    assert events(row.pk) == [
        (1, "run.started", {"worker": row.claimed_by}),
        (2, "step", {"n": 0}),
        (3, "run.checkpoint", {"count": 1}),
        (4, "step", {"n": 1}),
        (5, "run.checkpoint", {"count": 2}),
        (6, "run.succeeded", {}),
    ]
    assert SideEffect.objects.filter(run_id=row.pk).count() == 2


def test_run_now_runs_an_async_agent_inside_the_callers_transaction() -> None:
    assert run_now("tests.async_steps", {"steps": 2}) == {"async": True}
    row = the_run("tests.async_steps")
    assert (row.status, row.reason, row.output) == (Status.SUCCEEDED, Reason.COMPLETED,
                                                    {"async": True})
    assert [t for _, t, _ in events(row.pk)] == [
        "run.started", "step", "run.checkpoint", "step", "run.checkpoint", "run.succeeded"]
    assert row.checkpoint_count == 2


# --------------------------------------------------------------------------- failure


def test_a_failure_raises_the_agents_exception_unchanged_and_is_not_retried(
    local_agent: list[str],
) -> None:
    error = ConnectionError("upstream unreachable")  # retryable, had a worker run it

    @agent("tests.interactive_raises", max_requeues=3)
    def raises(ctx: RunContext) -> None:
        record(ctx)
        raise error

    local_agent.append("tests.interactive_raises")
    with pytest.raises(ConnectionError) as caught:
        run_now("tests.interactive_raises")
    assert caught.value is error
    assert any(entry.name == "raises" for entry in caught.traceback)  # raised where it was

    row = the_run("tests.interactive_raises")
    assert (row.status, row.reason, row.attempt, row.requeue_count) == (
        Status.FAILED, Reason.ERROR, 1, 0)
    assert not row.is_dead_letter
    assert (row.error_type, row.error_message) == ("ConnectionError", "upstream unreachable")
    assert "raise error" in row.error_traceback
    assert [(t, p.get("reason")) for _, t, p in events(row.pk)] == [
        ("run.started", None), ("run.dead_lettered", "error")]
    assert claim_anything(timedelta(days=1)) == []  # nothing to retry
    assert AgentRun.objects.get(pk=row.pk).status == Status.FAILED
    assert SideEffect.objects.filter(run_id=row.pk).count() == 1


@pytest.mark.parametrize(("agent_name", "raised"), [
    ("tests.not_retryable", NotRetryable),
    ("tests.bad_output", InvalidInputError),
    ("tests.timeout", AttemptTimeout),  # heartbeats past its 0.3 s timeout
])
def test_failures_of_every_kind_are_raised_and_recorded_with_reason_error(
    agent_name: str, raised: type[BaseException],
) -> None:
    with pytest.raises(raised):
        run_now(agent_name)
    row = the_run(agent_name)
    assert (row.status, row.reason, row.attempt, row.requeue_count) == (
        Status.FAILED, Reason.ERROR, 1, 0)
    assert row.lease_expires is None


def test_an_async_agents_failure_and_timeout_reach_the_caller(local_agent: list[str]) -> None:
    error = ValueError("bad answer")

    @agent("tests.interactive_async_raises")
    async def raises(ctx: RunContext) -> None:
        await ctx.aemit("before")
        raise error

    local_agent.append("tests.interactive_async_raises")
    with pytest.raises(ValueError, match="bad answer") as caught:
        run_now("tests.interactive_async_raises")
    assert caught.value is error
    row = the_run("tests.interactive_async_raises")
    assert (row.status, row.reason) == (Status.FAILED, Reason.ERROR)
    assert [t for _, t, _ in events(row.pk)] == ["run.started", "before", "run.dead_lettered"]

    with pytest.raises(AttemptTimeout):
        run_now("tests.async_sleeper", {"seconds": 20})  # timeout 0.5 s
    row = the_run("tests.async_sleeper")
    assert (row.status, row.reason) == (Status.FAILED, Reason.ERROR)
    assert row.error_type == "django_agentruns.exceptions.AttemptTimeout"


def test_a_cancelled_interactive_run_stops_at_its_next_boundary(local_agent: list[str]) -> None:
    @agent("tests.interactive_cancels_itself")
    def cancels_itself(ctx: RunContext) -> None:
        assert cancel(ctx.run_id, reason="changed my mind") is CancelResult.REQUESTED
        ctx.heartbeat()
        record(ctx, note="after the boundary")

    local_agent.append("tests.interactive_cancels_itself")
    with pytest.raises(RunCancelledError):
        run_now("tests.interactive_cancels_itself")
    row = the_run("tests.interactive_cancels_itself")
    assert (row.status, row.reason, row.cancel_reason) == (Status.CANCELLED, Reason.CANCELLED,
                                                           "changed my mind")
    assert not SideEffect.objects.filter(run_id=row.pk).exists()


# --------------------------------------------------------------------------- no lease


def test_the_reaper_and_workers_never_touch_a_running_interactive_run(
    local_agent: list[str],
) -> None:
    seen: dict[str, Any] = {}

    @agent("tests.interactive_watches")
    def watches(ctx: RunContext) -> str:
        row = AgentRun.objects.get(pk=ctx.run_id)
        seen["while running"] = (row.status, row.lease_expires)
        # A day from now every lease has lapsed, yet there is nothing to take back.
        seen["reaped"] = reaper.reap(at=transitions.now() + timedelta(days=1)).stale
        seen["claimed"] = claim_anything(timedelta(days=1))
        ctx.emit("still mine")
        return "done"

    local_agent.append("tests.interactive_watches")
    assert run_now("tests.interactive_watches") == "done"
    assert seen == {"while running": (Status.RUNNING, None), "reaped": [], "claimed": []}
    row = the_run("tests.interactive_watches")
    assert (row.status, row.attempt, row.requeue_count) == (Status.SUCCEEDED, 1, 0)
    assert "run.abandoned" not in [t for _, t, _ in events(row.pk)]
