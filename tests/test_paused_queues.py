"""Paused queues: workers claim nothing from one until it is resumed; running attempts
finish normally. The claim statement itself refuses a paused queue, so a worker's list of
paused queues (read at most once a second) is only an optimisation."""

from __future__ import annotations

import time
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from django_agentruns import enqueue, pause_queue, resume_queue, transitions
from django_agentruns.exceptions import InvalidInputError
from django_agentruns.models import AgentRun, PausedQueue, Status
from django_agentruns.ops.visibility import PAUSED, why_not_started
from django_agentruns.queues import PausedSet
from django_agentruns.registry import scope_policy
from tests import helpers


def claim(queues: list[str], worker: str = "w-test") -> list[AgentRun]:
    return transitions.claim(worker, queues, 10, scope_policy(), {}, 2.0)


def test_a_claim_takes_nothing_from_a_paused_queue(db: None) -> None:
    enqueue("tests.noop")
    other = enqueue("tests.noop", queue="other")
    assert pause_queue("default", by="ops") is True
    assert pause_queue("default") is False  # already paused

    # Even a worker that still lists the queue (its view is a moment old) takes nothing.
    assert [r.pk for r in claim(["default", "other"])] == [other.pk]
    assert resume_queue("default", by="ops") is True
    assert resume_queue("default") is False
    assert len(claim(["default"])) == 1


@pytest.mark.postgres_only
def test_the_one_statement_claim_refuses_a_paused_queue_too(db: None) -> None:
    enqueue("tests.noop")
    pause_queue("default")
    with_lapsed = transitions.claim("w", ["default"], 10, scope_policy(), {}, 2.0,
                                    include_lapsed=False)
    assert with_lapsed == []


def test_a_lapsed_run_of_a_paused_queue_is_not_reclaimed_by_a_claim(db: None) -> None:
    enqueue("tests.noop")
    [run] = claim(["default"])
    AgentRun.objects.filter(pk=run.pk).update(lease_expires=run.started_at)  # lapsed
    pause_queue("default")
    assert claim(["default"], "w-other") == []
    resume_queue("default")
    assert len(claim(["default"], "w-other")) == 1


def test_the_worker_view_leaves_paused_queues_out(db: None) -> None:
    view = PausedSet(refresh=0.0)
    pause_queue("b")
    assert view.active(["a", "b", "c"]) == ["a", "c"]
    resume_queue("b")
    assert view.active(["a", "b", "c"]) == ["a", "b", "c"]


@pytest.mark.parametrize("name", ["", "a b", "x" * 101, None])
def test_a_bad_queue_name_is_refused_and_nothing_is_written(db: None, name: object) -> None:
    with pytest.raises(InvalidInputError, match="queue name"):
        pause_queue(name)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="queue name"):
        resume_queue(name)  # type: ignore[arg-type]
    assert not PausedQueue.objects.exists()


def test_why_names_the_pause(db: None) -> None:
    run = enqueue("tests.noop")
    pause_queue("default", by="alice")
    [hold] = why_not_started(run)
    assert hold.code == PAUSED
    assert "'default' was paused" in hold.message
    assert "by alice" in hold.message


def test_the_queues_command_pauses_lists_and_resumes(db: None) -> None:
    enqueue("tests.noop")
    out = StringIO()
    call_command("queues", "pause", "default", "--by", "ops", stdout=out)
    call_command("queues", stdout=out)
    call_command("queues", "resume", "default", stdout=out)
    call_command("queues", "list", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "queue 'default' paused"
    assert any(line.startswith("default: PAUSED since") and "by ops; queued 1" in line
               for line in lines)
    assert "queue 'default' resumed" in lines
    assert "default: active; queued 1, running 0" in lines
    with pytest.raises(CommandError, match="needs a queue name"):
        call_command("queues", "pause")
    with pytest.raises(CommandError, match="queue name"):
        call_command("queues", "pause", "a b")


@pytest.mark.slow
def test_a_paused_queue_with_a_worker_running_claims_nothing_then_drains_on_resume(
    worker_env: dict[str, str],
) -> None:
    pause_queue("default")
    runs = [enqueue("tests.noop", {"n": n}) for n in range(3)]
    with helpers.start_manage(["runworker", "--concurrency", "2"], worker_env) as worker:
        # The worker is up (it logs its start) and has claimed nothing for 3 s.
        helpers.wait_until(lambda: "serving queues" in worker.stderr, timeout=60)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert not AgentRun.objects.exclude(status=Status.QUEUED).exists()
            assert worker.returncode is None, worker.output()
            time.sleep(0.1)
        resume_queue("default")
        helpers.wait_until(
            lambda: AgentRun.objects.filter(status=Status.SUCCEEDED).count() == len(runs),
            timeout=30, message="the resumed queue to drain")
        assert worker.stop() == 0
