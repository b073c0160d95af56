"""Django's tasks framework on the engine: `TASKS = {"default": {"BACKEND":
"django_agentruns.tasks.AgentRunsBackend"}}` runs any `@task` function as a durable run,
with leases, retries, dead letters and cancellation, read back through `get_result`.

The test tasks are in tests/testapp/tasks.py. Where neither `django.tasks` (Django >= 6.0)
nor the django-tasks backport is importable, the tests that need it skip, saying so; the
module must still import there, which the last test checks in every environment.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, connections, transaction
from django.test import override_settings
from django.utils import timezone

import tests as tests_package
from django_agentruns import NotRetryable, Retryable, RunCancelledError, cancel, enqueue
from django_agentruns.apps import uses_tasks_backend
from django_agentruns.models import AgentRun, Reason, Status
from django_agentruns.runtime.worker import Worker, WorkerStats
from django_agentruns.tasks import (
    ASYNC_AGENT,
    SYNC_AGENT,
    TASKS_AVAILABLE,
    UNAVAILABLE_REASON,
    AgentRunsBackend,
    compat,
)
from django_agentruns.tasks.results import task_input
from tests import helpers
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True)

BACKEND = "django_agentruns.tasks.AgentRunsBackend"
TASKS = {"default": {"BACKEND": BACKEND}}


@pytest.fixture
def tasks() -> Iterator[ModuleType]:
    """The test tasks, with TASKS naming the backend; skips where django.tasks is missing."""
    if not TASKS_AVAILABLE:
        pytest.skip(UNAVAILABLE_REASON)
    with override_settings(TASKS=TASKS):
        yield importlib.import_module("tests.testapp.tasks")


def work(**options: Any) -> WorkerStats:
    """Run everything due in this process, then return."""
    return Worker(burst=True, **options).run(install_signals=False)


def run_of(result: Any) -> AgentRun:
    return AgentRun.objects.get(pk=int(result.id))


def agentruns(**overrides: Any) -> override_settings:
    return override_settings(AGENTRUNS={**settings.AGENTRUNS, **overrides})


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
    due = timezone.now() + timedelta(seconds=0.5)
    result = tasks.add.using(run_after=due).enqueue(1, 1)
    assert run_of(result).available_at == due
    assert work().claimed == 0  # not due yet
    read = tasks.add.get_result(result.id)
    assert (read.status, read.task.run_after) == (compat.TaskResultStatus.READY, due)

    helpers.wait_until(lambda: timezone.now() >= due, message="the task to come due")
    assert work().claimed == 1
    result.refresh()
    assert result.status == compat.TaskResultStatus.SUCCESSFUL
    assert result.started_at is not None
    assert result.started_at >= due


# --------------------------------------------------------------------------- signals


@pytest.fixture
def received() -> Iterator[list[tuple[str, str, str, int, type]]]:
    """(signal, result id, status, attempts, sender) for every task signal sent."""
    seen: list[tuple[str, str, str, int, type]] = []
    receivers = {}
    for name in ("task_enqueued", "task_started", "task_finished"):
        def receiver(sender: type, task_result: Any, _name: str = name, **kwargs: Any) -> None:
            seen.append((_name, task_result.id, str(task_result.status), task_result.attempts,
                         sender))
        receivers[name] = receiver
        getattr(compat, name).connect(receiver, weak=False)
    yield seen
    for name, receiver in receivers.items():
        getattr(compat, name).disconnect(receiver)


def test_task_signals_are_sent_for_each_attempt(
    tasks: ModuleType, received: list[tuple[str, str, str, int, type]]
) -> None:
    flaky = tasks.flaky.enqueue()
    work()
    failed = tasks.refuse.enqueue()
    product = tasks.multiply.enqueue(2, 2)
    work()
    assert {sender for *_, sender in received} == {AgentRunsBackend}
    by_id = {r.id: [(name, status, attempts) for name, rid, status, attempts, _ in received
                    if rid == r.id] for r in (flaky, failed, product)}
    assert by_id[flaky.id] == [
        ("task_enqueued", "READY", 0),
        ("task_started", "RUNNING", 1),
        ("task_finished", "READY", 1),  # the failed attempt will be retried
        ("task_started", "RUNNING", 2),
        ("task_finished", "SUCCESSFUL", 2),
    ]
    assert by_id[failed.id] == [("task_enqueued", "READY", 0), ("task_started", "RUNNING", 1),
                                ("task_finished", "FAILED", 1)]
    assert by_id[product.id] == [("task_enqueued", "READY", 0), ("task_started", "RUNNING", 1),
                                 ("task_finished", "SUCCESSFUL", 1)]


# --------------------------------------------------------------------------- workers


def test_a_worker_without_tasks_settings_runs_tasks_once_the_module_is_imported() -> None:
    """The web process enqueued it; this worker has no TASKS, only the imported backend."""
    if not TASKS_AVAILABLE:
        pytest.skip(UNAVAILABLE_REASON)
    add = importlib.import_module("tests.testapp.tasks").add
    run = enqueue(SYNC_AGENT, input=task_input(add, [20, 22], {}, "default"))
    work()
    run.refresh_from_db()
    assert (run.status, run.output) == (Status.SUCCEEDED, 42)


def test_the_app_config_registers_the_agents_when_tasks_names_the_backend() -> None:
    assert not uses_tasks_backend()
    with override_settings(TASKS=TASKS):
        assert uses_tasks_backend()
    with override_settings(TASKS={"default": {"BACKEND": "elsewhere.Backend"}}):
        assert not uses_tasks_backend()


@pytest.mark.slow
def test_runworker_runs_sync_and_async_tasks(tasks: ModuleType, worker_env: dict[str, str]
                                             ) -> None:
    """A real worker process whose settings name the backend and import nothing else: the app
    config registers the internal agents (else the runs would dead-letter as unknown)."""
    total = tasks.add.enqueue(40, 2)
    product = tasks.multiply.enqueue(6, 7)
    flaky = tasks.flaky.enqueue()
    env = {**worker_env, "DJANGO_SETTINGS_MODULE": "tests.settings_tasks"}
    with helpers.start_manage(["runworker", "--queues", "default"], env) as worker:
        helpers.wait_until(
            lambda: all(r.task.get_result(r.id).is_finished for r in (total, product, flaky)),
            message="the tasks to finish")
        assert worker.stop() == 0
    for result, value in ((total, 42), (product, 42)):
        result.refresh()
        assert (result.status, result.return_value) == (compat.TaskResultStatus.SUCCESSFUL,
                                                        value)
        assert f":{worker.pid}:" in result.worker_ids[0]
    flaky.refresh()
    assert flaky.return_value["attempt"] == 2


# --------------------------------------------------------------------------- no django.tasks


NO_TASKS_FRAMEWORK = """
import importlib.abc, sys

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ("django.tasks", "django_tasks") or name.startswith(("django.tasks.",
                                                                        "django_tasks.")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hide())
import django
django.setup()
from django.core.exceptions import ImproperlyConfigured
import django_agentruns.tasks as tasks
from django_agentruns.registry import find_agent
assert not tasks.TASKS_AVAILABLE
assert find_agent(tasks.SYNC_AGENT) is not None
try:
    tasks.AgentRunsBackend("default", {})
except ImproperlyConfigured as exc:
    print("refused:", exc)
"""


def test_without_the_tasks_framework_the_module_imports_and_the_backend_refuses() -> None:
    """Django 5.2 without the backport: importing must not fail, building the backend must."""
    env = helpers.subprocess_env(connection.settings_dict)  # setup() opens no connection
    done = subprocess.run([sys.executable, "-c", NO_TASKS_FRAMEWORK], env=env,
                          cwd=helpers.REPO_ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert f"refused: {UNAVAILABLE_REASON}" in done.stdout


def test_a_backend_without_the_app_installed_fails_its_system_check(tasks: ModuleType) -> None:
    from django.apps import apps

    from django_agentruns.tasks.backend import E008_APP_NOT_INSTALLED, AgentRunsBackend

    backend = AgentRunsBackend("default", {})
    assert backend.check() == []
    real = apps.is_installed
    try:
        apps.is_installed = lambda name: name != "django_agentruns"  # type: ignore[method-assign]
        (message,) = backend.check()
    finally:
        apps.is_installed = real  # type: ignore[method-assign]
    assert message.id == E008_APP_NOT_INSTALLED
    assert "INSTALLED_APPS" in message.msg


# --------------------------------------------------------------------------- what a worker imports


def test_a_run_naming_a_module_outside_the_installed_apps_is_refused_unimported(
        tasks: ModuleType) -> None:
    """A run's input is data: the task path it names is checked before anything imports."""
    path = "tests.import_side_effect.anything"
    run = enqueue(SYNC_AGENT, input={"task": path, "args": [], "kwargs": {},
                                     "backend": "default", "run_after": None})
    work()
    run.refresh_from_db()
    assert (run.status, run.reason, run.attempt) == (Status.FAILED, Reason.NOT_RETRYABLE, 1)
    assert run.error_type == "django.core.exceptions.ImproperlyConfigured"
    assert f"Task {path!r} is not in an installed app" in run.error_message
    with pytest.raises(ImproperlyConfigured, match="not in an installed app"):
        AgentRunsBackend("default", {}).get_result(str(run.pk))
    assert "tests.import_side_effect" not in sys.modules
    assert not hasattr(tests_package, "import_side_effect_ran")


def test_a_task_outside_the_installed_apps_is_refused_at_enqueue(tasks: ModuleType) -> None:
    outside = importlib.import_module("tests.outside_tasks").outside
    with pytest.raises(compat.InvalidTask, match="is not in an installed app"):
        outside.enqueue()
    assert AgentRun.objects.count() == 0


# --------------------------------------------------------------------------- task_finished


def test_task_finished_is_sent_once_the_outcome_is_written(tasks: ModuleType) -> None:
    """Each status `task_finished` carries is the one the run already has in the database."""
    seen: list[tuple[str, str, str]] = []

    def receiver(sender: type, task_result: Any, **kwargs: Any) -> None:
        seen.append((task_result.id, str(task_result.status),
                     str(task_result.task.get_result(task_result.id).status)))

    compat.task_finished.connect(receiver, weak=False)
    try:
        flaky = tasks.flaky.enqueue()
        failed = tasks.refuse.enqueue()
        product = tasks.multiply.enqueue(2, 3)
        work()  # the test settings have no backoff: the retry runs in this drain
    finally:
        compat.task_finished.disconnect(receiver)
    assert sorted(seen) == sorted([
        (flaky.id, "READY", "READY"), (flaky.id, "SUCCESSFUL", "SUCCESSFUL"),
        (failed.id, "FAILED", "FAILED"), (product.id, "SUCCESSFUL", "SUCCESSFUL")])


def test_an_attempt_whose_lease_was_lost_sends_no_task_finished(
    tasks: ModuleType, received: list[tuple[str, str, str, int, type]]
) -> None:
    """The worker wrote nothing for it, so there is no outcome to announce."""
    result = tasks.lose_lease.enqueue()
    work()
    assert run_of(result).status == Status.RUNNING  # the other worker's now
    assert [(name, status) for name, rid, status, *_ in received if rid == result.id] == [
        ("task_enqueued", "READY"), ("task_started", "RUNNING")]
