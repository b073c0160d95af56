"""Django's tasks framework on the engine, seen from outside one attempt: the task signals,
real `runworker` processes, the app without `django.tasks`, what a worker imports, and
`task_finished`. The enqueue, failure, cancellation and priority tests are in
tests/test_tasks_backend.py; the shared fixture in tests/tasks_support.py.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.test import override_settings

import tests as tests_package
from django_agentruns import enqueue
from django_agentruns.apps import uses_tasks_backend
from django_agentruns.models import AgentRun, Reason, Status
from django_agentruns.tasks import (
    SYNC_AGENT,
    TASKS_AVAILABLE,
    UNAVAILABLE_REASON,
    AgentRunsBackend,
    compat,
)
from django_agentruns.tasks.results import task_input
from tests import helpers
from tests.tasks_support import TASKS, run_of, work

pytestmark = pytest.mark.django_db(transaction=True)


# --------------------------------------------------------------------------- signals


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
