"""Dedupe keys: one unfinished run per agent and key, race-free across processes.

`enqueue(..., dedupe_key=k)` inserts with ON CONFLICT DO NOTHING against the partial unique
index `agentruns_dedupe` (queued or running runs with a key), then reads the run holding
the key: the caller gets it back with `deduplicated` True. A finished run frees its key.
"""

from __future__ import annotations

import json
import time

import pytest
from django.db import transaction

from django_agentruns import enqueue, enqueue_many, retry, transitions
from django_agentruns.api import RunRequest
from django_agentruns.exceptions import InvalidInputError, UnknownAgentError
from django_agentruns.models import AgentRun, Status
from django_agentruns.registry import scope_policy
from tests import helpers


def claim_all(worker: str = "w-test") -> list[AgentRun]:
    return transitions.claim(worker, ["default"], 100, scope_policy(), {}, 2.0)


def test_a_second_enqueue_with_the_key_returns_the_unfinished_run(db: None) -> None:
    first = enqueue("tests.noop", {"n": 1}, dedupe_key="order-42")
    again = enqueue("tests.noop", {"n": 2}, dedupe_key="order-42")

    assert first.deduplicated is False
    assert again.deduplicated is True
    assert again.pk == first.pk
    assert again.input == {"n": 1}  # the existing run, as stored
    assert AgentRun.objects.count() == 1


def test_a_running_run_holds_its_key_and_a_finished_one_frees_it(db: None) -> None:
    first = enqueue("tests.noop", dedupe_key="k")
    [run] = claim_all()
    assert enqueue("tests.noop", dedupe_key="k").pk == first.pk  # running: still held

    ref = transitions.AttemptRef(run.pk, run.attempt, "w-test", 2.0)
    assert transitions.settle_succeeded(ref, {"ok": 1}) is transitions.Settlement.SUCCEEDED
    fresh = enqueue("tests.noop", dedupe_key="k")
    assert fresh.pk != first.pk
    assert fresh.deduplicated is False


def test_keys_are_per_agent_and_keyless_runs_are_never_deduplicated(db: None) -> None:
    a = enqueue("tests.noop", dedupe_key="same")
    b = enqueue("tests.once", dedupe_key="same")
    c, d = enqueue("tests.noop"), enqueue("tests.noop")
    assert len({a.pk, b.pk, c.pk, d.pk}) == 4


def test_enqueue_many_dedupes_against_stored_runs_and_within_the_call(db: None) -> None:
    stored = enqueue("tests.noop", {"n": 0}, dedupe_key="a")
    runs = enqueue_many([
        RunRequest("tests.noop", {"n": 1}),
        RunRequest("tests.noop", {"n": 2}, dedupe_key="a"),
        RunRequest("tests.noop", {"n": 3}, dedupe_key="b"),
        {"agent": "tests.noop", "input": {"n": 4}, "dedupe_key": "b"},
        RunRequest("tests.noop", {"n": 5}),
    ])
    assert [r.deduplicated for r in runs] == [False, True, False, True, False]
    assert runs[1].pk == stored.pk
    assert runs[3].pk == runs[2].pk
    assert [r.input for r in runs] == [{"n": 1}, {"n": 0}, {"n": 3}, {"n": 3}, {"n": 5}]
    assert AgentRun.objects.count() == 4
    assert AgentRun.objects.get(pk=runs[2].pk).dedupe_key == "b"


def test_a_rolled_back_enqueue_frees_the_key(db: None) -> None:
    def enqueue_then_fail() -> None:
        with transaction.atomic():
            enqueue("tests.noop", dedupe_key="k")
            raise RuntimeError

    with pytest.raises(RuntimeError):
        enqueue_then_fail()
    assert enqueue("tests.noop", dedupe_key="k").deduplicated is False


@pytest.mark.parametrize("key", ["", 42, "x" * 256, "nul\x00"])
def test_a_bad_key_is_refused_and_nothing_is_written(db: None, key: object) -> None:
    with pytest.raises(InvalidInputError, match="dedupe_key"):
        enqueue("tests.noop", dedupe_key=key)  # type: ignore[arg-type]
    assert not AgentRun.objects.exists()


def test_an_unknown_agent_with_a_key_is_refused(db: None) -> None:
    with pytest.raises(UnknownAgentError):
        enqueue("tests.nope", dedupe_key="k")
    assert not AgentRun.objects.exists()


def test_retrying_a_run_whose_key_was_taken_meanwhile_is_a_clear_error(db: None) -> None:
    first = enqueue("tests.noop", dedupe_key="k")
    transitions.cancel(first.pk, "stop")
    second = enqueue("tests.noop", dedupe_key="k")

    with pytest.raises(InvalidInputError, match=f"held by unfinished run {second.pk}"):
        retry(first.pk)
    first.refresh_from_db()
    assert first.status == Status.CANCELLED
    transitions.cancel(second.pk, "stop")
    assert retry(first.pk) is True


ENQUEUE_CONCURRENTLY = """
import threading, time
from django.db import OperationalError, connection
from django_agentruns import enqueue
start = {start}
results = []
def one():
    time.sleep(max(0.0, start - time.time()))  # all threads of all processes at once
    for _ in range(50):  # the shared test server may be short of connections a moment
        try:
            run = enqueue("tests.noop", {{"n": 1}}, dedupe_key="order-42")
            results.append((run.pk, run.deduplicated))
            break
        except OperationalError as exc:
            if "too many clients" not in str(exc):
                raise
            connection.close()
            time.sleep(0.1)
        finally:
            connection.close()
threads = [threading.Thread(target=one) for _ in range({threads})]
for t in threads: t.start()
for t in threads: t.join()
print("RESULTS", __import__("json").dumps(results))
"""


@pytest.mark.slow
def test_fifty_concurrent_enqueues_from_five_processes_make_one_run(
    worker_env: dict[str, str],
) -> None:
    code = ENQUEUE_CONCURRENTLY.format(start=time.time() + 4.0, threads=10)
    procs = [helpers.start_manage(["shell", "-c", code], worker_env) for _ in range(5)]
    results = []
    for proc in procs:
        assert proc.wait(60) == 0, proc.output()
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
        results += json.loads(line.removeprefix("RESULTS "))
        proc.close()

    assert len(results) == 50
    assert AgentRun.objects.count() == 1
    run = AgentRun.objects.get()
    assert {pk for pk, _ in results} == {run.pk}
    assert sorted(dedup for _, dedup in results) == [False] + [True] * 49
