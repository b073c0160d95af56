"""The README's examples run as printed: each is taken from README.md and executed here.

A snippet that stops working fails this test, not a new user's first hour.
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings

from django_agentruns.runtime.worker import Worker
from django_agentruns.tasks import TASKS_AVAILABLE, UNAVAILABLE_REASON, compat
from tests import helpers

README = (helpers.REPO_ROOT / "README.md").read_text()
TASK_MODULE = "tests.testapp.readme_tasks"  # "myapp/tasks.py": a module of an installed app


def section(title: str) -> str:
    start = README.index(title)
    found = re.compile(r"\n##+ ").search(README, start + len(title))
    return README[start:found.start() if found else None]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


@pytest.fixture
def readme_tasks() -> Iterator[tuple[dict[str, Any], list[str]]]:
    if not TASKS_AVAILABLE:
        pytest.skip(UNAVAILABLE_REASON)
    settings_block, task_block, use_block = python_blocks(
        section("### Django's tasks framework"))[:3]
    namespace: dict[str, Any] = {}
    exec(settings_block, namespace)
    if compat.SOURCE != "django.tasks":  # Django 5.2: the backport, as the comment says
        task_block = task_block.replace("from django.tasks import", "from django_tasks import")
    module = types.ModuleType(TASK_MODULE)
    sys.modules[TASK_MODULE] = module
    try:
        with override_settings(TASKS=namespace["TASKS"]):
            exec(task_block, module.__dict__)
            yield namespace["TASKS"], [task_block, use_block]
    finally:
        del sys.modules[TASK_MODULE]


@pytest.mark.django_db(transaction=True)
def test_the_django_tasks_example_runs_as_printed(
        readme_tasks: tuple[dict[str, Any], list[str]]) -> None:
    tasks_setting, (_, use_block) = readme_tasks
    assert "emails" in tasks_setting["default"]["QUEUES"]
    use_block = use_block.replace("from myapp.tasks import", f"from {TASK_MODULE} import")
    lines = use_block.strip().splitlines()
    namespace: dict[str, Any] = {}
    exec("\n".join(lines[:-1]), namespace)  # imports and enqueue
    assert eval(lines[-1].split("#")[0], namespace) == compat.TaskResultStatus.READY
    queues = re.search(r"runworker --queues ([\w,]+)", section("### Django's tasks framework"))
    assert queues is not None
    Worker(queues[1].split(","), burst=True).run(install_signals=False)
    done = namespace["send_receipt"].get_result(namespace["result"].id)
    assert done.status == compat.TaskResultStatus.SUCCESSFUL
    assert done.return_value == "receipt for order 42 sent"
