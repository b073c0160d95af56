"""Windows of limit keys: runs started per rolling minute, tokens per minute and cost per
day, reserved at claim and settled with recorded usage; key patterns give each matching
key its own window; a window without room keeps runs queued and says until when."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.core import checks
from django.test import override_settings
from django.utils import timezone

from django_agentruns import InvalidInputError, enqueue, enqueue_many, set_limit, transitions
from django_agentruns.models import AgentLimit, AgentRun, KeyWindowEntry, RunEvent, Status
from django_agentruns.ops.visibility import KEY_WINDOW, why_not_started
from django_agentruns.runtime.worker import Worker
from tests import helpers
from tests.settings import AGENTRUNS as TEST_SETTINGS

SCOPES = transitions.ScopePolicy()


def burst(concurrency: int = 8) -> None:
    Worker(burst=True, reap_interval=0, max_contention_wait=10,
           concurrency=concurrency).run(install_signals=False)


def claim(at: datetime, worker: str = "w", limit: int = 20) -> list[AgentRun]:
    return transitions.claim_limited(worker, ["default"], limit, SCOPES, {}, 60.0, at)


def keyed(key: str, count: int, agent: str = "tests.keyed", **input: Any) -> list[AgentRun]:
    return enqueue_many([{"agent": agent, "input": {"key": key, **input}}
                         for _ in range(count)])


def succeeded(runs: list[AgentRun]) -> int:
    return AgentRun.objects.filter(pk__in=[r.pk for r in runs], status=Status.SUCCEEDED).count()


# --------------------------------------------------------------------------- set_limit


@pytest.mark.django_db(transaction=True)
def test_set_limit_leaves_fields_not_given_and_none_resets_one() -> None:
    set_limit("k", 5)
    set_limit("k", per_minute=100, tokens_per_minute=50_000)
    row = AgentLimit.objects.get(key="k")
    assert (row.max_running, row.per_minute, row.tokens_per_minute, row.cost_per_day) == \
        (5, 100, 50_000, None)
    set_limit("k", cost_per_day=12.5, per_minute=None)
    row.refresh_from_db()
    assert (row.max_running, row.per_minute, row.tokens_per_minute, row.cost_per_day) == \
        (5, None, 50_000, 12.5)
    set_limit("tenant:*", cost_per_day=3)  # a pattern is a key like any other here
    assert AgentLimit.objects.get(key="tenant:*").cost_per_day == 3.0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("field", "value"), [("per_minute", -1), ("per_minute", 1.5),
                                              ("tokens_per_minute", "9"),
                                              ("cost_per_day", float("nan")),
                                              ("cost_per_day", -0.1)])
def test_a_bad_window_is_a_clear_error_that_writes_nothing(field: str, value: Any) -> None:
    with pytest.raises(InvalidInputError, match=field):
        set_limit("k", **{field: value})
    assert not AgentLimit.objects.exists()


@pytest.mark.django_db
def test_the_limits_setting_takes_numbers_and_dicts_of_fields() -> None:
    good = {"a": 3, "b": {"per_minute": 10, "tokens_per_minute": 1000},
            "tenant:*": {"cost_per_day": 5}}
    with override_settings(AGENTRUNS={**TEST_SETTINGS, "LIMITS": good}):
        assert not [e for e in checks.run_checks() if e.id == "agentruns.E011"]
    with override_settings(AGENTRUNS={**TEST_SETTINGS, "LIMITS": {"b": {"per_hour": 3}}}):
        errors = [e for e in checks.run_checks() if e.id == "agentruns.E011"]
    assert errors
    assert "per_hour" in errors[0].msg


# --------------------------------------------------------------------------- per minute


@pytest.mark.django_db(transaction=True)
def test_a_per_minute_window_starts_no_more_in_any_rolling_minute() -> None:
    set_limit("k", per_minute=3)
    keyed("k", 10)
    at = transitions.now()
    assert len(claim(at)) == 3
    assert claim(at + timedelta(seconds=30)) == []  # still the same minute
    # The runs finishing does not free the window: it counts starts, not running runs.
    AgentRun.objects.filter(status=Status.RUNNING).update(status=Status.SUCCEEDED)
    assert claim(at + timedelta(seconds=59)) == []
    assert len(claim(at + timedelta(seconds=61))) == 3


@pytest.mark.django_db(transaction=True)
def test_a_full_window_keeps_runs_queued_and_why_says_which_and_until_when() -> None:
    set_limit("k", per_minute=2)
    runs = keyed("k", 4, seconds=0)
    burst()
    assert succeeded(runs) == 2
    held = AgentRun.objects.get(pk=runs[3].pk)
    assert (held.status, held.attempt) == (Status.QUEUED, 0)  # no attempt spent
    holds = why_not_started(held)
    window = [h for h in holds if h.code == KEY_WINDOW]
    assert window, holds
    assert "per_minute window of its limit key 'k'" in window[0].message
    assert "has room at" in window[0].message


# --------------------------------------------------------------------------- tokens, cost


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("tokens", "starts"), [(1000, 4), (500, 8)])
def test_tokens_per_minute_is_settled_with_the_usage_recorded(tokens: int, starts: int) -> None:
    """Runs that report half their 1000-token estimate let twice as many in."""
    set_limit("llm", tokens_per_minute=4000)
    runs = keyed("llm", 20, agent="tests.estimated", tokens=tokens)
    burst(concurrency=1)
    assert succeeded(runs) == starts
    burst(concurrency=8)  # a wider claim: the reservations still bound it
    assert succeeded(runs) == starts


@pytest.mark.django_db(transaction=True)
def test_estimates_are_reserved_at_claim_and_an_overspend_is_never_stopped() -> None:
    set_limit("llm", tokens_per_minute=2500)
    runs = keyed("llm", 5, agent="tests.estimated", tokens=6000)
    burst()  # 0, 1000, 2000 reserved before each of three: under 2500
    assert succeeded(runs) == 3  # each overspent its estimate sixfold; none was stopped
    entries = KeyWindowEntry.objects.order_by("id")
    assert [(e.reserved_tokens, e.reserved_cost, e.used_tokens, e.attempt)
            for e in entries] == [(1000, 0.5, 6000, 1)] * 3
    assert claim(transitions.now()) == []  # 18,000 used: no room for a minute


@pytest.mark.django_db(transaction=True)
def test_a_cost_per_day_window_uses_the_keys_recent_average_without_an_estimate() -> None:
    set_limit("cheap", cost_per_day=1.0)
    runs = keyed("cheap", 6, agent="tests.estimated", cost=0.4)
    burst(concurrency=1)
    assert succeeded(runs) == 3  # 0, 0.4, 0.8 spent before each; 1.2 after
    assert AgentLimit.objects.filter(key="cheap").exists()


@pytest.mark.django_db(transaction=True)
def test_a_reclaimed_run_gives_back_its_lost_attempts_reservation() -> None:
    set_limit("llm", tokens_per_minute=1500)
    first, _ = keyed("llm", 2, agent="tests.estimated")
    at = transitions.now()
    started = transitions.claim_limited("w1", ["default"], 1, SCOPES, {}, 5.0, at)
    assert [r.pk for r in started] == [first.pk]
    # w1 died; its lease lapsed; w2 reclaims the run: a new attempt, a new reservation.
    later = at + timedelta(seconds=10)
    reclaimed = transitions.claim("w2", ["default"], 1, SCOPES, {}, 60.0, later)
    assert [(r.pk, r.attempt) for r in reclaimed] == [(first.pk, 2)]
    entries = dict(KeyWindowEntry.objects.filter(run_id=first.pk)
                   .values_list("attempt", "reserved_tokens"))
    assert entries == {1: 1000, 2: 1000}
    use = transitions.window_use(["llm"], later)["llm"]
    assert (use.starts, use.tokens) == (2, 1000.0)  # the lost attempt's 1000 is given back
    assert claim(later) != []  # 1000 < 1500: the second run starts


# --------------------------------------------------------------------------- patterns


@pytest.mark.django_db(transaction=True)
def test_a_key_pattern_gives_each_matching_key_its_own_window() -> None:
    set_limit("tenant:*", per_minute=2)
    a, b = keyed("tenant:a", 4, seconds=0), keyed("tenant:b", 4, seconds=0)
    other = keyed("other", 4, seconds=0)
    burst()
    assert (succeeded(a), succeeded(b), succeeded(other)) == (2, 2, 4)
    assert AgentLimit.objects.get(key="tenant:a").per_minute is None  # the pattern's


@pytest.mark.django_db(transaction=True)
def test_a_settings_pattern_gives_each_matching_key_its_own_window() -> None:
    with override_settings(AGENTRUNS={**TEST_SETTINGS,
                                      "LIMITS": {"tenant:*": {"per_minute": 1}, "tenant:vip": 3}}):
        a, vip = keyed("tenant:a", 3, seconds=0), keyed("tenant:vip", 3, seconds=0)
        burst()
        # tenant:vip's own entry (max_running 3) still takes the pattern's window.
        assert (succeeded(a), succeeded(vip)) == (1, 1)


# --------------------------------------------------------------------------- workers


def _starts(ids: list[int]) -> list[float]:
    return sorted(t.timestamp() for t in RunEvent.objects.filter(
        run_id__in=ids, type="run.started").values_list("created_at", flat=True))


@pytest.mark.slow
def test_a_per_minute_window_holds_across_three_workers(worker_env: dict[str, str]) -> None:
    """The window is full when the workers meet it: five starts of the last minute (runs of
    a queue nobody serves), leaving it one by one 2 s apart. Each slot that frees goes to
    one start of one worker, never two, so the test sees the minute roll over without
    waiting a whole one."""
    set_limit("rpm", per_minute=5)
    workers = [helpers.start_manage(["runworker", "--concurrency", "4"], worker_env)
               for _ in range(3)]
    try:
        for worker in workers:
            helpers.wait_until(lambda w=worker: "serving queues" in w.stderr,
                               message=f"a worker up\n{worker.output()}")
        earlier = [enqueue("tests.keyed", {"key": "rpm"}, queue="unserved") for _ in range(5)]
        now = timezone.now()
        KeyWindowEntry.objects.bulk_create(
            KeyWindowEntry(key="rpm", run_id=run.pk, attempt=1,
                           started_at=now - timedelta(seconds=58 - 2 * i))
            for i, run in enumerate(earlier))
        ids = [r.pk for r in keyed("rpm", 20, seconds=0.05)]
        helpers.wait_until(lambda: len(_starts(ids)) >= 5, timeout=60,
                           message="a start in each slot the earlier minute frees")
    finally:
        for worker in workers:
            worker.stop()
    starts = sorted(t.timestamp() for t in KeyWindowEntry.objects.filter(key="rpm")
                    .values_list("started_at", flat=True))
    assert all(later - earlier >= 60 for earlier, later in zip(starts, starts[5:], strict=False)), \
        starts
    assert (len(_starts(ids)), len(starts)) == (5, 10), starts  # the next slot is a minute on


@pytest.mark.slow
def test_a_killed_worker_gives_its_reservation_back(worker_env: dict[str, str]) -> None:
    env = {**worker_env, "AGENTRUNS_TEST_SETTINGS": json.dumps({"LEASE_TTL": 2.0})}
    set_limit("llm", tokens_per_minute=1000)
    first = enqueue("tests.estimated", {"key": "llm", "first_seconds": 600, "tokens": 0})
    doomed = helpers.start_manage(["runworker", "--concurrency", "2"], env)
    # Its reclaimed attempt ends at once: the window then holds what it used (nothing).
    helpers.wait_until(lambda: AgentRun.objects.get(pk=first.pk).status == Status.RUNNING,
                       message="the long run to start")
    second = enqueue("tests.estimated", {"key": "llm", "tokens": 0})
    doomed.kill()
    doomed.wait()
    assert AgentRun.objects.get(pk=second.pk).status == Status.QUEUED
    with helpers.start_manage(["runworker", "--concurrency", "2"], env):
        # The reclaimed run's lost attempt used nothing: its 1000 reserved are free again.
        helpers.wait_until(lambda: AgentRun.objects.get(pk=second.pk).status ==
                           Status.SUCCEEDED, timeout=30, message="the second run to start")
        helpers.wait_until(lambda: AgentRun.objects.get(pk=first.pk).status ==
                           Status.SUCCEEDED, timeout=30, message="the reclaimed run to finish")
    # Long before the first attempt's minute was over.
    start = KeyWindowEntry.objects.get(run_id=second.pk).started_at
    lost = KeyWindowEntry.objects.get(run_id=first.pk, attempt=1).started_at
    assert (start - lost).total_seconds() < 60


# --------------------------------------------------------------------------- operators


@pytest.mark.django_db(transaction=True)
def test_the_limits_page_edits_windows_and_shows_their_use_and_the_spend_per_day() -> None:
    from django.contrib.auth.models import Permission, User
    from django.test import Client
    from django.urls import reverse

    user = User.objects.create_user("op", password="pw", is_staff=True)
    for perm in ("view_agentlimit", "add_agentlimit", "change_agentlimit"):
        user.user_permissions.add(Permission.objects.get(codename=perm))
    client = Client()
    client.force_login(user)
    add = reverse("admin:django_agentruns_agentlimit_add")
    response = client.post(add, {"key": "tenant:*", "cost_per_day": "5"})
    assert response.status_code == 302, response.content.decode()[:2000]
    response = client.post(add, {"key": "llm", "per_minute": "10",
                                 "tokens_per_minute": "4000"})
    assert response.status_code == 302, response.content.decode()[:2000]
    bad = client.post(add, {"key": "other", "per_minute": "-3"})
    assert bad.status_code == 200
    assert not AgentLimit.objects.filter(key="other").exists()
    row = AgentLimit.objects.get(key="llm")
    assert (row.max_running, row.per_minute, row.tokens_per_minute) == (None, 10, 4000)
    keyed("llm", 2, agent="tests.estimated", tokens=700, cost=0.25)
    keyed("tenant:a", 1, agent="tests.estimated", tokens=0, cost=1.5)
    burst()
    html = client.get(reverse("admin:django_agentruns_agentlimit_changelist")).content.decode()
    assert "2/10 started per minute; 1,400/4,000 tokens per minute" in html
    assert "0.5 (1,400 tokens)" in html  # llm's spend in the last day
    assert "1.5 (0 tokens)" in html  # every tenant's, on the pattern's row and tenant:a's


@pytest.mark.django_db(transaction=True)
def test_a_gauge_shows_how_full_each_window_is() -> None:
    from django_agentruns.ops import metrics

    set_limit("llm", per_minute=4, tokens_per_minute=4000)
    keyed("llm", 1, agent="tests.estimated", tokens=1000)
    burst()
    backlog = metrics.read_backlog()
    assert backlog.window_fill == {("llm", "per_minute"): 0.25,
                                   ("llm", "tokens_per_minute"): 0.25}
    if metrics.prometheus_client is not None:
        families = {f.name: f for f in metrics.BacklogCollector._families(backlog, set())}
        samples = {tuple(s.labels.values()): s.value
                   for s in families["agentruns_limit_window_fill"].samples}
        assert samples == {("llm", "per_minute"): 0.25, ("llm", "tokens_per_minute"): 0.25}


# --------------------------------------------------------------------------- statements


@pytest.mark.django_db(transaction=True)
def test_a_windowed_key_adds_at_most_one_statement_to_its_claims() -> None:
    """Issue 28: keys without windows keep today's claim; a key with windows adds at most
    one statement (the INSERT of its runs' entries: its windows are read in the statement
    that counts the keys' running runs, after the keys' locks)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    set_limit("plain", 100)
    set_limit("windowed", 100, per_minute=1000, tokens_per_minute=10**7, cost_per_day=1e6)
    keyed("plain", 10, agent="tests.estimated")
    keyed("windowed", 10, agent="tests.estimated")
    at = transitions.now()

    def statements(key: str) -> list[str]:
        AgentLimit.objects.exclude(key=key).update(closed_until=at + timedelta(hours=1))
        AgentLimit.objects.filter(key=key).update(closed_until=None)
        claim(at, limit=2)  # every statement's shape compiled once
        with CaptureQueriesContext(connection) as captured:
            started = claim(at, limit=4)
        assert [r.limit_key for r in started] == [key] * 4
        return [q["sql"] for q in captured.captured_queries]

    plain, windowed = statements("plain"), statements("windowed")
    assert len(windowed) == len(plain) + 1, (plain, windowed)
    entries = KeyWindowEntry._meta.db_table
    assert not any(entries in sql for sql in plain)
    read = [i for i, sql in enumerate(windowed) if entries in sql and sql.startswith("SELECT")]
    locked = [i for i, sql in enumerate(windowed) if "agentlimit" in sql and "BEGIN" not in sql]
    assert len(read) == 1
    assert read[0] > locked[1]
    assert KeyWindowEntry.objects.filter(key="windowed").count() == 6  # 2 + 4 reserved
