"""Fairness groups over a run's life: a run made from another (a fork, an operator's retry,
a spawned child) keeps its tenant's `fair_key`, and groups left without a queued, waiting
or running run are deleted by the reaper's pass, race-free with enqueues and claims, and
without letting a tenant that comes back take more than its share."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from django_agentruns import enqueue, enqueue_many, fork, retry, transitions
from django_agentruns.api import RunRequest, build_new_run
from django_agentruns.models import AgentRun, FairGroup, Status
from django_agentruns.outcomes import AttemptRef
from django_agentruns.runtime.reaper import reap

pytestmark = pytest.mark.django_db(transaction=True)
SCOPES = transitions.ScopePolicy()


def claim(n: int, fair: bool = True) -> list[AgentRun]:
    return transitions.claim("w", ["default"], n, SCOPES, {}, 60.0, include_lapsed=False,
                             fair=fair)


def flood(tenant: str, n: int) -> list[AgentRun]:
    return enqueue_many([{"agent": "tests.tenant", "input": {"tenant": tenant}}
                         for _ in range(n)])


def drain(batches: int, size: int = 8) -> list[str]:
    return [r.fair_key for _ in range(batches) for r in claim(size)]


def groups() -> set[str]:
    return set(FairGroup.objects.values_list("key", flat=True))


def finish(tenant: str) -> None:
    """The tenant's runs end (how is beside the point here)."""
    AgentRun.objects.filter(fair_key=tenant).update(status=Status.SUCCEEDED,
                                                    finished_at=timezone.now())


# --------------------------------------------------------------------------- runs from runs


def test_a_fork_keeps_its_origins_fair_key_and_rejoins_its_group() -> None:
    origin = enqueue("tests.tenant", {"tenant": "t1"})
    pinned = enqueue("tests.noop", fair_key="t9")
    finish("t1")
    finish("t9")
    assert transitions.drop_idle_groups() == 3  # t1, t9 and the queue's "" group
    assert groups() == set()
    copy = fork(origin.pk)
    assert copy.fair_key == "t1"
    assert groups() == {"t1", ""}  # a fork joins its group as a new run does
    assert fork(pinned.pk).fair_key == "t9"  # an enqueue's own key, kept as it was
    assert fork(origin.pk, input={"tenant": "t2"}).fair_key == "t2"  # the agent's callable
    assert fork(pinned.pk, input={"x": 1}).fair_key == "t9"  # no callable: the origin's
    assert fork(origin.pk, agent="tests.noop").fair_key == "t1"  # another agent: kept
    started = {r.pk: r.fair_key for r in claim(10)}  # the fair claim finds every fork
    assert Counter(started.values()) == {"t1": 2, "t9": 2, "t2": 1}
    assert copy.pk in started


def test_a_retried_run_keeps_its_fair_key_and_its_group_comes_back() -> None:
    (run,) = flood("A", 1)
    transitions.cancel(run.pk)
    assert transitions.drop_idle_groups() == 2
    assert retry(run.pk)
    assert AgentRun.objects.get(pk=run.pk).fair_key == "A"
    assert groups() == {"A", ""}
    assert [r.pk for r in claim(4)] == [run.pk]


def test_a_child_without_a_fair_key_of_its_own_takes_its_parents() -> None:
    flood("A", 1)
    (parent,) = claim(1)
    ref = AttemptRef(parent.pk, parent.attempt, "w", 60.0)
    at = timezone.now()
    plain = build_new_run(RunRequest("tests.noop"), at, {})
    own = build_new_run(RunRequest("tests.tenant", {"tenant": "B"}), at, {})
    _, inherits = transitions.children.spawn(ref, "plain", plain)
    _, keeps = transitions.children.spawn(ref, "own", own)
    assert AgentRun.objects.get(pk=inherits).fair_key == "A"
    assert AgentRun.objects.get(pk=keeps).fair_key == "B"


# --------------------------------------------------------------------------- idle groups


def test_only_groups_without_a_live_run_are_deleted_in_bounded_batches() -> None:
    for tenant in ("queued", "running", "waiting", "done1", "done2", "done3"):
        flood(tenant, 1)
    AgentRun.objects.filter(fair_key="running").update(status=Status.RUNNING)
    AgentRun.objects.filter(fair_key="waiting").update(status=Status.WAITING)
    for tenant in ("done1", "done2", "done3"):
        finish(tenant)
    enqueue("tests.noop")  # a run without a key keeps the queue's "" group
    assert transitions.drop_idle_groups(limit=2) == 2  # a batch at a time
    assert transitions.drop_idle_groups(limit=2) == 1
    assert transitions.drop_idle_groups(limit=2) == 0
    assert groups() == {"queued", "running", "waiting", ""}


def test_the_reaper_pass_deletes_idle_groups() -> None:
    flood("A", 1)
    finish("A")
    report = reap()
    assert report.groups_dropped == 2
    assert not FairGroup.objects.exists()


def test_a_tenant_whose_group_was_deleted_comes_back_level_not_ahead() -> None:
    """The flooding tenant is never deleted (it has queued runs); a quiet one that comes
    back starts at the queue's frontier: it takes its share from then on, and neither a
    backlog owed nor a reset lets it hold the claims."""
    flood("A", 400)
    flood("B", 20)
    drain(4)
    finish("B")
    transitions.drop_idle_groups()
    assert groups() == {"A", ""}  # B went; A has queued runs ("" lives with its queue)
    drain(10)  # A alone for a while: its time runs far ahead of where B's was
    flood("B", 10)
    after = drain(3)
    assert after.count("B") == 10, after  # B's late runs within the next 24 starts
    # The reverse: A's runs all end and its group goes, B has a backlog, then A floods
    # again. A comes back level with B, not at 0 (where it would be owed every start).
    finish("A")
    flood("B", 100)
    drain(2)
    transitions.drop_idle_groups()
    assert groups() == {"B", ""}
    head = AgentRun.objects.filter(status=Status.QUEUED).order_by("fair_vstart").first()
    (first, *_) = flood("A", 300)
    assert head is not None
    assert head.fair_key == "B"
    assert AgentRun.objects.get(pk=first.pk).fair_vstart == head.fair_vstart
    shares = Counter(drain(5))
    assert 16 <= shares["B"] <= 24, shares  # half of 40 starts, one claim's slack


# --------------------------------------------------------------------------- races


pg_only = pytest.mark.skipif("connection.vendor != 'postgresql'")


def _waiting_on_locks() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                       "current_database() AND wait_event_type = 'Lock'")
        return int(cursor.fetchone()[0])


@pg_only
def test_a_group_joined_by_an_uncommitted_enqueue_is_not_deleted() -> None:
    flood("A", 1)
    finish("A")
    joined, release, done = threading.Event(), threading.Event(), threading.Event()

    def enqueuer() -> None:
        try:
            with transaction.atomic():
                flood("A", 1)  # joins the existing group, locks it, inserts its run
                joined.set()
                release.wait(30)
        finally:
            connections.close_all()
            done.set()

    thread = threading.Thread(target=enqueuer)
    thread.start()
    assert joined.wait(30)
    try:
        # The sweep's snapshot sees no live run of A, but the group is locked: skipped.
        assert transitions.drop_idle_groups() == 0
    finally:
        release.set()
        thread.join(30)
    assert done.is_set()
    transitions.drop_idle_groups()
    assert groups() == {"A", ""}  # committed: A has a queued run, in the "" group's queue
    assert [r.fair_key for r in claim(2)] == ["A"]


@pg_only
def test_an_enqueue_that_waits_on_a_sweep_inserts_the_deleted_group_again() -> None:
    """The sweep locked the group first (FOR UPDATE) and deletes it; the enqueue waiting
    on that lock finds the row gone and inserts it again, so its run is claimed fairly."""
    flood("A", 1)
    finish("A")
    locked, delete, done = threading.Event(), threading.Event(), threading.Event()
    table = connection.ops.quote_name(FairGroup._meta.db_table)

    def sweep() -> None:  # drop_idle_groups' two steps, held open in between
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(f"SELECT id FROM {table} WHERE key = 'A' FOR UPDATE")
                locked.set()
                delete.wait(30)
                cursor.execute(f"DELETE FROM {table} WHERE key = 'A'")
        finally:
            connections.close_all()
            done.set()

    enqueued: list[AgentRun] = []

    def enqueuer() -> None:
        try:
            enqueued.extend(flood("A", 1))
        finally:
            connections.close_all()

    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    assert locked.wait(30)
    joiner = threading.Thread(target=enqueuer)
    joiner.start()
    try:
        from tests import helpers
        helpers.wait_until(_waiting_on_locks, timeout=30, message="the enqueue to wait")
    finally:
        delete.set()
        sweeper.join(30)
        joiner.join(30)
    assert done.is_set()
    assert len(enqueued) == 1
    assert groups() == {"A", ""}
    assert [r.pk for r in claim(2)] == [enqueued[0].pk]


@pg_only
def test_a_claim_never_waits_on_the_groups_sweep() -> None:
    """The claim reads and writes no group row (the order is in the runs' stamps): a sweep
    holding a group's lock between its lock and its delete does not hold up a claim."""
    flood("A", 20)
    flood("B", 1)
    finish("B")
    locked, delete = threading.Event(), threading.Event()
    table = connection.ops.quote_name(FairGroup._meta.db_table)

    def sweep() -> None:  # drop_idle_groups, held open between its lock and its delete
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(f"SELECT id FROM {table} FOR UPDATE")
                locked.set()
                delete.wait(30)
                cursor.execute(f"DELETE FROM {table} WHERE key = 'B'")
        finally:
            connections.close_all()

    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    assert locked.wait(30)
    try:
        started = claim(4)  # every group row locked: done all the same, in this thread
    finally:
        delete.set()
        sweeper.join(30)
    assert [r.fair_key for r in started] == ["A"] * 4
    assert groups() == {"A", ""}
