"""A worker claims only runs of agents it has; the others wait for a worker that has them.

In a rolling deploy new code enqueues runs of a new agent while workers of the old code
still serve the queue. Those workers leave the new agent's runs queued (due or with a
lapsed lease) instead of dead-lettering them, a burst worker does not wait on them, and a
worker of the new code runs them. Worker processes of the old code are started with the
agent unregistered (`AGENTRUNS_TEST_HIDE_AGENTS`, see tests/testapp/apps.py).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta

import pytest
from django.db import connection
from django.utils import timezone

from django_agentruns import RunRequest, enqueue, enqueue_many, transitions
from django_agentruns.models import AgentRun, RunEvent, Status
from django_agentruns.registry import all_agents
from django_agentruns.runtime.worker import Worker, scope_policy
from django_agentruns.transitions import due
from tests import helpers
from tests.testapp.models import SideEffect

NEW = "tests.once"  # the agent the old code lacks
OLD = frozenset({"tests.noop", "tests.ordered"})
TTL = 2.0


def claim(agents: frozenset[str] | None, limit: int = 10, *, at: datetime | None = None,
          worker: str = "w") -> list[AgentRun]:
    return transitions.claim(worker, ["default"], limit, scope_policy(), {}, TTL, at,
                             agents=agents)


def event_types(run: AgentRun) -> list[str]:
    return list(RunEvent.objects.filter(run_id=run.pk).values_list("type", flat=True))


def old_code(env: dict[str, str], **settings: object) -> dict[str, str]:
    """The environment of a worker process of the code before `NEW` existed."""
    return {**env, "AGENTRUNS_TEST_HIDE_AGENTS": NEW,
            "AGENTRUNS_TEST_SETTINGS": json.dumps(settings)}


# --------------------------------------------------------------------------- the claim


@pytest.mark.django_db
def test_a_claim_takes_only_runs_of_the_given_agents_in_claim_order() -> None:
    # The new agent's runs come first in claim order, so the claim must look past them.
    first_new = enqueue(NEW, priority=5)
    old = enqueue_many([RunRequest("tests.noop", {"n": i}) for i in range(3)])
    enqueue(NEW)
    taken = claim(OLD, limit=10)
    assert [r.pk for r in taken] == [r.pk for r in old]
    assert set(AgentRun.objects.filter(agent=NEW).values_list("status", "attempt")) == {
        (Status.QUEUED, 0)}
    assert event_types(first_new) == []
    # A claim for any agent (None, the default) and one for the new agent take them.
    assert [r.agent for r in claim(frozenset({NEW}), limit=1)] == [NEW]
    assert [r.agent for r in claim(None)] == [NEW]


@pytest.mark.django_db
def test_ordered_agents_keep_their_order_among_the_runs_a_claim_may_take() -> None:
    enqueue(NEW, priority=9)
    head = enqueue("tests.ordered", scope="s", fired_seq=0)
    enqueue("tests.ordered", scope="s", fired_seq=1)
    assert [r.pk for r in claim(OLD)] == [head.pk]  # one per scope, and none of NEW's


@pytest.mark.django_db
def test_a_worker_with_no_agents_claims_nothing() -> None:
    enqueue("tests.noop")
    assert claim(frozenset()) == []
    assert AgentRun.objects.get().status == Status.QUEUED


@pytest.mark.django_db
def test_a_lapsed_run_is_taken_back_only_by_a_claim_that_has_its_agent() -> None:
    long_ago = timezone.now() - timedelta(seconds=60)
    run = enqueue(NEW, run_after=long_ago)
    [held] = claim(None, at=long_ago, worker="gone-worker")
    assert held.pk == run.pk
    assert claim(OLD) == []
    run.refresh_from_db()
    assert (run.status, run.claimed_by, run.attempt) == (Status.RUNNING, "gone-worker", 1)

    [taken] = claim(frozenset({NEW}))
    assert (taken.pk, taken.attempt, taken.claimed_by) == (run.pk, 2, "w")


@pytest.mark.django_db
def test_the_agent_filter_is_one_no_index_on_agent_can_serve() -> None:
    """The claim order is the due index's; `agentruns_scope_head` starts with `agent`, and a
    planner without statistics took it for a plain `agent IN (...)`, then sorted the
    whole backlog on every claim."""
    sql = due.compiled_due(connection.vendor, ("default",), scope_policy(), 32, ids_only=True,
                           agents=OLD).sql
    qn = connection.ops.quote_name
    column = f"{qn(AgentRun._meta.db_table)}.{qn('agent')}"
    if connection.vendor == "postgresql":
        assert f"array_position(%s::text[], {column}) IS NOT NULL" in sql
    else:
        assert f"+{column} IN (%s, %s)" in sql


@pytest.mark.postgres_only
@pytest.mark.django_db
def test_the_claim_with_an_agent_filter_stays_on_the_due_index() -> None:
    """Also on statistics taken while every run was another agent's, before a burst of
    the worker's own: they made a plain `agent IN (...)` look so selective that the
    planner took the scope-head index and sorted all 2,000 runs for each claim."""
    table = AgentRun._meta.db_table
    with connection.cursor() as cursor:
        # Compact indexes, as a young table has: the suite's rolled-back inserts leave the
        # test database's indexes bloated by however many tests ran before, which moved
        # the planner's choice from run to run (rolled back with the test).
        cursor.execute(f"REINDEX TABLE {table}")
    AgentRun.objects.bulk_create([AgentRun(agent=NEW, queue="default", status=status)
                                  for status in [Status.SUCCEEDED] * 2000 + [Status.QUEUED] * 50])
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table}")
    enqueue_many([RunRequest("tests.noop", {"n": i}) for i in range(2000)])
    enqueue_many([RunRequest(NEW, {"n": i}, priority=1) for i in range(200)])
    old_worker = frozenset(all_agents()) - {NEW}  # as many agents as a real worker has
    compiled = due.compiled_due("postgresql", ("default",), scope_policy(), 32, ids_only=True,
                                agents=old_worker)
    with connection.cursor() as cursor:
        for analyzed in (False, True):
            if analyzed:
                cursor.execute(f"ANALYZE {table}")
            cursor.execute("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + compiled.sql,
                           compiled.bind(timezone.now()))
            plan = "\n".join(row[0] for row in cursor.fetchall())
            assert "Index Scan using agentruns_due" in plan, (analyzed, plan)
            assert "Sort" not in plan, plan
            assert "Rows Removed by Filter: 250" in plan, plan  # read past, not sorted


# --------------------------------------------------------------------------- burst workers


def test_a_burst_worker_exits_past_runs_of_agents_it_lacks(
        transactional_db: None, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing it could wait for: it says what it left, and leaves it queued."""
    orphans = [AgentRun.objects.create(agent="tests.not_registered", queue="default")
               for _ in range(2)]
    fine = enqueue("tests.noop")

    worker = Worker(burst=True, reap_interval=0, max_contention_wait=2)
    with caplog.at_level(logging.WARNING, logger="django_agentruns.worker"):
        worker.run(install_signals=False)  # no ContentionTimeout
    assert worker.stats.claimed == 1
    assert AgentRun.objects.get(pk=fine.pk).status == Status.SUCCEEDED
    for orphan in orphans:
        orphan.refresh_from_db()
        assert (orphan.status, orphan.attempt, orphan.reason) == (Status.QUEUED, 0, "")
    assert ("leaving 2 due runs of agents this worker does not have (tests.not_registered)"
            in caplog.text)


@pytest.mark.slow
def test_a_burst_worker_process_leaves_a_run_of_an_unknown_agent_queued(
    worker_env: dict[str, str],
) -> None:
    # Written directly: enqueue refuses unknown names, but a run may outlive its agent
    # (renamed or removed in a deploy), or come before it (a rolling deploy).
    orphan = AgentRun.objects.create(agent="tests.not_registered", queue="default",
                                     input={}, max_requeues=3)
    fine = enqueue("tests.once")

    done = helpers.run_manage(["runworker", "--burst"], worker_env)
    assert done.returncode == 0, done.stderr

    orphan.refresh_from_db()
    assert (orphan.status, orphan.attempt, orphan.requeue_count) == (Status.QUEUED, 0, 0)
    assert event_types(orphan) == []
    assert "leaving 1 due runs of agents this worker does not have" in done.stderr
    assert AgentRun.objects.get(pk=fine.pk).status == Status.SUCCEEDED


# --------------------------------------------------------------------------- rolling deploy


@pytest.mark.slow
def test_an_old_worker_leaves_a_new_agents_runs_to_a_new_worker(
    worker_env: dict[str, str],
) -> None:
    new_runs = enqueue_many([RunRequest(NEW, {"n": i}) for i in range(3)])
    old_runs = enqueue_many([RunRequest("tests.noop", {"n": i}) for i in range(3)])

    with helpers.start_manage(["runworker", "--concurrency", "2"], old_code(worker_env)) as old:
        helpers.wait_until(lambda: AgentRun.objects.filter(
            pk__in=[r.pk for r in old_runs], status=Status.SUCCEEDED).count() == 3,
            message=f"the old worker to run the runs it knows\n{old.output()}")
        # It has claimed again since (it claims until nothing it knows is due): the new
        # agent's runs are still there, untouched.
        assert set(AgentRun.objects.filter(agent=NEW).values_list("status", "attempt")) == {
            (Status.QUEUED, 0)}
        assert not RunEvent.objects.filter(run__agent=NEW).exists()

        # The new code's worker comes up beside the old one and runs them.
        with helpers.start_manage(["runworker"], worker_env) as new:
            helpers.wait_until(lambda: AgentRun.objects.filter(
                agent=NEW, status=Status.SUCCEEDED).count() == 3,
                message=f"the new worker to run the new agent's runs\n{new.output()}")
            assert new.stop() == 0
        assert old.stop() == 0
    for run in new_runs:
        run.refresh_from_db()
        assert run.attempt == 1
        assert event_types(run) == ["run.started", "run.succeeded"]
    assert set(SideEffect.objects.values_list("worker", flat=True)) == {str(new.pid)}


@pytest.mark.slow
def test_an_old_worker_leaves_a_new_agents_lapsed_run_to_a_new_worker(
    worker_env: dict[str, str],
) -> None:
    """The claim of a lapsed lease, too (the reaper, which runs no agent, may requeue it:
    off here, so only the claim could take it)."""
    long_ago = timezone.now() - timedelta(seconds=60)
    run = enqueue(NEW, run_after=long_ago)
    claim(None, at=long_ago, worker="gone-worker")  # its lease lapsed a minute ago
    marker = enqueue("tests.noop")

    with helpers.start_manage(["runworker"], old_code(worker_env, REAP_INTERVAL=0)) as old:
        # Its first claim looks for lapsed runs too, and takes the marker.
        helpers.wait_until(lambda: AgentRun.objects.get(pk=marker.pk).status
                           == Status.SUCCEEDED, message=f"the marker to run\n{old.output()}")
        assert old.stop() == 0
    run.refresh_from_db()
    assert (run.status, run.claimed_by, run.attempt) == (Status.RUNNING, "gone-worker", 1)

    new_env = {**worker_env, "AGENTRUNS_TEST_SETTINGS": json.dumps({"REAP_INTERVAL": 0})}
    with helpers.start_manage(["runworker"], new_env) as new:
        helpers.wait_until(lambda: AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED,
                           message=f"the new worker to take the lapsed run\n{new.output()}")
        assert new.stop() == 0
    run.refresh_from_db()
    assert run.attempt == 2
    assert event_types(run) == ["run.started", "run.abandoned", "run.retrying",
                                "run.started", "run.succeeded"]


@pytest.mark.slow
def test_why_in_a_process_without_the_agent_says_a_worker_with_it_must_serve_the_queue(
    worker_env: dict[str, str],
) -> None:
    run = enqueue(NEW, queue="mail")
    done = helpers.run_manage(["why", str(run.pk)], old_code(worker_env))
    assert done.returncode == 0, done.stderr
    assert (f"run #{run.pk} is queued and due, but its agent '{NEW}' is not registered in "
            f"this process: a worker only claims runs of agents it has, and no worker that "
            f"knows '{NEW}' has claimed it; check that a worker with '{NEW}' deployed serves "
            f"queue 'mail'") in done.stdout
