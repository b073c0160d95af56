"""Debounce and supersede on dedupe keys: a queued holder takes the newest input and a later
start (and gives up its key as it starts); supersede cancels an unfinished holder and
queues the new run in its place, in one transaction."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from django_agentruns import InvalidInputError, enqueue, set_limit, transitions
from django_agentruns.models import AgentRun, Reason, Status
from tests import helpers

pytestmark = pytest.mark.django_db(transaction=True)
SCOPES = transitions.ScopePolicy()


def claim_all(at: Any = None, **kwargs: Any) -> list[AgentRun]:
    return transitions.claim("w", ["default"], 10, SCOPES, {}, 60.0, at, **kwargs)


def test_a_debounced_enqueue_replaces_the_queued_holders_input_and_moves_its_start() -> None:
    first = enqueue("tests.keyed", {"m": 1}, dedupe_key="chat:1", debounce=30)
    assert not first.debounced
    assert first.available_at >= first.created_at + timedelta(seconds=30)
    second = enqueue("tests.keyed", {"m": 2}, dedupe_key="chat:1", debounce=45)
    assert second.pk == first.pk
    assert second.debounced
    row = AgentRun.objects.get(pk=first.pk)
    assert row.input == {"m": 2}  # the newest message wins
    assert row.available_at >= first.available_at + timedelta(seconds=14)
    assert AgentRun.objects.count() == 1
    other = enqueue("tests.keyed", {"m": 3}, dedupe_key="chat:2", debounce=30)
    assert other.pk != first.pk  # another key: another run


@pytest.mark.parametrize("include_lapsed", [True, False])
def test_a_debounced_run_gives_up_its_key_in_the_claim_that_starts_it(
    include_lapsed: bool,
) -> None:
    run = enqueue("tests.keyed", {"m": 1}, dedupe_key="chat", debounce=0)
    (started,) = claim_all(transitions.now() + timedelta(seconds=1),
                           include_lapsed=include_lapsed)
    assert started.pk == run.pk
    assert started.dedupe_key == ""
    assert AgentRun.objects.get(pk=run.pk).dedupe_key == ""
    after = enqueue("tests.keyed", {"m": 2}, dedupe_key="chat", debounce=0)
    assert after.pk != run.pk
    assert not after.debounced
    assert not after.deduplicated


def test_a_debounced_run_of_a_limited_key_gives_up_its_key_as_it_starts() -> None:
    set_limit("k", 5)
    run = enqueue("tests.keyed", {"key": "k"}, dedupe_key="chat", debounce=0)
    (started,) = transitions.claim_limited("w", ["default"], 5, SCOPES, {}, 60.0,
                                           transitions.now() + timedelta(seconds=1))
    assert started.pk == run.pk
    assert AgentRun.objects.get(pk=run.pk).dedupe_key == ""


def test_a_running_holder_that_was_not_debounced_keeps_its_key() -> None:
    plain = enqueue("tests.keyed", {}, dedupe_key="chat")
    claim_all()
    again = enqueue("tests.keyed", {"m": 2}, dedupe_key="chat", debounce=5)
    assert again.pk == plain.pk
    assert again.deduplicated
    assert not again.debounced
    assert AgentRun.objects.get(pk=plain.pk).input == {}


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"debounce": 5}, "dedupe_key"), ({"supersede": True}, "dedupe_key"),
    ({"dedupe_key": "k", "debounce": -1}, "debounce"),
    ({"dedupe_key": "k", "debounce": float("inf")}, "debounce"),
    ({"dedupe_key": "k", "debounce": 5, "supersede": True}, "not both"),
    ({"dedupe_key": "k", "debounce": 5, "run_after": 3}, "run_after"),
    ({"dedupe_key": "k", "supersede": "yes"}, "supersede"),
])
def test_bad_debounce_or_supersede_is_a_clear_error_that_writes_nothing(
    kwargs: dict[str, Any], match: str,
) -> None:
    with pytest.raises(InvalidInputError, match=match):
        enqueue("tests.keyed", {}, **kwargs)
    assert not AgentRun.objects.exists()


def test_supersede_cancels_a_queued_holder_and_takes_its_key() -> None:
    old = enqueue("tests.keyed", {"m": 1}, dedupe_key="doc:9")
    new = enqueue("tests.keyed", {"m": 2}, dedupe_key="doc:9", supersede=True)
    assert new.pk != old.pk
    assert not new.deduplicated
    row = AgentRun.objects.get(pk=old.pk)
    assert (row.status, row.reason, row.dedupe_key) == (Status.CANCELLED, Reason.CANCELLED, "")
    assert row.cancel_reason == f"superseded by run {new.pk}"
    assert AgentRun.objects.get(pk=new.pk).dedupe_key == "doc:9"
    # With no holder, supersede is a plain enqueue.
    lone = enqueue("tests.keyed", {}, dedupe_key="doc:10", supersede=True)
    assert AgentRun.objects.get(pk=lone.pk).status == Status.QUEUED


# --------------------------------------------------------------------------- processes


ENQUEUER = """
from django_agentruns import enqueue
for i in range({count}):
    enqueue("tests.keyed", {{"p": {p}, "i": i}}, dedupe_key="chat", debounce=600)
"""


@pytest.mark.slow
def test_debounce_under_concurrent_enqueues_ends_with_one_run_holding_the_last_input(
    worker_env: dict[str, str],
) -> None:
    count = 40
    procs = [helpers.start_manage(["shell", "-c", ENQUEUER.format(count=count, p=p)],
                                  worker_env) for p in (1, 2)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.output()
    (run,) = AgentRun.objects.all()
    assert run.status == Status.QUEUED
    assert run.dedupe_key == "chat"
    # The last enqueue to commit wrote the input: the last one of one of the processes.
    assert run.input in ({"p": 1, "i": count - 1}, {"p": 2, "i": count - 1}), run.input


@pytest.mark.slow
def test_supersede_stops_a_running_holder_as_cancel_does(worker_env: dict[str, str]) -> None:
    old = enqueue("tests.keyed", {"seconds": 120}, dedupe_key="doc")
    with helpers.start_manage(["runworker", "--concurrency", "2"], worker_env):
        helpers.wait_until(lambda: AgentRun.objects.get(pk=old.pk).status == Status.RUNNING,
                           message="the old run to start")
        new = enqueue("tests.keyed", {"seconds": 0}, dedupe_key="doc", supersede=True)
        assert AgentRun.objects.get(pk=old.pk).dedupe_key == ""
        helpers.wait_until(lambda: AgentRun.objects.get(pk=old.pk).status == Status.CANCELLED,
                           timeout=30, message="the running holder to stop")
        helpers.wait_until(lambda: AgentRun.objects.get(pk=new.pk).status == Status.SUCCEEDED,
                           timeout=30, message="the new run to run")
    row = AgentRun.objects.get(pk=old.pk)
    assert row.cancel_reason == f"superseded by run {new.pk}"
