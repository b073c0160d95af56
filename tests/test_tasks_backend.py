"""Django's tasks framework on the engine: `TASKS = {"default": {"BACKEND":
"django_agentruns.tasks.AgentRunsBackend"}}` runs any `@task` function as a durable run,
with leases, retries, dead letters and cancellation, read back through `get_result`.

The test tasks are in tests/testapp/tasks.py. Where neither `django.tasks` (Django >= 6.0)
nor the django-tasks backport is importable, the tests that need it skip, saying so; the
module must still import there, which the last test checks in every environment.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db import connections, transaction
from django.test import override_settings
from django.utils import timezone

from django_agentruns import NotRetryable, Retryable, RunCancelledError, cancel, enqueue
from django_agentruns.models import AgentRun, Reason, Status
from django_agentruns.runtime.worker import Worker
from django_agentruns.tasks import (
    ASYNC_AGENT,
    SYNC_AGENT,
    AgentRunsBackend,
    compat,
)
from tests import helpers
from tests.tasks_support import BACKEND, agentruns, run_of, work
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True)


# --------------------------------------------------------------------------- enqueue and read


def test_the_backend_supports_defer_async_get_result_and_priority(tasks: ModuleType) -> None:
    backend = compat.task_backends["default"]
    assert isinstance(backend, AgentRunsBackend)
    assert backend.supports_defer
    assert backend.supports_async_task
    assert backend.supports_get_result
    assert backend.supports_priority


def test_a_task_runs_on_the_engine_and_get_result_reads_it_before_and_after(
    tasks: ModuleType,
) -> None:
    result = tasks.add.enqueue(2, 3)
    assert result.status == compat.TaskResultStatus.READY
    run = run_of(result)
    assert (run.agent, run.queue, run.priority, run.status) == (SYNC_AGENT, "default", 0,
                                                                 Status.QUEUED)
    assert run.input == {"task": "tests.testapp.tasks.add", "args": [2, 3], "kwargs": {},
                         "backend": "default", "run_after": None}

    before = tasks.add.get_result(result.id)
    assert before.status == compat.TaskResultStatus.READY
    assert before.enqueued_at == run.created_at
    assert (before.started_at, before.finished_at, before.last_attempted_at) == (None,) * 3
    assert (before.args, before.kwargs, before.backend) == ([2, 3], {}, "default")
    assert (before.attempts, before.errors, before.is_finished) == (0, [], False)
    with pytest.raises(ValueError, match="not finished"):
        _ = before.return_value

    worker = Worker(burst=True)
    worker.run(install_signals=False)

    after = tasks.add.get_result(result.id)
    assert after.status == compat.TaskResultStatus.SUCCESSFUL
    assert after.return_value == 5
    assert after.is_finished
    assert after.errors == []
    assert after.worker_ids == [worker.worker_id]
    assert after.started_at is not None
    assert after.finished_at is not None
    assert after.enqueued_at <= after.started_at <= after.finished_at
    assert after.last_attempted_at == after.started_at
    result.refresh()  # the enqueued result object reloads from the run
    assert (result.status, result.return_value) == (compat.TaskResultStatus.SUCCESSFUL, 5)
    with pytest.raises(compat.TaskResultMismatch):
        tasks.multiply.get_result(result.id)


def test_args_and_return_values_are_normalised_to_json(tasks: ModuleType) -> None:
    result = tasks.echo.enqueue("a", (1, 2), key={"nested": (3,)})
    assert (result.args, result.kwargs) == (["a", [1, 2]], {"key": {"nested": [3]}})
    work()
    result.refresh()
    assert result.return_value == {"args": ["a", [1, 2]], "kwargs": {"key": {"nested": [3]}},
                                   "pair": [1, 2]}


def test_get_result_of_an_id_that_is_no_task_does_not_exist(tasks: ModuleType) -> None:
    plain = enqueue("tests.noop")  # a run, but not a task's
    backend = compat.task_backends["default"]
    for bad in ("abc", "", "0", "-1", "1.5", str(2**64), "999999999", str(plain.pk)):
        with pytest.raises(compat.TaskResultDoesNotExist):
            backend.get_result(bad)


def test_aenqueue_and_aget_result(tasks: ModuleType) -> None:
    result = async_to_sync(tasks.multiply.aenqueue)(6, 7)
    assert run_of(result).agent == ASYNC_AGENT
    work()
    read = async_to_sync(tasks.multiply.aget_result)(result.id)
    assert (read.status, read.return_value) == (compat.TaskResultStatus.SUCCESSFUL, 42)


def test_enqueue_writes_in_the_callers_transaction(tasks: ModuleType) -> None:
    """Guarantee 9 for tasks: roll back and the task never existed, nor was announced."""
    sent: list[str] = []

    def on_enqueued(sender: Any, task_result: Any, **kwargs: Any) -> None:
        sent.append(task_result.id)

    compat.task_enqueued.connect(on_enqueued, weak=False)
    try:
        def enqueue_then_roll_back() -> None:
            with transaction.atomic():
                tasks.add.enqueue(1, 1)
                raise RuntimeError("the caller rolls back")

        with pytest.raises(RuntimeError):
            enqueue_then_roll_back()
        assert AgentRun.objects.count() == 0
        assert sent == []

        with transaction.atomic():
            kept = tasks.add.enqueue(1, 2)
            assert sent == []  # announced once committed, not before
        assert sent == [kept.id]
    finally:
        compat.task_enqueued.disconnect(on_enqueued)


def test_bad_tasks_and_arguments_are_refused_before_anything_is_written(
    tasks: ModuleType,
) -> None:
    """Guarantee 10: a clear error at enqueue, not a dead letter in the worker."""
    with pytest.raises(TypeError):
        tasks.add.enqueue(object(), 1)
    with pytest.raises(ValueError, match="JSON"):
        tasks.add.enqueue(float("nan"), 1)
    with pytest.raises(compat.InvalidTask, match="cannot be imported by that path"):
        tasks.misnamed.enqueue()
    with pytest.raises(compat.InvalidTask, match="1-100 characters"), \
            override_settings(TASKS={"default": {"BACKEND": BACKEND, "QUEUES": []}}):
        tasks.add.using(queue_name="q" * 101)
    assert AgentRun.objects.count() == 0


# --------------------------------------------------------------------------- failures


def test_a_not_retryable_failure_reads_as_failed_with_its_error(tasks: ModuleType) -> None:
    result = tasks.refuse.enqueue()
    work()
    run = run_of(result)
    assert (run.status, run.reason, run.attempt) == (Status.FAILED, Reason.NOT_RETRYABLE, 1)
    result.refresh()
    assert result.status == compat.TaskResultStatus.FAILED
    with pytest.raises(ValueError, match="failed"):
        _ = result.return_value
    [error] = result.errors
    assert error.exception_class is NotRetryable
    assert "Traceback (most recent call last)" in error.traceback
    assert "bad request: the ticket does not exist" in error.traceback
    assert result.finished_at is not None
    assert len(result.worker_ids) == 1


def test_retryable_failures_spend_the_budget_then_read_as_failed(tasks: ModuleType) -> None:
    with agentruns(MAX_REQUEUES=1):
        result = tasks.explode.enqueue()
    work()
    run = run_of(result)
    assert (run.status, run.reason, run.attempt) == (Status.FAILED, Reason.RETRIES_EXHAUSTED, 2)
    result.refresh()
    assert result.status == compat.TaskResultStatus.FAILED
    assert result.attempts == 2
    assert [e.exception_class for e in result.errors] == [ValueError, ValueError]
    assert result.errors[0].traceback == "ValueError: boom"  # events keep class and message
    assert "Traceback (most recent call last)" in result.errors[1].traceback  # the run's


def test_task_context_attempt_is_2_after_a_retry(tasks: ModuleType) -> None:
    result = tasks.flaky.enqueue()
    worker = Worker(burst=True)
    worker.run(install_signals=False)
    result.refresh()
    assert result.status == compat.TaskResultStatus.SUCCESSFUL
    assert result.return_value == {"attempt": 2, "worker_ids": [worker.worker_id] * 2}
    assert result.attempts == 2
    [error] = result.errors
    assert error.exception_class is Retryable
    assert "transient failure on attempt 1" in error.traceback


def test_a_return_value_that_is_not_json_fails_not_retryable(tasks: ModuleType) -> None:
    result = tasks.not_json.enqueue()
    work()
    assert run_of(result).reason == Reason.NOT_RETRYABLE
    result.refresh()
    assert result.status == compat.TaskResultStatus.FAILED
    assert "must be JSON-serialisable" in result.errors[0].traceback


def test_a_task_that_no_longer_imports_dead_letters_at_once(tasks: ModuleType) -> None:
    run = enqueue(SYNC_AGENT, input={"task": "tests.testapp.tasks.gone", "args": [],
                                     "kwargs": {}, "backend": "default", "run_after": None})
    work()
    run.refresh_from_db()
    assert (run.status, run.reason, run.attempt) == (Status.FAILED, Reason.NOT_RETRYABLE, 1)
    assert run.error_type == "django.core.exceptions.ImproperlyConfigured"
    assert "'tests.testapp.tasks.gone' cannot be imported" in run.error_message


# --------------------------------------------------------------------------- cancellation


def test_a_cancelled_task_reads_as_failed_with_its_reason(tasks: ModuleType) -> None:
    result = tasks.add.enqueue(1, 1)
    assert cancel(int(result.id), reason="superseded by a newer import").value == "cancelled"
    assert work().claimed == 0
    result.refresh()
    assert result.status == compat.TaskResultStatus.FAILED
    assert result.finished_at is not None
    assert result.attempts == 0
    [error] = result.errors
    assert error.exception_class is RunCancelledError
    assert "superseded by a newer import" in error.traceback


def test_cancelling_a_running_async_task_stops_it(tasks: ModuleType) -> None:
    """Guarantee 7: the cancel interrupts the task's await; it would sleep 30 s otherwise."""
    result = tasks.sleep_long.enqueue(30)
    worker = Worker(burst=True)

    def serve() -> None:
        try:
            worker.run(install_signals=False)
        finally:
            connections.close_all()  # this thread's own; the test database is dropped later

    thread = threading.Thread(target=serve, name="test-worker")
    thread.start()
    try:
        helpers.wait_until(lambda: run_of(result).status == Status.RUNNING, timeout=60,
                           message="the task to start")
        cancel(int(result.id), reason="operator stop")
        thread.join(timeout=10)
        assert not thread.is_alive(), "the cancelled task kept its worker busy"
    finally:
        worker.stop()
        thread.join(timeout=10)
    assert run_of(result).status == Status.CANCELLED
    result.refresh()
    assert result.status == compat.TaskResultStatus.FAILED
    assert result.attempts == 1
    assert result.errors[-1].exception_class is RunCancelledError
    assert "operator stop" in result.errors[-1].traceback


# --------------------------------------------------------------------------- async, priority, defer


def test_async_tasks_run_and_retry_with_their_context(tasks: ModuleType) -> None:
    product = tasks.multiply.enqueue(6, 7)
    flaky = tasks.async_flaky.enqueue()
    assert {run_of(product).agent, run_of(flaky).agent} == {ASYNC_AGENT}
    work()
    product.refresh()
    flaky.refresh()
    assert (product.status, product.return_value) == (compat.TaskResultStatus.SUCCESSFUL, 42)
    assert (flaky.status, flaky.return_value) == (compat.TaskResultStatus.SUCCESSFUL,
                                                  {"attempt": 2})
    assert [e.exception_class for e in flaky.errors] == [Retryable]


def test_priority_orders_the_queue(tasks: ModuleType) -> None:
    for label, priority in (("low", -5), ("high", 10), ("mid", 0)):
        result = tasks.note.using(priority=priority).enqueue(label)
        assert run_of(result).priority == priority
        assert tasks.note.get_result(result.id).task.priority == priority
    work(concurrency=1)
    assert list(SideEffect.objects.order_by("id").values_list("note", flat=True)) == [
        "high", "mid", "low"]


def test_run_after_defers_the_task(tasks: ModuleType) -> None:
    due = timezone.now() + timedelta(seconds=1)
    result = tasks.add.using(run_after=due).enqueue(1, 1)
    assert run_of(result).available_at == due
    read = tasks.add.get_result(result.id)
    assert (read.status, read.task.run_after) == (compat.TaskResultStatus.READY, due)
    early = work().claimed
    if timezone.now() < due:  # a pass that ended before the task was due claimed nothing
        assert early == 0      # (a loaded machine may reach it late: started_at says)

    helpers.wait_until(lambda: timezone.now() >= due, message="the task to come due")
    assert early + work().claimed == 1
    result.refresh()
    assert result.status == compat.TaskResultStatus.SUCCESSFUL
    assert result.started_at is not None
    assert result.started_at >= due
