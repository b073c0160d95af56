"""Retention deletes a run with every row it owns: waits and deliveries, checkpoints, live
output, and clears the links of the runs that outlive it (children, forks). A run that owns
such rows must never stop `purge` for good (batches go in id order).

Committed transactions (`transaction=True`): the foreign keys are checked at commit, where
a purge that forgot a table fails.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.apps import apps
from django.db import models
from django.utils import timezone

from django_agentruns.models import (
    AgentRun,
    Reason,
    RunCheckpoint,
    RunEvent,
    RunUsage,
    RunWait,
    Status,
    StreamChunk,
)
from django_agentruns.ops.retention import LINKS_TO_RUN, OWNED_BY_RUN, purge
from django_agentruns.runtime import reaper

pytestmark = pytest.mark.django_db(transaction=True)

OLD = timezone.now() - timedelta(days=40)


def finished_run(status: str = Status.SUCCEEDED, reason: str = Reason.COMPLETED,
                 **fields: object) -> AgentRun:
    values: dict[str, object] = {"finished_at": OLD, "created_at": OLD, **fields}
    return AgentRun.objects.create(agent="tests.noop", queue="default", status=status,
                                   reason=reason, **values)


def give_it_everything(run: AgentRun) -> None:
    """Every kind of row a run can own: an event, a checkpoint, a wait answered by a
    delivery, a delivery for a key it never waited on, live-output rows."""
    RunEvent.objects.create(run=run, seq=1, event_id=uuid.uuid4(), type="x")
    RunCheckpoint.objects.create(run=run, number=1, state={"step": 1})
    RunWait.objects.create(run=run, key="approval", kind=RunWait.Kind.APPROVAL,
                           waited_at=OLD, payload={"approved": True}, delivered_at=OLD)
    RunWait.objects.create(run=run, key="never-awaited", payload={"x": 1}, delivered_at=OLD)
    StreamChunk.objects.create(run=run, attempt=1, channel="output", first=0, end=1,
                               text="hello")
    RunUsage.objects.create(run=run, attempt=1, seq=1, input_tokens=3, output_tokens=2)


def owned_rows(run_id: int) -> int:
    return sum(model._base_manager.filter(**{f"{field}_id": run_id}).count()
               for model, field, _ in OWNED_BY_RUN)


def test_a_run_that_owns_rows_is_purged_and_the_runs_after_it_are_too() -> None:
    first = finished_run()
    give_it_everything(first)
    later = [finished_run() for _ in range(3)]

    report = purge(timedelta(days=30), batch_size=1)

    assert report.runs == 4
    assert not AgentRun.objects.exists()
    assert owned_rows(first.pk) == 0
    assert not RunWait.objects.exists()
    assert not StreamChunk.objects.exists()
    assert not RunUsage.objects.exists()
    assert later  # purged in later batches: the first run's rows did not stop them


def test_a_purged_parent_leaves_its_children_running_on_their_own() -> None:
    parent = finished_run()
    unfinished = AgentRun.objects.create(agent="tests.noop", queue="default",
                                         status=Status.QUEUED, parent=parent,
                                         spawn_key="child")
    done = AgentRun.objects.create(agent="tests.noop", queue="default",
                                   status=Status.SUCCEEDED, reason=Reason.COMPLETED,
                                   finished_at=timezone.now(), parent=parent, spawn_key="c2")
    fork = AgentRun.objects.create(agent="tests.noop", queue="default", status=Status.QUEUED,
                                   forked_from=parent)

    assert purge(timedelta(days=30)).runs == 1

    assert not AgentRun.objects.filter(pk=parent.pk).exists()
    for kept in (unfinished, done, fork):
        kept.refresh_from_db()
        assert kept.parent_id is None
        assert kept.forked_from_id is None
    assert AgentRun.objects.get(pk=unfinished.pk).status == Status.QUEUED


def test_a_finished_child_is_purged_while_its_parent_stays() -> None:
    parent = AgentRun.objects.create(agent="tests.noop", queue="default",
                                     status=Status.WAITING)
    child = finished_run(parent=parent, spawn_key="child")
    assert purge(timedelta(days=30)).runs == 1
    assert not AgentRun.objects.filter(pk=child.pk).exists()
    assert AgentRun.objects.filter(pk=parent.pk).exists()


def test_every_table_with_a_foreign_key_to_a_run_is_handled_by_retention() -> None:
    """A table added later (steps, payloads, ...) must be listed in OWNED_BY_RUN or
    LINKS_TO_RUN, or purge and erase would fail on its rows (or leave them)."""
    handled = {(model, field) for model, field, _ in OWNED_BY_RUN} | set(LINKS_TO_RUN)
    pointing = set()
    for model in apps.get_models(include_auto_created=True):
        for field in model._meta.get_fields():
            if isinstance(field, models.ForeignKey | models.OneToOneField) \
                    and field.related_model is AgentRun:
                pointing.add((model, field.name))
    assert pointing, "the models were not found"
    assert pointing - handled == set(), "tables pointing at a run that retention forgets"
    assert handled - pointing == set()
    for model, _, payloads in OWNED_BY_RUN:
        names = {f.name for f in model._meta.get_fields()}
        assert set(payloads) <= names, model


def test_the_reaper_prunes_live_output_left_by_finished_runs_only() -> None:
    done = finished_run()
    just_done = finished_run(finished_at=timezone.now())  # readers may still be reading
    running = AgentRun.objects.create(agent="tests.noop", queue="default",
                                      status=Status.RUNNING, attempt=1)
    for run in (done, just_done, running):
        StreamChunk.objects.create(run=run, attempt=1, channel="output", first=0, end=1,
                                   text="left")

    report = reaper.reap()

    assert report.chunks_pruned == 1
    assert set(StreamChunk.objects.values_list("run_id", flat=True)) == {just_done.pk,
                                                                          running.pk}


def test_a_burst_worker_leaves_no_live_output_rows_when_it_exits(
        worker_env: dict[str, str]) -> None:
    from django_agentruns import enqueue
    from tests import helpers

    runs = [enqueue("tests.streamer", {"n": 50, "emit": True, "after": 50}) for _ in range(3)]
    done = helpers.run_manage(["runworker", "--burst"], worker_env)
    assert done.returncode == 0, done.stderr
    assert set(AgentRun.objects.filter(pk__in=[r.pk for r in runs])
               .values_list("status", flat=True)) == {Status.SUCCEEDED}
    assert RunEvent.objects.filter(type="stream").count() == 6
    assert not StreamChunk.objects.exists()
