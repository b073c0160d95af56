"""Trees of child runs are bounded: MAX_SPAWN_DEPTH levels below the root,
MAX_CHILDREN_PER_RUN children per run, each child with its own budget
(`ctx.spawn(..., budget=)`); and cancelling a tree of any depth cancels all of it."""

from __future__ import annotations

import itertools

import pytest
from django.conf import settings
from django.test import override_settings

from django_agentruns import CancelResult, RunRequest, cancel, enqueue, enqueue_many
from django_agentruns.models import AgentRun, Reason, Status
from django_agentruns.runtime.worker import Worker

pytestmark = pytest.mark.django_db(transaction=True)


def burst() -> None:
    Worker(queues=["waiting"], burst=True, reap_interval=0).run(install_signals=False)


def agentruns(**overrides: object) -> override_settings:
    return override_settings(AGENTRUNS={**settings.AGENTRUNS, **overrides})


def test_an_agent_spawning_itself_stops_at_max_spawn_depth() -> None:
    with agentruns(MAX_SPAWN_DEPTH=3):
        root = enqueue("tests.spawns_itself", {"levels": 50})
        burst()
    runs = list(AgentRun.objects.order_by("pk"))
    assert len(runs) == 4  # the root and three levels below it
    deepest = runs[-1]
    assert (deepest.status, deepest.reason) == (Status.FAILED, Reason.NOT_RETRYABLE)
    assert deepest.error_type.endswith("LimitExceeded")
    assert "MAX_SPAWN_DEPTH is 3" in deepest.error_message
    # Each parent got its child's result and finished.
    assert all(r.status == Status.SUCCEEDED for r in runs[:-1])
    assert AgentRun.objects.get(pk=root.pk).output == {
        "children": [["succeeded", "completed"]]}


def test_a_run_spawning_past_max_children_per_run_gets_a_clear_error() -> None:
    with agentruns(MAX_CHILDREN_PER_RUN=5):
        parent = enqueue("tests.spawns_itself", {"fan": 6})
        burst()
    row = AgentRun.objects.get(pk=parent.pk)
    assert (row.status, row.reason) == (Status.FAILED, Reason.NOT_RETRYABLE)
    assert "MAX_CHILDREN_PER_RUN is 5" in row.error_message
    assert AgentRun.objects.filter(parent_id=parent.pk).count() == 5


def test_a_child_has_the_budget_spawn_gave_it_not_a_share_of_its_parents() -> None:
    parent = enqueue("tests.spawns_itself", {"child_budget": {"tokens": 500}})
    burst()
    child = AgentRun.objects.get(parent_id=parent.pk)
    assert child.budget["tokens"] == 500
    # tests.spender records 400 tokens a step; its agent's budget is 1000 (3 steps).
    assert (child.status, child.reason) == (Status.FAILED, Reason.BUDGET_EXHAUSTED)
    assert child.input_tokens + child.output_tokens == 800
    done = AgentRun.objects.get(pk=parent.pk)
    assert done.status == Status.SUCCEEDED
    assert done.input_tokens + done.output_tokens == 0  # the child's spending is its own


def test_a_bad_child_budget_is_a_clear_error_and_spawns_nothing() -> None:
    parent = enqueue("tests.spawns_itself", {"child_budget": {"tokens": -1}})
    burst()
    row = AgentRun.objects.get(pk=parent.pk)
    assert (row.status, row.reason) == (Status.FAILED, Reason.NOT_RETRYABLE)
    assert "budget['tokens']" in row.error_message
    assert not AgentRun.objects.filter(parent_id=parent.pk).exists()


def test_cancelling_a_tree_deeper_than_the_recursion_limit_cancels_all_of_it() -> None:
    runs = enqueue_many([RunRequest("tests.child", {"n": i}) for i in range(600)])
    ids = [r.pk for r in runs]
    for parent_id, child_id in itertools.pairwise(ids):
        AgentRun.objects.filter(pk=child_id).update(parent_id=parent_id, spawn_key="next")
    assert cancel(ids[0], "stop the tree") is CancelResult.CANCELLED
    statuses = set(AgentRun.objects.values_list("status", flat=True))
    assert statuses == {Status.CANCELLED}
    last = AgentRun.objects.get(pk=ids[-1])
    assert last.cancel_reason == "stop the tree"
