"""What an operator reads from the commands: runworker's help and log lines, why, --reload."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.core.management import call_command

from django_agentruns import api, transitions
from django_agentruns.management import logs
from django_agentruns.models import AgentRun, WorkerRecord
from django_agentruns.outcomes import AttemptRef
from django_agentruns.registry import scope_policy
from django_agentruns.rules import policy
from tests import helpers


@contextmanager
def clean_logging() -> Iterator[logging.Logger]:
    """The app's and the root logger as a project without LOGGING leaves them; restored.

    Entered in the test body: pytest adds its capture handler to the root for each phase.
    """
    app, root = logging.getLogger(logs.APP_LOGGER), logging.getLogger()
    saved = (app.level, app.handlers[:], root.handlers[:])
    app.setLevel(logging.NOTSET)
    app.handlers[:] = []
    root.handlers[:] = []
    try:
        yield app
    finally:
        app.level, app.handlers[:], root.handlers[:] = saved[0], saved[1], saved[2]


def test_without_logging_config_only_the_apps_logger_gets_a_handler() -> None:
    with clean_logging() as app:
        logs.configure(1)
        assert app.level == logging.INFO
        assert len(app.handlers) == 1
        assert logging.getLogger().handlers == []  # nothing else of the project prints twice


def test_a_projects_own_logging_is_left_alone() -> None:
    with clean_logging() as app:
        project = logging.StreamHandler(io.StringIO())
        logging.getLogger().addHandler(project)  # e.g. LOGGING with a root handler
        app.setLevel(logging.WARNING)
        logs.configure(1)
        assert app.handlers == []
        assert app.level == logging.WARNING
        assert logging.getLogger().handlers == [project]
        logging.getLogger("django_agentruns.worker").warning("once")
        assert project.stream.getvalue() == "once\n"  # type: ignore[attr-defined]
        logs.configure(3)  # -v 3 asks for DEBUG explicitly
        assert app.level == logging.DEBUG


def test_runworker_help_shows_the_defaults() -> None:
    result = helpers.run_manage(["help", "runworker"], helpers.subprocess_env(
        {"ENGINE": "django.db.backends.sqlite3", "NAME": str(helpers.TMP_DIR / "help.db")}))
    text = " ".join(result.stdout.split())
    for expected in ("default 1)", "default: POLL_INTERVAL, 1.0", "default: GRACE, 5.0",
                     "default: DEFAULT_QUEUE, 'default'", "--reload"):
        assert expected in text, expected


# --------------------------------------------------------------------------- why


def why(run_id: int) -> str:
    out = io.StringIO()
    call_command("why", str(run_id), stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_why_says_what_a_running_run_is_doing_without_not_starting() -> None:
    run = api.enqueue("tests.noop")
    [claimed] = transitions.claim("host:9:w", ["default"], 1, scope_policy(), {}, 60.0)
    output = why(run.pk)
    assert output.startswith(f"run #{run.pk} (tests.noop) is running, not queued (attempt 1, "
                             "worker host:9:w")
    assert "not starting" not in output
    assert claimed.pk == run.pk


@pytest.mark.django_db
def test_why_gives_a_dead_letter_its_error_and_what_to_do() -> None:
    run = api.enqueue("tests.not_retryable")
    [claimed] = transitions.claim("w", ["default"], 1, scope_policy(), {}, 60.0)
    transitions.settle_failed(AttemptRef(claimed.pk, claimed.attempt, "w", 60.0),
                              policy.Failure(retryable=False),
                              transitions.ErrorInfo("NotRetryable", "bad credentials", ""))
    lines = why(run.pk).splitlines()
    assert lines[0] == f"run #{run.pk} (tests.not_retryable) is failed, not queued " \
                       "(not_retryable)"
    assert lines[1] == "- last error: NotRetryable: bad credentials"
    assert lines[2].startswith("- Not retryable: fix the cause first")


# --------------------------------------------------------------------------- real workers


@pytest.mark.slow
def test_a_dead_letter_logs_its_reason(worker_env: dict[str, str]) -> None:
    exhausted = api.enqueue("tests.always_fails")
    hopeless = api.enqueue("tests.not_retryable")
    done = helpers.run_manage(["runworker", "--burst"], worker_env)
    assert done.returncode == 0, done.stderr
    assert (f"run {exhausted.pk} tests.always_fails attempt 3 dead_lettered "
            "(retries_exhausted): ConnectionError: upstream unreachable") in done.stderr
    assert (f"run {hopeless.pk} tests.not_retryable attempt 1 dead_lettered "
            "(not_retryable): NotRetryable: bad credentials") in done.stderr
    assert done.stderr.count("dead_lettered") == 2  # each line once


@pytest.mark.slow
def test_reload_restarts_the_worker_gracefully_when_code_changes(
        worker_env: dict[str, str]) -> None:
    watched = Path(helpers.REPO_ROOT / "tests" / "testapp" / "agents.py")
    process = helpers.start_manage(["runworker", "--reload"], worker_env)
    try:
        reload_and_check(process, watched)
    finally:
        # The reloader's child is not the process the helper started: end the whole group
        # (the helper gave it a session of its own), before the test database goes.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.close()


def reload_and_check(process: helpers.ManageProcess, watched: Path) -> None:
    first = helpers.wait_until(lambda: WorkerRecord.objects.first(), timeout=60,
                               message="the first worker's record")
    assert first.pid != process.pid  # the worker runs in the reloader's child
    stat = watched.stat()
    edits = iter(range(1, 1000))

    def touched_and_restarted() -> bool:
        # "Edit" it, later each time: the reloader may take its first look after one.
        os.utime(watched, (stat.st_atime, stat.st_mtime + next(edits)))
        return WorkerRecord.objects.exclude(worker_id=first.worker_id).exists()

    try:
        helpers.wait_until(touched_and_restarted, timeout=60, interval=1.0,
                           message=f"a new worker after the change\n{process.output()}")
    finally:
        os.utime(watched, (stat.st_atime, stat.st_mtime))
    # The old worker stopped gracefully: its record is gone, not left to lapse.
    assert not WorkerRecord.objects.filter(worker_id=first.worker_id).exists()
    second = WorkerRecord.objects.get()
    run = api.enqueue("tests.noop")
    helpers.wait_until(lambda: AgentRun.objects.get(pk=run.pk).status == "succeeded",
                       message="the reloaded worker to run a run")
    assert second.pid != first.pid
    assert "agents.py changed: stopping the worker, then reloading" in process.stderr
