"""`why_not_started` and `manage.py why`: why a queued run is not starting, read-only."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_agentruns import enqueue, transitions
from django_agentruns.models import AgentRun, Status, WorkerRecord
from django_agentruns.ops.visibility import (
    BLOCKED,
    CANCEL_REQUESTED,
    NOT_QUEUED,
    UNKNOWN_AGENT,
    WAITING,
    Hold,
    why_not_started,
)
from django_agentruns.outcomes import AttemptRef
from django_agentruns.registry import scope_policy
from django_agentruns.rules import policy

pytestmark = pytest.mark.django_db

ORDERED = "tests.ordered"


@contextmanager
def read_only() -> Iterator[None]:
    """Fails the test if anything inside writes (every statement must be a SELECT)."""
    with CaptureQueriesContext(connection) as captured:
        yield
    statements = [q["sql"] for q in captured.captured_queries]
    assert statements, "expected some queries"
    writes = [s for s in statements if not s.lstrip().upper().startswith("SELECT")]
    assert writes == []


def why(run: AgentRun) -> list[Hold]:
    with read_only():
        return why_not_started(run.pk)


def why_command(run_id: int) -> str:
    out = io.StringIO()
    with read_only():
        call_command("why", str(run_id), stdout=out)
    return out.getvalue()


def relative(text: str) -> str:
    """`text` with its "N.Ns from now" (read off the clock at each call) made constant."""
    return re.sub(r"\d+\.\ds from now", "Ns from now", text)


def claim(worker: str = "w-test", ttl: float = 2.0) -> AgentRun:
    [run] = transitions.claim(worker, ["default"], 1, scope_policy(), {}, ttl)
    return run


def dead_letter(run: AgentRun) -> None:
    ref = AttemptRef(run.pk, run.attempt, run.claimed_by, 2.0)
    settled = transitions.settle_failed(ref, policy.Failure(retryable=False),
                                        transitions.ErrorInfo("NotRetryable", "no", ""))
    assert settled is transitions.Settlement.DEAD_LETTERED


# --------------------------------------------------------------------------- reasons


def test_a_due_run_has_no_reason() -> None:
    run = enqueue("tests.noop")
    WorkerRecord.objects.create(worker_id="w1", host="h", pid=1, queues=["default"],
                                agents=["tests.noop"])  # a live worker that will take it
    assert why(run) == []
    assert "is due now: nothing holds it back" in why_command(run.pk)
    assert "'default'" in why_command(run.pk)


def test_waiting_for_its_due_time() -> None:
    run = enqueue("tests.noop", run_after=60)
    [hold] = why(run)
    assert hold.code == WAITING
    assert run.available_at.isoformat(timespec="milliseconds") in hold.message
    assert "run_after" in hold.message
    # The command reads the clock again: its "N.Ns from now" may be a tick lower.
    assert relative(str(hold)) in relative(why_command(run.pk))


def test_blocked_by_a_running_run_of_its_scope() -> None:
    first = enqueue(ORDERED, scope="ticket-42", fired_seq=1)
    enqueue(ORDERED, scope="ticket-42", fired_seq=2)
    third = enqueue(ORDERED, scope="ticket-42", fired_seq=3)
    assert claim().pk == first.pk

    [hold] = why(third)
    assert hold.code == BLOCKED
    assert (hold.blocker, hold.blocker_status) == (first.pk, Status.RUNNING)
    assert f"blocked by run #{first.pk} (running)" in hold.message
    assert "'ticket-42'" in hold.message
    output = why_command(third.pk)
    assert f"run #{third.pk} ({ORDERED}) is not starting:" in output
    assert f"- blocked by run #{first.pk} (running)" in output


def test_blocked_by_an_earlier_run_still_backing_off_and_waiting_itself() -> None:
    first = enqueue(ORDERED, scope="s", fired_seq=1, run_after=30)
    second = enqueue(ORDERED, scope="s", fired_seq=2, run_after=10)

    holds = why(second)
    assert [h.code for h in holds] == [WAITING, BLOCKED]
    assert (holds[1].blocker, holds[1].blocker_status) == (first.pk, Status.QUEUED)
    assert "waiting until" in holds[1].message


def test_blocked_by_a_dead_letter_only_where_the_agent_says() -> None:
    dead = enqueue("tests.ordered_blocking", scope="s", fired_seq=1)
    dead_letter(claim())
    blocked = enqueue("tests.ordered_blocking", scope="s", fired_seq=2)
    [hold] = why(blocked)
    assert (hold.code, hold.blocker, hold.blocker_status) == (BLOCKED, dead.pk, Status.FAILED)
    assert "dead-lettered (not_retryable)" in hold.message
    assert "retry or cancel it" in hold.message

    enqueue(ORDERED, scope="t", fired_seq=1)
    dead_letter(claim())
    free = enqueue(ORDERED, scope="t", fired_seq=2)
    assert why(free) == []


def test_unordered_agents_are_never_blocked_by_their_scope() -> None:
    enqueue("tests.noop", scope="s", fired_seq=1)
    claim()
    later = enqueue("tests.noop", scope="s", fired_seq=2)
    assert why(later) == []


def test_a_pending_cancel_request() -> None:
    run = enqueue("tests.noop")
    # No transition leaves a queued run with a cancel request; a race could, so fake one.
    AgentRun.objects.filter(pk=run.pk).update(cancel_requested_at=timezone.now(),
                                              cancel_reason="operator said so")
    [hold] = why(run)
    assert hold.code == CANCEL_REQUESTED
    assert "operator said so" in hold.message


def test_an_unknown_agent() -> None:
    """Workers claim only runs of agents they have: the run waits for one that has it."""
    run = AgentRun.objects.create(agent="tests.no_such_agent", queue="mail")
    [hold] = why(run)
    assert hold.code == UNKNOWN_AGENT
    assert hold.message == (
        f"run #{run.pk} is queued and due, but its agent 'tests.no_such_agent' is not "
        "registered in this process: a worker only claims runs of agents it has, and no "
        "worker that knows 'tests.no_such_agent' has claimed it; check that a worker with "
        "'tests.no_such_agent' deployed serves queue 'mail'")
    assert "dead-letter" not in hold.message

    AgentRun.objects.filter(pk=run.pk).update(
        available_at=timezone.now() + timedelta(minutes=5))
    unknown, waiting = why(run)
    assert (unknown.code, waiting.code) == (UNKNOWN_AGENT, WAITING)
    assert unknown.message == (
        "its agent 'tests.no_such_agent' is not registered in this process: a worker only "
        "claims runs of agents it has; check that a worker with 'tests.no_such_agent' "
        "deployed serves queue 'mail'")


def test_runs_that_are_not_queued_say_their_status() -> None:
    run = enqueue("tests.noop")
    running = claim()
    [hold] = why(run)
    assert hold.code == NOT_QUEUED
    assert f"is running, not queued (attempt 1, worker {running.claimed_by}" in hold.message
    assert "lease until" in hold.message
    lapsed = why_not_started(run.pk, at=timezone.now() + timedelta(seconds=5))
    assert "lease lapsed" in lapsed[0].message

    transitions.settle_succeeded(AttemptRef(run.pk, 1, "w-test", 2.0), None)
    [hold] = why(run)
    assert hold.message == f"run #{run.pk} is succeeded, not queued (completed)"
    assert why_command(run.pk).strip().endswith("(completed)")


# --------------------------------------------------------------------------- the command


def test_the_command_refuses_a_missing_or_malformed_run_id() -> None:
    with pytest.raises(CommandError, match="No run with id 999"):
        call_command("why", "999")
    with pytest.raises(CommandError, match="must be a whole number"):
        call_command("why", "abc")
