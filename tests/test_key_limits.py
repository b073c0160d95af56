"""Limits per key, across every worker.

A run's limit key is resolved at enqueue; a key's limit (LIMITS, `set_limit`) bounds how
many of its runs run at once across all workers, race-free; a 429 with Retry-After closes
the key for every worker until then. Keys without a limit are unlimited.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db.models import Max

from django_agentruns import InvalidInputError, enqueue, enqueue_many, set_limit, transitions
from django_agentruns.models import AgentLimit, AgentRun, RunEvent, Status, WorkerRecord
from django_agentruns.runtime.worker import Worker
from tests import helpers

SETTINGS = {"LEASE_TTL": 2.0, "POLL_INTERVAL": 0.05, "REAP_INTERVAL": 0.5,
            "BACKOFF_BASE": 0.0, "BACKOFF_CAP": 0.0}


def burst() -> None:
    Worker(burst=True, reap_interval=0, max_contention_wait=10,
           concurrency=8).run(install_signals=False)


def running(key: str) -> int:
    return AgentRun.objects.filter(status=Status.RUNNING, limit_key=key).count()


@pytest.mark.slow
def test_three_workers_never_run_more_of_a_key_than_its_limit(
    worker_env: dict[str, str],
) -> None:
    set_limit("shared", 4)
    samples: list[int] = []
    workers = [helpers.start_manage(["runworker", "--concurrency", "10"], worker_env)
               for _ in range(3)]
    try:
        # The runs are queued once all three serve: on a loaded machine the first worker
        # up could otherwise drain the 2 s of work before the others start.
        helpers.wait_until(lambda: WorkerRecord.objects.count() == 3, timeout=60,
                           message="three workers to serve")
        runs = enqueue_many([{"agent": "tests.keyed",
                              "input": {"key": "shared", "seconds": 0.15}}
                             for _ in range(60)])
        free = enqueue_many([{"agent": "tests.keyed", "input": {"seconds": 0.15}}
                             for _ in range(20)])  # no key: not held back by it
        ids = [r.pk for r in runs]
        deadline = time.monotonic() + 90
        while AgentRun.objects.filter(pk__in=ids, status=Status.SUCCEEDED).count() < 60:
            samples.append(running("shared"))
            assert time.monotonic() < deadline, f"not all finished; samples {samples[-20:]}"
            time.sleep(0.01)
    finally:
        for worker in workers:
            worker.stop()
    assert max(samples) <= 4, samples
    assert 4 in samples, "the limit was never reached: the test proved nothing"
    assert AgentRun.objects.filter(pk__in=[r.pk for r in free],
                                   status=Status.SUCCEEDED).count() == 20
    # The work was spread over the workers (each took some of the key's runs).
    assert len(set(AgentRun.objects.filter(pk__in=ids).values_list("claimed_by", flat=True))) > 1


@pytest.mark.slow
def test_a_429_keeps_every_worker_off_its_key_until_the_retry_after(
    worker_env: dict[str, str],
) -> None:
    first = enqueue("tests.rate_limited", {"key": "provider", "limited": 1, "retry_after": "4"})
    with helpers.start_manage(["runworker", "--concurrency", "4"], worker_env) as one, \
            helpers.start_manage(["runworker", "--concurrency", "4"], worker_env) as two:
        closed = helpers.wait_until(
            lambda: AgentLimit.objects.filter(key="provider", closed_until__isnull=False).first(),
            message="the key to close")
        until = closed.closed_until
        assert until is not None
        assert "HTTP 429" in closed.closed_reason
        same_key = enqueue_many([{"agent": "tests.keyed", "input": {"key": "provider",
                                                                    "seconds": 0}}
                                 for _ in range(10)])
        other_key = enqueue_many([{"agent": "tests.keyed", "input": {"key": "other",
                                                                     "seconds": 0}}
                                  for _ in range(10)])
        helpers.wait_until(lambda: AgentRun.objects.filter(
            pk__in=[r.pk for r in other_key], status=Status.SUCCEEDED).count() == 10,
            message="the other key's runs to finish while this one is closed")
        assert transitions.now() < until, "the test was too slow to prove anything"
        assert not AgentRun.objects.filter(pk__in=[r.pk for r in same_key]).exclude(
            status=Status.QUEUED).exists()
        ids = [first.pk, *(r.pk for r in same_key)]
        helpers.wait_until(lambda: AgentRun.objects.filter(
            pk__in=ids, status=Status.SUCCEEDED).count() == 11, timeout=30,
            message="the closed key's runs to run once it reopens")
        assert one.returncode is None
        assert two.returncode is None
    first_start = RunEvent.objects.filter(run_id__in=ids, type="run.started").exclude(
        run_id=first.pk, attempt=1).order_by("created_at").first()
    assert first_start is not None
    assert first_start.created_at >= until
    row = AgentRun.objects.get(pk=first.pk)
    assert (row.requeue_count, row.snooze_count) == (0, 1)


@pytest.mark.slow
def test_the_limits_setting_bounds_a_key(worker_env: dict[str, str]) -> None:
    env = {**worker_env, "AGENTRUNS_TEST_SETTINGS": json.dumps({"LIMITS": {"openai": 2}})}
    runs = enqueue_many([{"agent": "tests.keyed", "input": {"key": "openai", "seconds": 0.2}}
                         for _ in range(10)])
    samples = []
    with helpers.start_manage(["runworker", "--concurrency", "8"], env), \
            helpers.start_manage(["runworker", "--concurrency", "8"], env):
        deadline = time.monotonic() + 60
        while AgentRun.objects.filter(pk__in=[r.pk for r in runs],
                                      status=Status.SUCCEEDED).count() < 10:
            samples.append(running("openai"))
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert max(samples) == 2, samples
    assert AgentLimit.objects.get(key="openai").max_running is None  # from the setting


# --------------------------------------------------------------------------- in process


@pytest.mark.django_db(transaction=True)
def test_the_key_is_resolved_at_enqueue() -> None:
    assert enqueue("tests.keyed", {"key": "tenant:7"}).limit_key == "tenant:7"
    assert enqueue("tests.keyed", {}).limit_key == ""  # the callable said None: no key
    assert enqueue("tests.keyed_openai").limit_key == "openai"
    assert enqueue("tests.keyed_openai", limit_key="azure").limit_key == "azure"
    assert enqueue("tests.noop", limit_key="x").limit_key == "x"
    assert enqueue_many([{"agent": "tests.noop", "limit_key": "y"}])[0].limit_key == "y"
    assert AgentRun.objects.get(limit_key="tenant:7").limit_key == "tenant:7"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("key", ["", "x" * 201, "a\x00b", 5, ["k", "k"], [], [5]])
def test_a_bad_key_is_a_clear_error_that_writes_nothing(key: Any) -> None:
    with pytest.raises(InvalidInputError, match="limit_key"):
        enqueue("tests.noop", limit_key=key)
    with pytest.raises(InvalidInputError, match=r"limit_key|cannot be stored"):
        enqueue("tests.keyed", {"key": key})  # returned by the agent's callable
    with pytest.raises(InvalidInputError, match="key"):
        set_limit(key, 3)
    assert not AgentRun.objects.exists()
    assert not AgentLimit.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("limit", [-1, 1.5, "3", True, 2**31])
def test_a_bad_limit_is_a_clear_error_that_writes_nothing(limit: Any) -> None:
    with pytest.raises(InvalidInputError, match="max_running"):
        set_limit("k", limit)
    assert not AgentLimit.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_key_callable_that_raises_is_a_clear_error() -> None:
    with pytest.raises(InvalidInputError, match="limit_key"):
        enqueue("tests.keyed_broken")
    assert not AgentRun.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_limit_of_zero_pauses_a_key_and_none_lifts_it() -> None:
    set_limit("paused", 0)
    held = enqueue("tests.keyed", {"key": "paused", "seconds": 0})
    other = enqueue("tests.keyed", {"key": "unlimited", "seconds": 0})
    burst()
    assert AgentRun.objects.get(pk=held.pk).status == Status.QUEUED
    assert AgentRun.objects.get(pk=other.pk).status == Status.SUCCEEDED
    set_limit("paused", None)  # back to the setting: none, so unlimited
    burst()
    assert AgentRun.objects.get(pk=held.pk).status == Status.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_one_claim_takes_no_more_than_the_room_left() -> None:
    set_limit("k", 3)
    enqueue_many([{"agent": "tests.keyed", "input": {"key": "k"}} for _ in range(10)])
    scopes = transitions.ScopePolicy()
    first = transitions.claim_limited("w1", ["default"], 10, scopes, {}, 60.0)
    assert len(first) == 3
    assert transitions.claim_limited("w2", ["default"], 10, scopes, {}, 60.0) == []
    # The ordinary claim leaves a limited key's runs alone.
    assert transitions.claim("w2", ["default"], 10, scopes, {}, 60.0) == []
    set_limit("k", 5)
    assert len(transitions.claim_limited("w2", ["default"], 10, scopes, {}, 60.0)) == 2
    assert running("k") == 5


@pytest.mark.django_db(transaction=True)
def test_a_closed_key_is_skipped_by_every_claim_until_it_reopens() -> None:
    enqueue_many([{"agent": "tests.keyed", "input": {"key": "k"}} for _ in range(2)])
    at = transitions.now()
    transitions.close_key("k", at + timedelta(seconds=30), "HTTP 429", at)
    transitions.close_key("k", at + timedelta(seconds=10), "earlier", at)  # later one wins
    assert AgentLimit.objects.get(key="k").closed_until == at + timedelta(seconds=30)
    scopes = transitions.ScopePolicy()
    assert transitions.claim_limited("w", ["default"], 5, scopes, {}, 60.0, at) == []
    assert transitions.claim("w", ["default"], 5, scopes, {}, 60.0, at) == []
    later = at + timedelta(seconds=31)
    assert len(transitions.claim_limited("w", ["default"], 5, scopes, {}, 60.0, later)) == 2


@pytest.mark.django_db(transaction=True)
def test_runs_of_a_key_keep_their_priority_order() -> None:
    set_limit("k", 1)
    low = enqueue("tests.keyed", {"key": "k"}, priority=-5)
    high = enqueue("tests.keyed", {"key": "k"}, priority=5)
    (claimed,) = transitions.claim_limited("w", ["default"], 5, transitions.ScopePolicy(), {},
                                           60.0)
    assert claimed.pk == high.pk
    assert AgentRun.objects.get(pk=low.pk).status == Status.QUEUED
    assert RunEvent.objects.filter(run_id=high.pk, type="run.started").count() == 1
    assert RunEvent.objects.aggregate(n=Max("seq"))["n"] == 1
