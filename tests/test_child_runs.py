"""Child runs: `ctx.spawn` once per key, `ctx.wait_for_runs`, cancel cascading to children.

Real worker processes: the parent waits without holding a slot while its children run.
"""

from __future__ import annotations

import pytest

from django_agentruns import (
    CancelResult,
    DeliverResult,
    approve,
    cancel,
    deliver,
    enqueue,
    transitions,
)
from django_agentruns.models import AgentRun, Reason, RunEvent, RunWait, Status
from django_agentruns.runtime.reaper import reap
from tests import helpers
from tests.test_waiting import status, until_status, worker


def children(parent_id: int) -> list[AgentRun]:
    return list(AgentRun.objects.filter(parent_id=parent_id).order_by("spawn_key"))


def test_children_spawned_again_by_a_retried_attempt_exist_once(
        worker_env: dict[str, str]) -> None:
    parent = enqueue("tests.parent", {"children": [{"n": 0}, {"n": 1}],
                                      "crash_after_spawn": True})
    with worker(worker_env, "--concurrency", "2") as w:
        until_status(parent.pk, Status.SUCCEEDED)
        assert w.stop() == 0, w.output()
    row = AgentRun.objects.get(pk=parent.pk)
    assert row.attempt >= 2
    kids = children(parent.pk)
    assert [(k.spawn_key, k.input, k.status) for k in kids] == [
        ("child-0", {"n": 0}, Status.SUCCEEDED), ("child-1", {"n": 1}, Status.SUCCEEDED)]
    assert RunEvent.objects.filter(run=parent, type="run.spawned").count() == 2
    assert row.output == {str(k.pk): ["succeeded", "completed", {"n": k.input["n"]}, None]
                          for k in kids}


def test_a_parent_waits_for_three_children_one_of_which_fails(
        worker_env: dict[str, str]) -> None:
    parent = enqueue("tests.parent", {"children": [{"n": 0}, {"n": 1, "fail": True},
                                                   {"n": 2}]})
    # Concurrency 1: the children can only run because the waiting parent gave its slot up.
    with worker(worker_env) as w:
        until_status(parent.pk, Status.SUCCEEDED)
        assert w.stop() == 0, w.output()
    kids = children(parent.pk)
    assert [k.status for k in kids] == [Status.SUCCEEDED, Status.FAILED, Status.SUCCEEDED]
    output = AgentRun.objects.get(pk=parent.pk).output
    assert output[str(kids[1].pk)] == ["failed", Reason.NOT_RETRYABLE, None,
                                       "django_agentruns.exceptions.NotRetryable"]
    assert output[str(kids[0].pk)][:3] == ["succeeded", "completed", {"n": 0}]
    parent_row = AgentRun.objects.get(pk=parent.pk)
    assert (parent_row.attempt, parent_row.requeue_count) == (2, 0)
    story = list(RunEvent.objects.filter(run=parent).values_list("type", flat=True))
    assert story.count("run.waiting") == 1
    assert story.count("run.resumed") == 1


def test_an_async_parent_spawns_waits_for_children_then_for_an_approval(
        worker_env: dict[str, str]) -> None:
    # Its children end through the worker's attempt store (a success, a dead letter): each
    # end resumes the parent. Concurrency 1: the waiting parent holds no slot.
    parent = enqueue("tests.async_parent", {"children": [{"n": 0}, {"n": 1, "fail": True}]})
    with worker(worker_env) as w:
        helpers.wait_until(lambda: RunWait.objects.filter(run_id=parent.pk, key="ship")
                           .exists() and status(parent.pk) == Status.WAITING, timeout=30,
                           message="the parent waits for its approval")
        assert approve(parent.pk, "ship", by="ops") is DeliverResult.DELIVERED
        until_status(parent.pk, Status.SUCCEEDED)
        assert w.stop() == 0, w.output()
    assert [k.status for k in children(parent.pk)] == [Status.SUCCEEDED, Status.FAILED]
    assert AgentRun.objects.get(pk=parent.pk).output == {
        "statuses": ["failed", "succeeded"], "approved": True, "by": "ops"}
    story = list(RunEvent.objects.filter(run=parent).values_list("type", flat=True))
    assert (story.count("run.waiting"), story.count("run.resumed")) == (2, 2)


def test_cancelling_a_parent_cancels_its_unfinished_children(
        worker_env: dict[str, str]) -> None:
    parent = enqueue("tests.parent", {"children": [{"n": 0}, {"n": 1, "receive": True},
                                                   {"n": 2, "receive": True}]})
    with worker(worker_env, "--concurrency", "2") as w:
        until_status(parent.pk, Status.WAITING)
        helpers.wait_until(lambda: [k.status for k in children(parent.pk)] == [
            Status.SUCCEEDED, Status.WAITING, Status.WAITING], timeout=30)
        assert cancel(parent.pk, "stop it all") is CancelResult.CANCELLED
        assert w.stop() == 0, w.output()
    assert status(parent.pk) == Status.CANCELLED
    kids = children(parent.pk)
    assert [k.status for k in kids] == [Status.SUCCEEDED, Status.CANCELLED, Status.CANCELLED]
    assert kids[1].cancel_reason == "stop it all"
    assert deliver(kids[1].pk, "go", 1) is DeliverResult.FINISHED


@pytest.mark.django_db(transaction=True)
def test_the_reaper_resumes_a_parent_whose_children_all_finished() -> None:
    """A worker that dies between a one-statement settle and resuming the parent leaves
    it waiting with every child finished: the reaper's pass resumes it."""
    from django_agentruns.models import RunWait

    parent = enqueue("tests.parent")
    child = enqueue("tests.child")
    key = transitions.waiting.runs_key([child.pk])
    AgentRun.objects.filter(pk=child.pk).update(parent_id=parent.pk, spawn_key="c",
                                                status=Status.SUCCEEDED)
    AgentRun.objects.filter(pk=parent.pk).update(status=Status.WAITING, wait_key=key)
    RunWait.objects.create(run=parent, key=key, kind="runs", prompt={"runs": [child.pk]})
    report = reap()
    assert report.parents_resumed == [parent.pk]
    assert status(parent.pk) == Status.QUEUED


@pytest.mark.django_db(transaction=True)
def test_bad_waits_and_spawns_get_a_clear_error_and_write_nothing() -> None:
    from django_agentruns import InvalidInputError, LimitExceeded
    from django_agentruns.exceptions import AttemptStopped, UnknownAgentError
    from django_agentruns.models import RunWait
    from django_agentruns.runtime.context import RunContext
    from django_agentruns.runtime.control import AttemptControl
    from django_agentruns.transitions import AttemptRef, ScopePolicy

    queued = enqueue("tests.parent")
    [claimed] = transitions.claim("w1", [queued.queue], 1, ScopePolicy(), {}, 30.0)
    control = AttemptControl(AttemptRef(claimed.pk, claimed.attempt, "w1", 30.0), None, 0)
    ctx = RunContext(run_id=claimed.pk, agent=claimed.agent, input={}, attempt=1, state=None,
                     scope="", control=control)
    stranger = enqueue("tests.child")
    before = AgentRun.objects.count()
    for call in [lambda: ctx.spawn("tests.child", key=""),
                 lambda: ctx.spawn("tests.child", key="x" * 201),
                 lambda: ctx.spawn("tests.child", {1, 2}, key="k"),
                 lambda: ctx.receive("go", timeout=-1),
                 lambda: ctx.receive("go", timeout="soon"),
                 lambda: ctx.receive("go", prompt={"x": float("nan")}),
                 lambda: ctx.wait_for_runs([stranger.pk]),
                 lambda: ctx.wait_for_runs(["x"])]:
        with pytest.raises(InvalidInputError):
            call()
    with pytest.raises(UnknownAgentError):
        ctx.spawn("tests.nobody", key="k")
    with pytest.raises(LimitExceeded):
        ctx.receive("go", prompt="x" * 300_000)
    assert AgentRun.objects.count() == before
    assert RunWait.objects.count() == 0
    assert status(claimed.pk) == Status.RUNNING

    # The same key gives the same child, in this attempt or any later one.
    first = ctx.spawn("tests.child", {"n": 1}, key="k")
    assert ctx.spawn("tests.child", {"n": 2}, key="k") == first
    assert AgentRun.objects.get(pk=first).input == {"n": 1}
    # A cancel request stops the attempt at its wait, which records nothing.
    assert cancel(claimed.pk) is CancelResult.REQUESTED
    with pytest.raises(AttemptStopped):
        ctx.receive("go")
    assert RunWait.objects.count() == 0
    # Cancelling the parent cancelled its queued child at once.
    assert status(first) == Status.CANCELLED


@pytest.mark.django_db(transaction=True)
def test_the_reaper_resumes_a_parent_with_another_unfinished_child_it_does_not_wait_for(
) -> None:
    """The parent spawned two children and waits for one; that one finished but the worker
    died before resuming the parent. The other child, still queued, must not hide it."""
    parent = enqueue("tests.parent")
    awaited = enqueue("tests.child")
    other = enqueue("tests.child")
    key = transitions.waiting.runs_key([awaited.pk])
    AgentRun.objects.filter(pk=awaited.pk).update(parent_id=parent.pk, spawn_key="a",
                                                  status=Status.SUCCEEDED)
    AgentRun.objects.filter(pk=other.pk).update(parent_id=parent.pk, spawn_key="b")
    AgentRun.objects.filter(pk=parent.pk).update(status=Status.WAITING, wait_key=key)
    RunWait.objects.create(run=parent, key=key, kind="runs", prompt={"runs": [awaited.pk]})
    report = reap()
    assert report.parents_resumed == [parent.pk]
    assert status(parent.pk) == Status.QUEUED
    assert status(other.pk) == Status.QUEUED


@pytest.mark.django_db(transaction=True)
def test_the_reaper_leaves_a_parent_whose_awaited_child_is_unfinished() -> None:
    parent = enqueue("tests.parent")
    done = enqueue("tests.child")
    running = enqueue("tests.child")
    key = transitions.waiting.runs_key([done.pk, running.pk])
    AgentRun.objects.filter(pk=done.pk).update(parent_id=parent.pk, spawn_key="a",
                                               status=Status.SUCCEEDED)
    AgentRun.objects.filter(pk=running.pk).update(parent_id=parent.pk, spawn_key="b")
    AgentRun.objects.filter(pk=parent.pk).update(status=Status.WAITING, wait_key=key)
    RunWait.objects.create(run=parent, key=key, kind="runs",
                           prompt={"runs": [done.pk, running.pk]})
    assert reap().parents_resumed == []
    assert status(parent.pk) == Status.WAITING
