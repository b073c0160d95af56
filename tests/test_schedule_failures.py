"""Schedules whose runs cannot be enqueued back off instead of spinning every worker; such
inputs are refused up front; a paused queue's schedules skip their ticks; only staff who
may change schedules pause or resume them."""

from __future__ import annotations

import json
import logging
import subprocess
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_agentruns import add_schedule, pause_queue, resume_queue
from django_agentruns.admin.schedules import ScheduleForm
from django_agentruns.exceptions import InvalidInputError
from django_agentruns.models import AgentRun, Schedule
from django_agentruns.registry import all_agents
from django_agentruns.runtime.ticker import Ticker, backoff_delay
from tests import helpers

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
FAILED_LINE = "could not enqueue its run"


def bad_row(agent: str = "tests.keyed_broken", input: dict | None = None,
            last_tick: datetime = T0) -> Schedule:
    """As a row can be: written before the checks, or a setting changed since."""
    return Schedule.objects.create(name="bad", agent=agent, every=1, input=input or {},
                                   last_tick=last_tick)


def failed_lines(caplog: pytest.LogCaptureFixture) -> int:
    return sum(FAILED_LINE in r.getMessage() for r in caplog.records)


def test_backoff_doubles_from_ten_seconds_up_to_an_hour() -> None:
    assert [backoff_delay(n).total_seconds() for n in (1, 2, 3, 4, 9, 10, 50, 10**6)] == [
        10, 20, 40, 80, 2560, 3600, 3600, 3600]


@pytest.mark.django_db
@pytest.mark.parametrize("cause", ["limit_key raises", "input over the cap"])
def test_a_failing_tick_backs_off_on_the_row_and_is_logged_once_per_backoff(
        cause: str, caplog: pytest.LogCaptureFixture, settings: object) -> None:
    if cause == "limit_key raises":
        bad_row()
    else:
        bad_row("tests.noop", {"blob": "x" * 500})
        settings.AGENTRUNS = {**settings.AGENTRUNS, "MAX_INPUT_BYTES": 300}  # type: ignore[attr-defined]
    tickers = [Ticker(all_agents(), ["default"]) for _ in range(3)]
    with caplog.at_level(logging.ERROR, logger="django_agentruns.schedules"):
        at = T0 + timedelta(seconds=1)
        for _ in range(50):  # every worker's loop, many passes
            assert sum(t.tick(at) for t in tickers) == 0
        row = Schedule.objects.get()
        assert (row.failures, row.retry_at) == (1, at + timedelta(seconds=10))
        assert row.last_error
        assert failed_lines(caplog) == 1
        assert tickers[0].seconds_to_next(at) == pytest.approx(10.0)

        later = at + timedelta(seconds=10)
        for _ in range(50):
            sum(t.tick(later) for t in tickers)
        row.refresh_from_db()
        assert (row.failures, row.retry_at) == (2, later + timedelta(seconds=20))
        assert failed_lines(caplog) == 2
    assert not AgentRun.objects.exists()
    assert row.last_tick == T0  # the tick is still to be done, once it can be


@pytest.mark.django_db
def test_a_tick_that_succeeds_again_clears_the_backoff(settings: object) -> None:
    bad_row("tests.noop", {"blob": "x" * 500})
    settings.AGENTRUNS = {**settings.AGENTRUNS, "MAX_INPUT_BYTES": 300}  # type: ignore[attr-defined]
    ticker = Ticker(all_agents(), ["default"])
    assert ticker.tick(T0 + timedelta(seconds=1)) == 0
    settings.AGENTRUNS = {**settings.AGENTRUNS, "MAX_INPUT_BYTES": 1_000_000}  # type: ignore[attr-defined]
    assert ticker.tick(T0 + timedelta(seconds=12)) == 1
    row = Schedule.objects.get()
    assert (row.failures, row.retry_at, row.last_error) == (0, None, "")


@pytest.mark.django_db
@pytest.mark.parametrize(("agent", "input", "match"), [
    ("tests.keyed_broken", {}, "limit_key"),
    ("tests.noop", {"text": "a\x00b"}, "NUL"),
    ("tests.noop", {"blob": "x" * 280}, "over the limit"),  # fits alone, not with its tick
])
def test_add_schedule_and_the_admin_form_refuse_an_input_enqueue_would_refuse(
        agent: str, input: dict, match: str, settings: object) -> None:
    settings.AGENTRUNS = {**settings.AGENTRUNS, "MAX_INPUT_BYTES": 300}  # type: ignore[attr-defined]
    with pytest.raises(InvalidInputError, match=match):
        add_schedule("bad", agent, every=60, input=input)
    form = ScheduleForm(data={"name": "bad", "agent": agent, "every": "60",
                              "input": json.dumps(input), "enabled": "on"})
    assert not form.is_valid()
    assert match in str(form.errors)
    assert not Schedule.objects.exists()


@pytest.mark.django_db
def test_a_paused_queues_schedules_skip_their_ticks_and_resuming_releases_no_burst() -> None:
    add_schedule("s", "tests.noop", every=60)
    Schedule.objects.update(last_tick=T0)
    ticker = Ticker(all_agents(), ["default"])
    pause_queue("default")
    for minute in range(1, 6):  # five ticks while paused
        assert ticker.tick(T0 + timedelta(minutes=minute, seconds=1)) == 0
    assert not AgentRun.objects.exists()
    assert Schedule.objects.get().last_tick == T0 + timedelta(minutes=5)
    resume_queue("default")
    assert ticker.tick(T0 + timedelta(minutes=5, seconds=30)) == 0  # nothing saved up
    assert ticker.tick(T0 + timedelta(minutes=6, seconds=1)) == 1  # the next tick runs
    assert [r.input["tick"] for r in AgentRun.objects.all()] == [
        (T0 + timedelta(minutes=6)).isoformat()]


@pytest.mark.django_db
def test_pausing_and_resuming_schedules_needs_the_change_permission() -> None:
    add_schedule("s", "tests.noop", every=60)
    listing = reverse("admin:django_agentruns_schedule_changelist")
    row = Schedule.objects.get()

    def client_with(*codenames: str) -> Client:
        user = User.objects.create_user("-".join(codenames), password="pw", is_staff=True)
        user.user_permissions.set(Permission.objects.filter(
            content_type__app_label="django_agentruns", codename__in=codenames))
        client = Client()
        client.force_login(user)
        return client

    viewer = client_with("view_schedule")
    assert b"pause_schedules" not in viewer.get(listing).content
    viewer.post(listing, {"action": "pause_schedules", "_selected_action": [str(row.pk)]})
    assert Schedule.objects.get().enabled is True

    editor = client_with("view_schedule", "change_schedule")
    assert b"pause_schedules" in editor.get(listing).content
    editor.post(listing, {"action": "pause_schedules", "_selected_action": [str(row.pk)]})
    assert Schedule.objects.get().enabled is False


def test_a_worker_does_not_spin_on_a_schedule_it_cannot_enqueue(
        worker_env: dict[str, str]) -> None:
    bad_row(last_tick=timezone.now() - timedelta(seconds=5))
    with helpers.start_manage(["runworker"], worker_env) as worker:
        helpers.wait_until(lambda: Schedule.objects.get().failures >= 1, timeout=60,
                           message="the failed tick to be recorded")
        row = Schedule.objects.get()
        assert row.retry_at is not None
        assert "limit_key" in row.last_error
        # A bounded window well inside the first backoff (10 s): the worker's loop makes
        # many passes meanwhile, none of which may try the tick again.
        with pytest.raises(subprocess.TimeoutExpired):
            worker.popen.wait(timeout=3)  # alive and serving for the whole window
        assert Schedule.objects.get().failures == 1
        assert worker.stop() == 0, worker.output()
        assert worker.stderr.count(FAILED_LINE) == 1, worker.stderr[-3000:]
    assert not AgentRun.objects.exists()
