"""`AgentRun.objects`'s named reads, each asked directly: what a dead letter, a finished run,
a lapsed lease, a due run and a blocked run are, on both engines."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_agentruns.models import AgentRun, Reason, Status
from django_agentruns.outcomes import ScopePolicy
from django_agentruns.queries import RunQuerySet, dead_letter, holding_statuses
from django_agentruns.registry import scope_policy

pytestmark = pytest.mark.django_db

AT = timezone.now()
ORDERED = "tests.ordered"
BLOCKING = "tests.ordered_blocking"
# The same split as the registry's (checked below), spelled out so each test reads alone.
SCOPES = ScopePolicy(ordered=frozenset({ORDERED, BLOCKING}),
                     dead_letters_block=frozenset({BLOCKING}))


def row(status: str = Status.QUEUED, reason: str = "", **fields: Any) -> AgentRun:
    """A run row as it stands in the table (made directly: these tests only read)."""
    fields.setdefault("agent", "tests.noop")
    fields.setdefault("queue", "default")
    fields.setdefault("available_at", AT - timedelta(seconds=1))
    return AgentRun.objects.create(status=status, reason=reason, **fields)


def ids(qs: RunQuerySet) -> set[int]:
    return set(qs.values_list("pk", flat=True))


def test_the_manager_is_a_run_queryset_and_reads_chain() -> None:
    dead = row(Status.FAILED, Reason.NOT_RETRYABLE, queue="mail")
    row(Status.FAILED, Reason.NOT_RETRYABLE, queue="default")
    assert isinstance(AgentRun.objects.all(), RunQuerySet)
    assert ids(AgentRun.objects.filter(queue="mail").dead_letters()) == {dead.pk}
    assert ids(AgentRun.objects.dead_letters().filter(queue="mail")) == {dead.pk}


def test_terminal_is_succeeded_failed_or_cancelled() -> None:
    finished = {row(Status.SUCCEEDED, Reason.COMPLETED).pk,
                row(Status.FAILED, Reason.RETRIES_EXHAUSTED).pk,
                row(Status.FAILED, Reason.ERROR).pk,
                row(Status.CANCELLED, Reason.CANCELLED).pk}
    row(Status.QUEUED)
    row(Status.RUNNING, lease_expires=AT + timedelta(seconds=30))
    assert ids(AgentRun.objects.terminal()) == finished


def test_dead_letters_are_failed_for_a_dead_letter_reason_only() -> None:
    dead = {row(Status.FAILED, Reason.RETRIES_EXHAUSTED).pk,
            row(Status.FAILED, Reason.NOT_RETRYABLE).pk}
    others = [row(Status.FAILED, Reason.ERROR),  # an interactive run's failure: its caller saw it
              row(Status.CANCELLED, Reason.CANCELLED), row(Status.SUCCEEDED, Reason.COMPLETED),
              row(Status.QUEUED), row(Status.QUEUED, Reason.RETRIES_EXHAUSTED)]
    assert ids(AgentRun.objects.dead_letters()) == dead
    # The Q form (retention composes it) and a loaded row's property say the same.
    assert ids(AgentRun.objects.filter(dead_letter())) == dead
    assert ids(AgentRun.objects.exclude(dead_letter())) == {run.pk for run in others}
    assert {run.pk for run in AgentRun.objects.all() if run.is_dead_letter} == dead


def test_lapsed_is_running_with_a_lease_that_ended_before_the_time_given() -> None:
    lapsed = row(Status.RUNNING, lease_expires=AT - timedelta(seconds=1), claimed_by="gone")
    elsewhere = row(Status.RUNNING, lease_expires=AT - timedelta(seconds=1), queue="mail")
    ending_now = row(Status.RUNNING, lease_expires=AT)  # not lapsed yet: the test is strict
    alive = row(Status.RUNNING, lease_expires=AT + timedelta(seconds=5))
    row(Status.RUNNING, lease_expires=None)  # interactive (run_now): holds no lease
    row(Status.QUEUED, lease_expires=AT - timedelta(seconds=60))
    row(Status.SUCCEEDED, Reason.COMPLETED, lease_expires=AT - timedelta(seconds=60))

    assert ids(AgentRun.objects.lapsed(AT)) == {lapsed.pk, elsewhere.pk}
    assert ids(AgentRun.objects.lapsed(AT, ["default"])) == {lapsed.pk}
    assert ids(AgentRun.objects.lapsed(AT, [])) == set()
    assert ids(AgentRun.objects.lapsed(AT + timedelta(seconds=10))) == \
        {lapsed.pk, elsewhere.pk, ending_now.pk, alive.pk}


def test_due_is_queued_in_the_queues_and_due_by_the_time_given() -> None:
    due = {row(available_at=AT).pk, row(available_at=AT - timedelta(hours=1)).pk,
           row(queue="mail").pk}
    later = row(available_at=AT + timedelta(seconds=1))
    row(queue="other")
    row(Status.RUNNING, lease_expires=AT - timedelta(seconds=1))
    row(Status.FAILED, Reason.NOT_RETRYABLE)

    assert ids(AgentRun.objects.due(["default", "mail"], AT)) == due
    assert ids(AgentRun.objects.due(["default", "mail"], AT + timedelta(seconds=1))) == \
        due | {later.pk}


def scope(agent: str, *statuses: str, scope: str = "s") -> list[AgentRun]:
    """One run per status in `scope`, in firing order (fired_seq 1, 2, ...)."""
    return [row(status, Reason.NOT_RETRYABLE if status == Status.FAILED else "", agent=agent,
                scope=scope, fired_seq=seq,
                lease_expires=AT + timedelta(seconds=30) if status == Status.RUNNING else None)
            for seq, status in enumerate(statuses, start=1)]


@pytest.mark.parametrize(("ahead", "held_for_plain", "held_for_blocking"), [
    (Status.QUEUED, True, True),
    (Status.RUNNING, True, True),
    (Status.FAILED, False, True),  # a dead letter holds the scope only where the agent says
    (Status.SUCCEEDED, False, False),
    (Status.CANCELLED, False, False),
])
def test_blocked_is_queued_behind_a_run_that_holds_its_scope(
        ahead: str, held_for_plain: bool, held_for_blocking: bool) -> None:
    _, plain = scope(ORDERED, ahead, Status.QUEUED)
    _, blocking = scope(BLOCKING, ahead, Status.QUEUED)
    expected = {plain.pk} if held_for_plain else set()
    expected |= {blocking.pk} if held_for_blocking else set()
    assert ids(AgentRun.objects.blocked(SCOPES)) == expected


def test_blocked_heads_other_scopes_unordered_agents_and_ties() -> None:
    head, behind = scope(ORDERED, Status.QUEUED, Status.QUEUED)
    [other_scope] = scope(ORDERED, Status.QUEUED, scope="t")
    unordered = scope("tests.noop", Status.QUEUED, Status.QUEUED)
    # Equal fired_seq: the lower id fires first, so only the later row is blocked.
    tie_first = row(agent=ORDERED, scope="u", fired_seq=7)
    tie_second = row(agent=ORDERED, scope="u", fired_seq=7)
    # Blocked whatever its due time: the admin lists it before it comes due.
    future = row(agent=ORDERED, scope="s", fired_seq=3, available_at=AT + timedelta(hours=1))

    blocked = ids(AgentRun.objects.blocked(SCOPES))
    assert blocked == {behind.pk, tie_second.pk, future.pk}
    assert not blocked & {head.pk, other_scope.pk, tie_first.pk, *(r.pk for r in unordered)}
    # With no ordered agent nothing is blocked, and the read still runs.
    assert ids(AgentRun.objects.blocked(ScopePolicy())) == set()


def test_startable_and_blocked_split_the_due_runs() -> None:
    for agent in (ORDERED, BLOCKING, "tests.noop"):
        for status in (Status.QUEUED, Status.RUNNING, Status.FAILED, Status.SUCCEEDED):
            scope(agent, status, Status.QUEUED, Status.QUEUED, scope=f"{agent}-{status}")
    due = AgentRun.objects.due(["default"], AT)
    startable = ids(due.startable(SCOPES))
    blocked = ids(due.blocked(SCOPES))
    assert startable
    assert blocked
    assert startable | blocked == ids(due)
    assert not startable & blocked


def test_awaited_leaves_out_runs_held_by_a_backoff_or_a_blocking_dead_letter() -> None:
    _, behind_running = scope(ORDERED, Status.RUNNING, Status.QUEUED, scope="a")
    _, behind_plain_dead = scope(ORDERED, Status.FAILED, Status.QUEUED, scope="b")
    _, behind_dead = scope(BLOCKING, Status.FAILED, Status.QUEUED, scope="c")
    backing_off = row(agent=ORDERED, scope="d", fired_seq=1, available_at=AT + timedelta(hours=1))
    behind_backoff = row(agent=ORDERED, scope="d", fired_seq=2)
    free = row()
    # A waiting run holds its scope until someone delivers: no worker gets past it alone.
    _, behind_waiting = scope(ORDERED, Status.WAITING, Status.QUEUED, scope="e")

    awaited = ids(AgentRun.objects.awaited(["default"], AT, SCOPES))
    assert awaited == {behind_running.pk, behind_plain_dead.pk, free.pk}
    assert not awaited & {behind_dead.pk, backing_off.pk, behind_backoff.pk,
                          behind_waiting.pk}


def test_ahead_of_and_holding_find_the_scopes_holder() -> None:
    done, dead, first_queued, run = scope(BLOCKING, Status.SUCCEEDED, Status.FAILED,
                                          Status.QUEUED, Status.QUEUED)
    scope(BLOCKING, Status.QUEUED, scope="t")
    ahead = AgentRun.objects.ahead_of(run.agent, run.scope, run.fired_seq, run.pk)
    assert ids(ahead) == {done.pk, dead.pk, first_queued.pk}
    assert ids(ahead.holding(True)) == {dead.pk, first_queued.pk}
    assert ids(ahead.holding(False)) == {first_queued.pk}
    assert holding_statuses(False) == [Status.QUEUED, Status.RUNNING, Status.WAITING]
    assert holding_statuses(True) == [Status.QUEUED, Status.RUNNING, Status.WAITING,
                                      Status.FAILED]


def test_the_registrys_scope_policy_is_the_split_these_reads_take() -> None:
    scopes = scope_policy()
    assert {ORDERED, BLOCKING} <= scopes.ordered
    assert BLOCKING in scopes.dead_letters_block
    assert ORDERED not in scopes.dead_letters_block
    assert "tests.noop" not in scopes.ordered
