"""Schedules: one run per tick however many workers, the tick's time in the run's input.

A tick is enqueued by the worker whose compare-and-set UPDATE moves the schedule's
`last_tick` forward; the others find it moved. Missed ticks run only the latest, or each
one with `catch_up=True`.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.utils import timezone

from django_agentruns import add_schedule, agent, remove_schedule
from django_agentruns.exceptions import InvalidInputError, UnknownAgentError
from django_agentruns.models import AgentRun, Schedule, Status
from django_agentruns.registry import all_agents, get_agent, unregister
from django_agentruns.rules.ticks import Timing
from django_agentruns.runtime.ticker import Ticker
from tests import helpers

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def ticks_of(runs: object) -> list[str]:
    return sorted(r.input["tick"] for r in runs)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- timing (pure)


def test_intervals_are_aligned_to_the_epoch() -> None:
    every = Timing(every=30)
    assert every.latest(T0 + timedelta(seconds=29.9)) == T0
    assert every.latest(T0 + timedelta(seconds=30)) == T0 + timedelta(seconds=30)
    assert every.after(T0) == T0 + timedelta(seconds=30)
    assert every.between(T0, T0 + timedelta(seconds=95), 10) == [
        T0 + timedelta(seconds=s) for s in (30, 60, 90)]
    assert every.between(T0, T0 + timedelta(seconds=95), 2) == [
        T0 + timedelta(seconds=s) for s in (60, 90)]  # the latest ones


def test_cron_is_read_in_its_time_zone() -> None:
    paris = Timing(cron="0 7 * * *", tz="Europe/Paris")  # UTC+1 in March before the 29th
    assert paris.after(T0) == datetime(2026, 3, 2, 6, 0, tzinfo=UTC)
    assert paris.latest(datetime(2026, 3, 2, 6, 0, tzinfo=UTC)) == \
        datetime(2026, 3, 2, 6, 0, tzinfo=UTC)
    # After the DST change, 7:00 in Paris is 5:00 UTC.
    assert paris.after(datetime(2026, 3, 30, tzinfo=UTC)) == datetime(2026, 3, 30, 5, 0,
                                                                      tzinfo=UTC)
    hourly = Timing(cron="0 * * * *")
    assert hourly.between(T0, T0 + timedelta(hours=3, minutes=5), 100) == [
        T0 + timedelta(hours=h) for h in (1, 2, 3)]


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"cron": "61 * * * *"}, "bad cron expression"),
    ({"cron": "* * *"}, "bad cron expression"),
    ({"every": 0}, "every must be"),
    ({"every": 1.5}, "every must be"),
    ({"cron": "* * * * *", "every": 5}, "exactly one"),
    ({}, "exactly one"),
    ({"every": 5, "tz": "Mars/Olympus"}, "unknown time zone"),
    ({"every": 5, "input": [1]}, "must be a JSON object"),
    ({"every": 5, "input": {"x": object()}}, "JSON"),
])
def test_add_schedule_refuses_bad_input_and_writes_nothing(
    db: None, kwargs: dict[str, object], match: str,
) -> None:
    with pytest.raises(InvalidInputError, match=match):
        add_schedule("nightly", "tests.noop", **kwargs)  # type: ignore[arg-type]
    assert not Schedule.objects.exists()


def test_add_schedule_refuses_an_unknown_agent_or_a_bad_name(db: None) -> None:
    with pytest.raises(UnknownAgentError):
        add_schedule("nightly", "tests.nope", every=5)
    with pytest.raises(InvalidInputError, match="Schedule name"):
        add_schedule("a b", "tests.noop", every=5)
    assert not Schedule.objects.exists()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"schedule": "nonsense"}, "bad cron expression"),
    ({"every": -1}, "every must be"),
    ({"schedule": "* * * * *", "schedule_tz": "Nowhere/Land"}, "unknown time zone"),
    ({"every": 5, "catch_up": "yes"}, "catch_up"),
])
def test_agent_refuses_a_bad_schedule_at_registration(kwargs: dict[str, object],
                                                       match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        agent("tests.bad_schedule", **kwargs)  # type: ignore[arg-type]
    assert "tests.bad_schedule" not in all_agents()


def test_add_and_remove_a_schedule(db: None) -> None:
    at = timezone.now()
    row = add_schedule("reports", "tests.noop", cron="0 7 * * *", input={"kind": "daily"})
    assert (row.agent, row.cron, row.every, row.origin) == ("tests.noop", "0 7 * * *", None,
                                                           Schedule.Origin.DATABASE)
    assert row.last_tick is not None
    assert row.last_tick <= at
    again = add_schedule("reports", "tests.noop", every=60)  # same name: replaced
    assert again.pk == row.pk
    assert again.every == 60
    assert again.cron == ""
    assert remove_schedule("reports") is True
    assert remove_schedule("reports") is False


# --------------------------------------------------------------------------- ticking


def make(every: int = 60, *, catch_up: bool = False, behind: int = 0) -> Schedule:
    """A schedule of tests.noop whose last tick is `behind` ticks before T0's."""
    add_schedule("s", "tests.noop", every=every, input={"k": 1})
    Schedule.objects.filter(name="s").update(
        catch_up=catch_up, last_tick=T0 - timedelta(seconds=every * behind))
    return Schedule.objects.get(name="s")


def test_three_tickers_enqueue_one_run_per_tick(db: None) -> None:
    make(every=1)
    tickers = [Ticker(all_agents(), ["default"]) for _ in range(3)]
    for second in range(1, 11):
        at = T0 + timedelta(seconds=second, milliseconds=10)
        assert sum(t.tick(at) for t in tickers) == 1
        assert sum(t.tick(at) for t in tickers) == 0  # the tick is done
    runs = AgentRun.objects.filter(agent="tests.noop")
    assert ticks_of(runs) == [(T0 + timedelta(seconds=s)).isoformat() for s in range(1, 11)]
    assert all(r.input["k"] == 1 and r.status == Status.QUEUED for r in runs)


@pytest.mark.parametrize(("catch_up", "expected"), [(False, [0]), (True, [4, 3, 2, 1, 0])])
def test_missed_ticks_run_only_the_latest_unless_catch_up(
    db: None, catch_up: bool, expected: list[int],
) -> None:
    make(every=60, catch_up=catch_up, behind=5)
    assert Ticker(all_agents(), ["default"]).tick(T0 + timedelta(seconds=1)) == len(expected)
    assert ticks_of(AgentRun.objects.all()) == sorted(
        (T0 - timedelta(minutes=m)).isoformat() for m in expected)
    assert Schedule.objects.get().last_tick == T0


def test_catch_up_is_capped(db: None, settings: object) -> None:
    settings.AGENTRUNS = {**settings.AGENTRUNS, "SCHEDULE_MAX_CATCH_UP": 3}  # type: ignore[attr-defined]
    make(every=60, catch_up=True, behind=10)
    assert Ticker(all_agents(), ["default"]).tick(T0) == 3
    assert ticks_of(AgentRun.objects.all())[-1] == T0.isoformat()


def test_a_paused_schedule_or_one_on_another_queue_does_not_tick(db: None) -> None:
    make(every=60, behind=2)
    assert Ticker(all_agents(), ["other"]).tick(T0) == 0  # not serving the agent's queue
    Schedule.objects.update(enabled=False)
    assert Ticker(all_agents(), ["default"]).tick(T0) == 0
    assert not AgentRun.objects.exists()


def test_an_edit_in_the_admin_wins_over_a_tickers_stale_read(db: None) -> None:
    row = make(every=60, behind=1)
    ticker = Ticker(all_agents(), ["default"])
    ticker.tick(T0 - timedelta(seconds=30))  # reads the row; nothing due yet
    row.every = 3600
    row.save()  # updated_at moves: the stale read's compare-and-set fails
    assert ticker.tick(T0 + timedelta(seconds=1)) == 0
    assert not AgentRun.objects.exists()


def test_declared_schedules_are_written_by_the_workers_that_have_the_agent(db: None) -> None:
    assert get_agent("tests.scheduled").schedule_timing == Timing(every=3600)
    Ticker(all_agents(), ["scheduled"]).tick()
    row = Schedule.objects.get(name="tests.scheduled")
    assert (row.agent, row.every, row.catch_up, row.origin) == (
        "tests.scheduled", 3600, True, Schedule.Origin.CODE)
    with pytest.raises(InvalidInputError, match="declared by @agent"):
        remove_schedule("tests.scheduled")
    with pytest.raises(InvalidInputError, match="declared by @agent"):
        add_schedule("tests.scheduled", "tests.noop", every=5)


def test_a_schedule_no_longer_declared_is_dropped(db: None) -> None:
    @agent("tests.was_scheduled", queue="scheduled", every=60)
    def was(ctx: object) -> None: ...

    try:
        Ticker(all_agents(), ["scheduled"]).tick()
        assert Schedule.objects.filter(name="tests.was_scheduled").exists()
        unregister("tests.was_scheduled")

        @agent("tests.was_scheduled", queue="scheduled")
        def was(ctx: object) -> None: ...

        Ticker(all_agents(), ["scheduled"]).tick()
        assert not Schedule.objects.filter(name="tests.was_scheduled").exists()
    finally:
        unregister("tests.was_scheduled")


def test_the_schedules_command_lists_the_next_tick(db: None) -> None:
    add_schedule("reports", "tests.noop", cron="0 7 * * *", tz="Europe/Paris")
    out = StringIO()
    call_command("schedules", stdout=out)
    lines = out.getvalue().splitlines()
    [reports] = [x for x in lines if x.startswith("reports:")]
    assert "cron '0 7 * * *' (Europe/Paris)" in reports
    assert "next tick 20" in reports
    assert any(x.startswith("tests.scheduled: tests.scheduled, every 3600s, catch-up")
               for x in lines)


# --------------------------------------------------------------------------- real workers


@pytest.mark.slow
def test_three_workers_enqueue_exactly_one_run_per_tick_over_ten_seconds(
    worker_env: dict[str, str],
) -> None:
    add_schedule("every-second", "tests.noop", every=1)
    Schedule.objects.update(catch_up=True)  # a late pass still runs each tick, once
    workers = [helpers.start_manage(["runworker", "--concurrency", "2"], worker_env)
               for _ in range(3)]
    try:
        for w in workers:
            helpers.wait_until(lambda w=w: "serving queues" in w.stderr, timeout=60)
        start = Schedule.objects.get().last_tick
        assert start is not None
        helpers.wait_until(lambda: Schedule.objects.get().last_tick >= start + timedelta(
            seconds=10), timeout=30, message="ten more ticks")
    finally:
        for w in workers:
            assert w.stop() == 0, w.output()
    end = Schedule.objects.get().last_tick
    ticks = [datetime.fromisoformat(t) for t in ticks_of(AgentRun.objects.all())]
    assert len(ticks) == len(set(ticks)), "a tick ran twice"
    assert ticks[-1] == end
    # Every second from the first tick to the last, each once.
    assert ticks == [ticks[0] + timedelta(seconds=s) for s in range(len(ticks))]
    assert len(ticks) >= 10


@pytest.mark.slow
@pytest.mark.parametrize(("catch_up", "runs"), [(False, 1), (True, 5)])
def test_a_restarted_worker_runs_the_missed_ticks_or_only_the_latest(
    worker_env: dict[str, str], catch_up: bool, runs: int,
) -> None:
    add_schedule("hourly", "tests.noop", every=3600)
    latest = Schedule.objects.get().last_tick
    assert latest is not None
    # The workers were down for five ticks.
    Schedule.objects.update(catch_up=catch_up, last_tick=latest - timedelta(hours=5))
    with helpers.start_manage(["runworker", "--burst"], worker_env) as worker:
        assert worker.wait(60) == 0, worker.output()
    done = AgentRun.objects.filter(status=Status.SUCCEEDED)
    assert ticks_of(done) == sorted((latest - timedelta(hours=h)).isoformat()
                                    for h in range(runs))
    assert Schedule.objects.get().last_tick == latest
    assert json.dumps(done.first().output)  # the runs ran
