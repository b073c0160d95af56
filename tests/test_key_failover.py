"""Failover across limit keys: a run with a list of keys takes the first open one, the
attempt reads which as `ctx.limit_key`, and a 429 moves its retry to the next key at once."""

from __future__ import annotations

from datetime import timedelta

import pytest

from django_agentruns import InvalidInputError, enqueue, set_limit, transitions
from django_agentruns.models import AgentLimit, AgentRun, Status
from django_agentruns.runtime.worker import Worker
from tests import helpers

pytestmark = pytest.mark.django_db(transaction=True)
SCOPES = transitions.ScopePolicy()


def burst() -> None:
    Worker(burst=True, reap_interval=0, max_contention_wait=10).run(install_signals=False)


def test_a_run_takes_the_first_open_key_and_its_attempt_reads_which() -> None:
    first = enqueue("tests.failover", {})
    assert (first.limit_key, AgentRun.objects.get(pk=first.pk).limit_keys) == \
        ("prov:a", ["prov:a", "prov:b"])
    transitions.close_key("prov:a", transitions.now() + timedelta(seconds=120), "HTTP 429")
    second = enqueue("tests.failover", {})
    assert second.limit_key == "prov:b"
    burst()
    assert AgentRun.objects.get(pk=second.pk).output == {"key": "prov:b", "attempt": 1}
    assert AgentRun.objects.get(pk=first.pk).status == Status.QUEUED  # prov:a is closed


def test_enqueue_takes_a_list_of_keys_and_refuses_a_bad_one() -> None:
    run = enqueue("tests.noop", limit_key=["x", "y"])
    assert (run.limit_key, AgentRun.objects.get(pk=run.pk).limit_keys) == ("x", ["x", "y"])
    assert AgentRun.objects.get(pk=enqueue("tests.noop", limit_key=["z"]).pk).limit_keys is None
    for bad in ([], ["x", "x"], ["x", ""]):
        with pytest.raises(InvalidInputError, match="limit_key"):
            enqueue("tests.noop", limit_key=bad)


def test_a_429_moves_the_retry_to_the_next_key_at_once() -> None:
    run = enqueue("tests.failover", {"fail_on": "prov:a"})
    burst()
    row = AgentRun.objects.get(pk=run.pk)
    # max_requeues=0: a snooze, not a retry, and no 120 s wait for prov:a to reopen.
    assert (row.status, row.limit_key, row.output) == (
        Status.SUCCEEDED, "prov:b", {"key": "prov:b", "attempt": 2})
    assert AgentLimit.objects.get(key="prov:a").closed_until is not None


@pytest.mark.slow
def test_failover_takes_the_second_key_when_the_first_is_closed(
    worker_env: dict[str, str],
) -> None:
    run = enqueue("tests.failover", {"fail_on": "prov:a"})
    with helpers.start_manage(["runworker", "--concurrency", "2"], worker_env):
        helpers.wait_until(lambda: AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED,
                           timeout=30, message="the run to succeed on the second key")
        later = enqueue("tests.failover", {})
        helpers.wait_until(lambda: AgentRun.objects.get(pk=later.pk).status ==
                           Status.SUCCEEDED, timeout=30, message="a new run on the open key")
    assert AgentRun.objects.get(pk=run.pk).output == {"key": "prov:b", "attempt": 2}
    assert AgentRun.objects.get(pk=later.pk).output == {"key": "prov:b", "attempt": 1}


def test_a_run_whose_key_has_no_window_room_moves_to_the_next_key_with_room() -> None:
    set_limit("prov:a", per_minute=1)
    set_limit("prov:b", per_minute=5)
    first, second = (enqueue("tests.failover", {}) for _ in range(2))
    assert second.limit_key == "prov:a"  # open at enqueue: the first of its list
    claim = transitions.claim_limited
    (started,) = claim("w", ["default"], 5, SCOPES, {}, 60.0)
    assert started.pk == first.pk  # prov:a's window is now full
    assert AgentRun.objects.get(pk=second.pk).limit_key == "prov:b"  # moved by that claim
    (moved,) = claim("w", ["default"], 5, SCOPES, {}, 60.0)
    assert (moved.pk, moved.limit_key) == (second.pk, "prov:b")


def test_failover_skips_a_key_without_room_and_keeps_a_run_without_a_list() -> None:
    set_limit("prov:a", per_minute=1)
    set_limit("prov:b", per_minute=1)
    runs = [enqueue("tests.failover", {}) for _ in range(3)]
    alone = enqueue("tests.noop", limit_key="prov:a")  # no list: stays on its key
    burst()
    rows = {r.pk: r for r in AgentRun.objects.all()}
    assert [rows[r.pk].status for r in runs] == [Status.SUCCEEDED, Status.SUCCEEDED,
                                                 Status.QUEUED]
    assert [rows[r.pk].output["key"] for r in runs[:2]] == ["prov:a", "prov:b"]
    assert (rows[alone.pk].status, rows[alone.pk].limit_key) == (Status.QUEUED, "prov:a")
