"""Where Django's own `django.tasks` tests hold the backend to the contract: the ERROR line
of a failed task carries its exception, `task_finished` is sent for every attempt whatever
the task raised, a non-JSON return value is a TypeError, and enqueue works with
USE_TZ=False. (Documented differences: docs/django-tasks.md.)"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import ModuleType

import pytest
from django.test import override_settings

from django_agentruns.models import AgentRun, Reason, Status
from django_agentruns.tasks import compat
from tests.tasks_support import run_of, work

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_failed_tasks_error_line_carries_its_exception(
        tasks: ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    logger = compat.SOURCE or "django.tasks"  # the backport logs as `django_tasks`
    with caplog.at_level(logging.INFO, logger=logger):
        result = tasks.refuse.enqueue()
        work()
    errors = [r for r in caplog.records if r.name == logger
              and r.levelno == logging.ERROR and result.id in r.getMessage()]
    assert len(errors) == 1
    assert errors[0].exc_info is not None
    assert errors[0].exc_info[0] is not None
    assert errors[0].exc_info[0].__name__ == "NotRetryable"
    assert "the ticket does not exist" in caplog.text
    assert "Traceback" in caplog.text


@pytest.mark.parametrize("name", ["exits", "interrupted"])
def test_task_finished_is_sent_once_per_attempt_for_system_exit_and_keyboard_interrupt(
        tasks: ModuleType, received: list[tuple[str, str, str, int, type]], name: str,
) -> None:
    result = getattr(tasks, name).enqueue()
    for _ in range(10):
        work()
        if run_of(result).status == Status.FAILED:
            break
    run = run_of(result)
    assert run.status == Status.FAILED
    signals = [(signal, status) for signal, rid, status, *_ in received if rid == result.id]
    started = [s for s, _ in signals if s == "task_started"]
    finished = [status for s, status in signals if s == "task_finished"]
    assert len(started) == len(finished) == run.attempt
    assert finished[-1] == "FAILED"


def test_a_return_value_that_is_not_json_is_a_type_error_and_not_retried(
        tasks: ModuleType) -> None:
    result = tasks.not_json.enqueue()
    work()
    assert run_of(result).reason == Reason.NOT_RETRYABLE
    result.refresh()
    assert result.status == compat.TaskResultStatus.FAILED
    assert result.errors[0].exception_class is TypeError
    assert "must be JSON-serialisable" in result.errors[0].traceback


@pytest.fixture
def naive_times() -> Iterator[None]:
    with override_settings(USE_TZ=False):
        yield


def test_enqueue_and_run_with_use_tz_false(tasks: ModuleType, naive_times: None) -> None:
    result = tasks.add.enqueue(2, 3)
    assert AgentRun.objects.get(pk=int(result.id)).status == Status.QUEUED
    work()
    result.refresh()
    assert result.status == compat.TaskResultStatus.SUCCESSFUL
    assert result.return_value == 5
