"""Fair shares' virtual starts: stamped at enqueue in the INSERT (per queue, priority and
group, 1/weight apart, never before the queue's frontier), kept by a requeued run, given
to a fork, kept from going back by the queue's clock, and given by migration 0022 to the
runs queued before it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_agentruns import enqueue, enqueue_many, fork, retry, transitions
from django_agentruns.models import AgentRun, FairGroup, Status
from django_agentruns.runtime.reaper import reap
from django_agentruns.transitions.fair import FairClaim

pytestmark = pytest.mark.django_db(transaction=True)
SCOPES = transitions.ScopePolicy()


def claim(n: int, queue: str = "default") -> list[AgentRun]:
    return transitions.claim("w", [queue], n, SCOPES, {}, 60.0, include_lapsed=False,
                             fair=True)


def flood(tenant: str, n: int, **request: Any) -> list[AgentRun]:
    return enqueue_many([{"agent": "tests.tenant", "input": {"tenant": tenant}, **request}
                         for _ in range(n)])


def stamps(runs: list[AgentRun]) -> list[float]:
    by_id = dict(AgentRun.objects.filter(pk__in=[r.pk for r in runs])
                 .values_list("pk", "fair_vstart"))
    return [by_id[r.pk] for r in runs]


def clock(queue: str = "default") -> float:
    return FairGroup.objects.get(queue=queue, key="").vtime


def test_one_batch_is_stamped_per_queue_priority_and_group() -> None:
    runs = enqueue_many([
        {"agent": "tests.tenant", "input": {"tenant": "A"}},
        {"agent": "tests.tenant", "input": {"tenant": "B"}},
        {"agent": "tests.tenant", "input": {"tenant": "A"}},
        {"agent": "tests.tenant", "input": {"tenant": "A"}, "priority": 5},
        {"agent": "tests.tenant", "input": {"tenant": "A"}, "queue": "other"},
        {"agent": "tests.noop"},
        {"agent": "tests.noop"},
        {"agent": "tests.tenant", "input": {"tenant": "A"}},
    ])
    # Each group's first run at the frontier (an empty queue: 0), each next one 1 later:
    # no row of the statement sees another's stamp.
    assert stamps(runs) == [0, 0, 1, 0, 0, 0, 1, 2]
    more = flood("A", 2)
    assert stamps(more) == [3, 4]  # after the group's last queued stamp


def test_a_requeued_run_keeps_its_stamp_and_comes_back_ahead_of_its_groups_backlog() -> None:
    flood("A", 30)
    (first, *_) = claim(8)
    AgentRun.objects.filter(pk=first.pk).update(
        lease_expires=timezone.now() - timedelta(seconds=1))
    assert first.pk in reap().requeued  # its worker is gone: queued again
    again = AgentRun.objects.get(pk=first.pk)
    assert (again.status, again.fair_vstart) == (Status.QUEUED, 0)
    assert [r.pk for r in claim(1)] == [first.pk]


def test_a_delayed_run_is_stepped_over_until_due_then_goes_by_its_stamp() -> None:
    (later,) = flood("A", 1, run_after=timedelta(hours=1))
    flood("A", 10)
    assert later.pk not in {r.pk for r in claim(8)}
    AgentRun.objects.filter(pk=later.pk).update(available_at=timezone.now())
    assert [r.pk for r in claim(1)] == [later.pk]  # stamp 0: first once due


def test_a_new_group_starts_where_the_claims_have_reached() -> None:
    flood("A", 20)  # stamps 0..19
    claim(8)  # 0..7 running
    (b,) = flood("B", 1)
    assert stamps([b]) == [8]  # level with A's next, not ahead of A's running ones


def test_a_run_that_cannot_start_does_not_pull_newcomers_ahead_of_a_flood() -> None:
    (_later,) = flood("A", 1, run_after=timedelta(hours=1))  # stamp 0, not due
    flood("A", 30)  # stamps 1..30
    claim(8)
    claim(8)
    claim(8)  # 1..24 running
    late = flood("B", 8)
    assert stamps(late)[0] == 25  # level with A's next, not back at the delayed run's 0
    assert [r.fair_key for r in claim(8)].count("B") <= 5  # in turns with A (B ties first)


def test_the_reaper_raises_the_queue_clock_so_stamps_never_go_back() -> None:
    flood("A", 20)  # stamps 0..19
    claim(8)
    claim(2)  # 0..9 running
    assert clock() == 0
    report = reap()
    assert report.clocks_raised >= 1
    assert clock() == 10  # the lowest due stamp (above the highest running: 9)
    claim(10)
    AgentRun.objects.filter(status=Status.RUNNING).update(
        status=Status.SUCCEEDED, finished_at=timezone.now())  # the queue is idle now
    (late,) = flood("B", 1)
    assert stamps([late]) == [10]  # from the clock, not from 0


def test_an_operators_retry_is_stamped_afresh() -> None:
    (old,) = flood("A", 1)
    AgentRun.objects.filter(pk=old.pk).update(status=Status.FAILED, fair_vstart=5000,
                                              finished_at=timezone.now())
    transitions.drop_idle_groups()  # the queue had no live run: its clock went
    flood("B", 3)  # stamps 0, 1, 2 again
    assert retry(old.pk)
    assert stamps([old]) == [0]  # level with B's head, not 5,000 starts behind
    assert old.pk in {r.pk for r in claim(2)}


def test_fair_order_turns_off_when_the_last_keyed_group_goes() -> None:
    flood("A", 1)
    assert FairClaim(refresh=0).on()
    AgentRun.objects.filter(fair_key="A").update(status=Status.SUCCEEDED,
                                                 finished_at=timezone.now())
    enqueue("tests.noop")  # the queue stays live: its "" row (the clock) stays
    reap()
    assert set(FairGroup.objects.values_list("key", flat=True)) == {""}
    assert not FairClaim(refresh=0).on()


def test_a_queue_without_fair_keys_gets_a_clock_once_fairness_is_on() -> None:
    (before,) = enqueue_many([{"agent": "tests.noop", "queue": "plain"}])
    reap()
    assert not FairGroup.objects.exists()  # fairness off: the reaper adds nothing
    flood("A", 1)
    plain = enqueue_many([{"agent": "tests.noop", "queue": "plain"} for _ in range(5)])
    # Unstamped before, stamped once fairness is on (after the group's last: 0).
    assert stamps([before, *plain]) == [0, 1, 2, 3, 4, 5]
    claim(4, queue="plain")
    reap()
    assert clock("plain") == 4


def test_without_fair_shares_enqueue_writes_no_stamp_and_turning_them_on_keeps_age_order(
) -> None:
    old = enqueue_many([{"agent": "tests.noop"} for _ in range(3)])
    with CaptureQueriesContext(connection) as plain:
        old.append(enqueue("tests.noop"))
    insert = plain.captured_queries[-1]["sql"].split("RETURNING")[0]
    assert "fair_vstart" not in insert  # the plain statement: the column's default
    assert stamps(old) == [0, 0, 0, 0]
    (a,) = flood("A", 1)
    assert [r.pk for r in claim(5)] == [*(r.pk for r in old), a.pk]  # the old ones first


def test_a_fork_is_stamped_as_a_new_run_of_its_group() -> None:
    origin = enqueue("tests.tenant", {"tenant": "A"})
    flood("A", 9)  # stamps 1..9
    claim(4)
    copy = fork(origin.pk)
    assert copy is not None
    assert stamps([copy]) == [10]


# --------------------------------------------------------------------------- migration 0022

RUNS = AgentRun._meta.db_table


def insert_queued(cursor: Any, fair_key: str, priority: int, minutes_ago: int) -> int:
    """A queued run row as migration 0021 left the table (no stamp column yet; after 0022,
    an INSERT that names no stamp)."""
    at = timezone.now() - timedelta(minutes=minutes_ago)
    cursor.execute(
        f"INSERT INTO {RUNS} (agent, queue, priority, scope, fired_seq, status, reason, "
        "attempt, requeue_count, max_requeues, claimed_by, available_at, limit_key, fair_key, "
        "snooze_count, input_tokens, output_tokens, cost, checkpoint_count, agent_version, "
        "cancel_reason, error_type, error_message, created_at, wait_key, spawn_key, "
        "dedupe_key, steps_copied, release_dedupe_at_start) VALUES ('tests.tenant', "
        "'default', %s, '', 0, 'queued', '', 0, 0, 3, '', %s, '', %s, 0, 0, 0, 0.0, 0, 1, "
        "'', '', '', %s, '', '', '', %s, %s)",
        [priority, at, fair_key, at, False, False])
    cursor.execute(f"SELECT max(id) FROM {RUNS}")
    return int(cursor.fetchone()[0])


def test_migration_0022_stamps_the_queued_runs_in_the_order_the_fair_claim_took_them() -> None:
    call_command("migrate", "django_agentruns", "0021", verbosity=0)
    try:
        with connection.cursor() as cursor:
            a_new = insert_queued(cursor, "A", 0, 1)
            a_old = insert_queued(cursor, "A", 0, 5)
            b = insert_queued(cursor, "B", 0, 3)
            urgent = insert_queued(cursor, "A", 5, 2)
            cursor.execute(f"INSERT INTO {FairGroup._meta.db_table} (queue, key, vtime) "
                           "VALUES ('default', 'B', 7.5)")
    finally:
        call_command("migrate", "django_agentruns", verbosity=0)
    got = dict(AgentRun.objects.values_list("pk", "fair_vstart"))
    assert got == {a_old: 1, a_new: 2, b: 8.5, urgent: 1}
    assert [r.pk for r in claim(4)] == [urgent, a_old, a_new, b]


def test_an_insert_that_names_no_stamp_still_succeeds() -> None:
    """An older worker's INSERT, mid-deploy, knows no stamp: the database default fills it."""
    with connection.cursor() as cursor:
        pk = insert_queued(cursor, "A", 0, 0)
    assert AgentRun.objects.get(pk=pk).fair_vstart == 0
