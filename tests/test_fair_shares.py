"""Fair shares: within a queue, claims take runs round-robin across fairness groups with
a due run (weighted by FAIR_WEIGHTS), priority first, then fairness, then age; runs
without a fair key are claimed as before."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_agentruns import (
    InvalidInputError,
    checks,
    enqueue,
    enqueue_many,
    set_limit,
    transitions,
)
from django_agentruns.models import AgentRun, FairGroup, Status
from django_agentruns.rules.fairness import fair_weights
from django_agentruns.transitions.fair import FairClaim
from tests import helpers

pytestmark = pytest.mark.django_db(transaction=True)
SCOPES = transitions.ScopePolicy()


def claim(n: int, fair: bool = True, **kwargs: Any) -> list[AgentRun]:
    return transitions.claim("w", ["default"], n, SCOPES, {}, 60.0, include_lapsed=False,
                             fair=fair, **kwargs)


def flood(tenant: str, n: int, **request: Any) -> list[AgentRun]:
    return enqueue_many([{"agent": "tests.tenant", "input": {"tenant": tenant}, **request}
                         for _ in range(n)])


def drain(batches: int, size: int = 8, fair: bool = True) -> list[str]:
    """The groups of the runs started, in claim order."""
    started: list[str] = []
    for _ in range(batches):
        started += [r.fair_key for r in claim(size, fair)]
    return started


def test_a_group_that_enqueues_late_starts_among_the_first_claims_behind_a_flood() -> None:
    flood("A", 300)
    assert drain(2) == ["A"] * 16  # A alone: oldest first
    flood("B", 10)
    after = drain(3)
    assert after.count("B") == 10, after  # all of B's 10 among the next 24 starts
    assert after[:8].count("B") >= 4  # B first (one claim ahead at most), then in turns


def test_without_fairness_the_late_group_waits_behind_the_flood() -> None:
    """The same enqueues, claimed as without fairness: the test above can fail."""
    flood("A", 100)
    flood("B", 10)
    assert drain(3, fair=False).count("B") == 0


def test_weights_split_the_starts_of_two_flooding_groups() -> None:
    with override_settings(AGENTRUNS={"FAIR_WEIGHTS": {"A": 3}}):
        assert fair_weights() == (("A", 3.0),)
        flood("A", 500)  # weights apply at enqueue: A's stamps a third apart
        flood("B", 500)
    starts = Counter(drain(50))  # 400 starts
    assert abs(starts["A"] - 300) <= 4, starts
    assert sum(starts.values()) == 400


def test_priority_beats_fairness_then_fairness_beats_age() -> None:
    flood("A", 20)
    flood("B", 20)
    urgent = flood("A", 2, priority=5)
    first = claim(4)
    assert [r.pk for r in first[:2]] == [r.pk for r in urgent]
    assert [r.fair_key for r in first[2:]] == ["A", "B"] or \
        [r.fair_key for r in first[2:]] == ["B", "A"]


def test_runs_without_a_fair_key_are_claimed_oldest_first_as_before() -> None:
    runs = enqueue_many([{"agent": "tests.noop", "input": {"i": i}} for i in range(12)])
    assert not FairGroup.objects.exists()  # no group row: workers claim as before
    assert FairClaim(refresh=0).on() is False
    flood("A", 1)  # a group exists: the claim turns fair, keyless runs are one group
    assert FairClaim(refresh=0).on() is True
    order = [r.pk for r in claim(20)]
    keyless = [pk for pk in order if pk in {r.pk for r in runs}]
    assert keyless == [r.pk for r in runs]  # still oldest first among themselves


def test_an_idle_group_comes_back_level_not_owed_a_backlog() -> None:
    flood("B", 1)
    flood("A", 200)
    drain(10)  # B's one run, then A alone for a while: B's time stays behind
    flood("B", 100)
    after = drain(5)
    # Shares (half, and one claim ahead at most), does not take all 40 starts.
    assert 20 <= after.count("B") <= 28, after


def test_a_new_group_starts_at_its_queues_frontier_and_its_runs_follow_by_weight() -> None:
    flood("A", 100)
    drain(5)
    head = AgentRun.objects.filter(status=Status.QUEUED).order_by("fair_vstart").first()
    assert head is not None
    assert head.fair_vstart == 40
    with override_settings(AGENTRUNS={"FAIR_WEIGHTS": {"C": 4}}):
        c = flood("C", 3)
    assert [AgentRun.objects.get(pk=r.pk).fair_vstart for r in c] == [40, 40.25, 40.5]
    c2 = flood("C", 1)  # weight 1 now: one after the group's last queued stamp
    assert AgentRun.objects.get(pk=c2[0].pk).fair_vstart == 41.5


def test_fair_key_from_the_agent_or_the_enqueue_and_refused_when_bad() -> None:
    assert enqueue("tests.tenant", {"tenant": "t1"}).fair_key == "t1"
    assert enqueue("tests.tenant", {"tenant": "t1"}, fair_key="t2").fair_key == "t2"
    assert enqueue("tests.tenant", {}).fair_key == ""  # the callable said None
    assert enqueue("tests.noop", fair_key="t3").fair_key == "t3"
    assert AgentRun.objects.filter(fair_key="t3").count() == 1
    for bad in ("", 5, "x" * 201):
        with pytest.raises(InvalidInputError, match="fair_key"):
            enqueue("tests.noop", fair_key=bad)
    with pytest.raises(InvalidInputError, match="fair_key"):
        enqueue("tests.tenant", {"tenant": 7})


def test_fair_weights_are_checked() -> None:
    for bad in ({"A": 0}, {"A": "3"}, {"A": float("inf")}, {5: 1}, ["A"]):
        with override_settings(AGENTRUNS={"FAIR_WEIGHTS": bad}):
            assert "agentruns.E017" in [m.id for m in checks.check_settings()], bad
    with override_settings(AGENTRUNS={"FAIR_WEIGHTS": {"A": 2.5, "": 1}}):
        assert "agentruns.E017" not in [m.id for m in checks.check_settings()]


def test_a_fair_claim_is_the_ordinary_claim_in_another_order() -> None:
    """No statement added, and nothing written but the runs it starts."""
    flood("A", 50)
    flood("B", 5)
    claim(4, fair=False)
    claim(4)  # both statements compiled and cached
    groups = list(FairGroup.objects.order_by("id").values_list("key", "vtime"))
    with CaptureQueriesContext(connection) as plain:
        claim(4, fair=False)
    with CaptureQueriesContext(connection) as fair:
        claim(4)
    assert len(fair) == len(plain)
    assert "fairgroup" not in " ".join(q["sql"] for q in fair.captured_queries).lower()
    assert list(FairGroup.objects.order_by("id").values_list("key", "vtime")) == groups


@pytest.mark.slow
def test_a_worker_starts_a_late_tenants_runs_early_behind_a_flood(
    worker_env: dict[str, str],
) -> None:
    flood("A", 400)
    helpers.store_payloads(list(AgentRun.objects.values_list("pk", flat=True)), "input",
                           {"tenant": "A", "seconds": 0.02})
    with helpers.start_manage(["runworker", "--concurrency", "8"], worker_env):
        helpers.wait_until(lambda: AgentRun.objects.filter(status=Status.SUCCEEDED).count()
                           >= 40, timeout=30, message="the worker to be busy with A")
        before = timezone.now()
        flood("B", 10)
        after = timezone.now()  # committed (autocommit) by then
        helpers.wait_until(lambda: not AgentRun.objects.filter(
            fair_key="B").exclude(status=Status.SUCCEEDED).exists(), timeout=30,
            message="B's runs to finish")
    starts = list(AgentRun.objects.filter(started_at__gt=before)
                  .order_by("started_at", "id").values_list("fair_key", "started_at"))
    # A's runs the worker started while the enqueue was in flight came before B's existed
    # (or with its commit): the claims that could choose between A and B come after them.
    in_flight = sum(1 for key, at in starts if key == "A" and at <= after)
    # One claim starts its batch at one instant, so the order within it is not the claim's:
    # count A's runs that started strictly before B's last one. B's ten stamps begin level
    # with A's next queued run, and a tie goes to the older run: equal weights let ten of
    # A's queued runs go first, no more (in age order, all 390 or so would).
    last_b = max(at for key, at in starts if key == "B")
    a_first = sum(1 for key, at in starts if key == "A" and at < last_b) - in_flight
    assert a_first <= 10, (a_first, in_flight, [key for key, _ in starts[:40]])


def test_runs_of_a_limited_key_are_taken_fairly_too() -> None:
    set_limit("prov", 100)
    flood("A", 40, limit_key="prov")
    flood("B", 4, limit_key="prov")
    first = transitions.claim_limited("w", ["default"], 8, SCOPES, {}, 60.0, fair=True)
    assert Counter(r.fair_key for r in first) == {"A": 4, "B": 4}
    again = transitions.claim_limited("w", ["default"], 8, SCOPES, {}, 60.0, fair=False)
    assert Counter(r.fair_key for r in again) == {"A": 8}  # without: oldest first


def test_enqueue_many_debounces_and_supersedes_as_enqueue_does() -> None:
    first, plain = enqueue_many([
        {"agent": "tests.keyed", "input": {"m": 1}, "dedupe_key": "chat", "debounce": 30},
        {"agent": "tests.noop"}])
    second, third = enqueue_many([
        {"agent": "tests.keyed", "input": {"m": 2}, "dedupe_key": "chat", "debounce": 30},
        {"agent": "tests.keyed", "input": {"m": 3}, "dedupe_key": "chat", "debounce": 30}])
    assert second.pk == third.pk == first.pk
    assert third.debounced
    assert AgentRun.objects.get(pk=first.pk).input == {"m": 3}  # the last request wins
    (new,) = enqueue_many([{"agent": "tests.keyed", "input": {"m": 4}, "dedupe_key": "chat",
                            "supersede": True}])
    assert new.pk != first.pk
    assert AgentRun.objects.get(pk=first.pk).status == Status.CANCELLED
    with pytest.raises(InvalidInputError, match="dedupe_key"):
        enqueue_many([{"agent": "tests.noop"}, {"agent": "tests.noop", "debounce": 5}])
    assert AgentRun.objects.count() == 3  # the refused call wrote nothing
    assert plain.pk != first.pk
