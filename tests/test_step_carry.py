"""A fresh run's async step end rides on the attempt's next write: held (not awaited) when
the step returns, then carried by the next write (`CarriedEnd`, one queued write for
both), or written by the lease keeper, a storage call or the attempt's end. Its event
comes before the carrier's; it is fenced as alone; and the ends of many runs commit in a
few statements, whatever their number."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from django_agentruns import RunContext, agent, enqueue, transitions
from django_agentruns.exceptions import LimitExceeded
from django_agentruns.models import RunEvent, RunStep, Status
from django_agentruns.outcomes import AttemptRef, Renewal
from django_agentruns.registry import scope_policy, unregister
from django_agentruns.transitions import STEP, CarriedEnd, EmitWrite, StepEndWrite, batched
from tests import helpers, test_step_writes
from tests.test_step_writes import kinds
from tests.test_steps import burst, kill_and_finish, steps_of
from tests.testapp.step_agents import executions

written = test_step_writes.written  # the fixture: every write the store applies


async def _reply(i: int) -> dict[str, int]:
    return {"i": i}


async def _reply_seeing(i: int, run_id: int, name: str) -> dict[str, Any]:
    """Whether step `name`'s end is recorded as this step executes."""
    def recorded() -> bool:
        try:
            return RunStep.objects.filter(run_id=run_id, name=name, status="done").exists()
        finally:
            connection.close()
    return {"i": i, "seen": await asyncio.to_thread(recorded)}


@pytest.fixture
def carrying() -> Iterator[None]:
    @agent("tests.step_carry")
    async def step_carry(ctx: RunContext) -> list[Any]:
        """A step and an event, twice; two steps back to back; a last step, then none."""
        out = []
        for i in range(2):
            out.append(await ctx.astep("call", _reply, i))
            await ctx.aemit("note", {"i": i})
        out.append(await ctx.astep("a", _reply, 2))
        out.append(await ctx.astep("b", _reply_seeing, 3, ctx.run_id, "a"))
        await ctx.aemit("note", {"i": 3})
        out.append(await ctx.astep("last", _reply, 4))
        return out

    @agent("tests.step_then_idle")
    async def step_then_idle(ctx: RunContext) -> bool:
        """A step, then no write: the lease keeper writes its end while the agent waits."""
        await ctx.astep("call", _reply, 0)
        for _ in range(200):
            if await asyncio.to_thread(_recorded, ctx.run_id):
                return True
            await asyncio.sleep(0.05)
        return False

    @agent("tests.step_then_capped")
    async def step_then_capped(ctx: RunContext) -> str:
        """A step, then an emit past the run's event cap: refused, with the end it carried."""
        await ctx.astep("call", _reply, 0)
        try:
            await ctx.aemit("note", {})
        except LimitExceeded:
            return "capped"
        return "emitted"

    @agent("tests.step_mutated")
    async def step_mutated(ctx: RunContext) -> dict[str, int]:
        """Changes what a step returned before the write that carries its end."""
        reply = await ctx.astep("call", _reply, 0)
        reply["i"] = 99
        await ctx.aemit("note", {})
        return reply

    yield
    unregister("tests.step_mutated")
    unregister("tests.step_carry")
    unregister("tests.step_then_idle")
    unregister("tests.step_then_capped")


def _recorded(run_id: int) -> bool:
    try:
        return RunStep.objects.filter(run_id=run_id, status="done").exists()
    finally:
        connection.close()


def test_a_fresh_async_steps_end_rides_on_the_next_write(
        transactional_db: None, written: list[Any], carrying: None) -> None:
    run = enqueue("tests.step_carry")
    burst()
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED, run.error_message
    # "b" executed only once "a"'s end was recorded: no step runs while an earlier one's
    # completion is still unrecorded.
    assert run.output == [{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3, "seen": True}, {"i": 4}]
    mine = [w for w in written if w.ref.run_id == run.pk]
    # Each end carried by the emit after it; "a"'s by a renewal awaited before "b" runs
    # (no write between them); the last one by a renewal at the attempt's end.
    assert [(type(w).__name__, type(getattr(w, "then", w)).__name__) for w in mine] == [
        ("CarriedEnd", "EmitWrite"), ("CarriedEnd", "EmitWrite"),
        ("CarriedEnd", "RenewWrite"), ("CarriedEnd", "EmitWrite"),
        ("CarriedEnd", "RenewWrite")]
    assert [w.end.name for w in mine if isinstance(w, CarriedEnd)] == [
        "call", "call", "a", "b", "last"]
    assert steps_of(run) == [("call", 1, "done", 1), ("call", 2, "done", 1),
                             ("a", 1, "done", 1), ("b", 1, "done", 1), ("last", 1, "done", 1)]
    timeline = list(RunEvent.objects.filter(run=run, type__in=[STEP, "note"]).order_by("seq")
                    .values_list("type", "payload__name"))
    assert timeline == [(STEP, "call"), ("note", None), (STEP, "call"), ("note", None),
                        (STEP, "a"), (STEP, "b"), ("note", None), (STEP, "last")]


def test_an_end_no_write_carries_is_written_by_the_lease_keeper(
        transactional_db: None, written: list[Any], carrying: None) -> None:
    run = enqueue("tests.step_then_idle")
    burst()
    run.refresh_from_db()
    assert (run.status, run.output) == (Status.SUCCEEDED, True), run.error_message
    assert kinds(written, run.pk) == {"StepEndWrite": 1}
    assert steps_of(run) == [("call", 1, "done", 1)]


def test_a_carrier_refused_puts_its_end_back(transactional_db: None, settings: Any,
                                             carrying: None) -> None:
    # run.started, then the step's event; the emit after it is one too many.
    settings.AGENTRUNS = {**getattr(settings, "AGENTRUNS", {}), "MAX_EVENTS_PER_RUN": 2}
    run = enqueue("tests.step_then_capped")
    burst()
    run.refresh_from_db()
    assert (run.status, run.output) == (Status.SUCCEEDED, "capped"), run.error_message
    assert steps_of(run) == [("call", 1, "done", 1)]
    assert list(RunEvent.objects.filter(run=run).exclude(type=transitions.SUCCEEDED)
                .order_by("seq").values_list("type", flat=True)) == [transitions.STARTED, STEP]


def test_a_held_end_stores_what_the_step_returned(transactional_db: None,
                                                  carrying: None) -> None:
    run = enqueue("tests.step_mutated")
    burst()
    run.refresh_from_db()
    assert (run.status, run.output) == (Status.SUCCEEDED, {"i": 99}), run.error_message
    assert RunStep.objects.get(run=run).result == {"i": 0}


def _claimed(n: int, worker: str = "w-a") -> list[AttemptRef]:
    for _ in range(n):
        enqueue("tests.noop")
    claimed = transitions.claim(worker, ["default"], n, scope_policy(), {}, 30.0)
    return [AttemptRef(r.pk, r.attempt, worker, 30.0) for r in claimed]


def _end(ref: AttemptRef, name: str = "s") -> StepEndWrite:
    return StepEndWrite(ref, name, 1, True, {"ok": ref.run_id}, max_events=100)


def _emit(ref: AttemptRef) -> EmitWrite:
    return EmitWrite(ref, transitions.emitted_event_id(ref.run_id, 0, 0), "note", {},
                     max_events=100)


def _statements(writes: list[Any]) -> tuple[int, list[Any]]:
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        results = batched.apply_writes(writes)
    return len([q for q in queries.captured_queries
                if not q["sql"].upper().startswith(("SAVEPOINT", "RELEASE", "BEGIN"))
                and q["sql"].upper() != "COMMIT"]), results


def test_many_runs_step_ends_commit_in_as_many_statements_as_one(transactional_db: None) -> None:
    refs = _claimed(21)
    one, _ = _statements([_end(refs[0])])
    many, results = _statements([_end(ref) for ref in refs[1:11]])
    assert results == [Renewal.OK] * 10
    assert many == one <= 3  # renewal, the upsert of the ends, their events
    one, _ = _statements([CarriedEnd(_end(refs[11], "c"), _emit(refs[11]))])
    many, results = _statements([CarriedEnd(_end(ref, "c"), _emit(ref)) for ref in refs[12:]])
    assert results == [Renewal.OK] * 9
    assert many == one <= 3  # the same: the carriers' events after the ends', one INSERT
    assert RunStep.objects.filter(status="done").count() == 21
    for ref in refs[11:]:
        assert list(RunEvent.objects.filter(run_id=ref.run_id, type__in=[STEP, "note"])
                    .order_by("seq").values_list("type", flat=True)) == [STEP, "note"]


def test_a_carried_end_is_fenced_as_alone(transactional_db: None) -> None:
    [ref] = _claimed(1)
    stale = AttemptRef(ref.run_id, ref.attempt, "w-other", 30.0)
    _, results = _statements([CarriedEnd(_end(stale), _emit(stale))])
    assert results == [Renewal.LOST]
    assert not RunStep.objects.exists()
    assert not RunEvent.objects.filter(type__in=[STEP, "note"]).exists()
    # Carried by a checkpoint (its own fenced UPDATE), the end renews alone: recorded.
    _, results = _statements([CarriedEnd(_end(ref), transitions.CheckpointWrite(
        ref, {"n": 1}, 1, max_events=100))])
    assert results == [Renewal.OK]
    assert steps_of_run(ref.run_id) == [("s", 1, "done", 1)]


def steps_of_run(run_id: int) -> list[tuple[str, int, str, int]]:
    return list(RunStep.objects.filter(run_id=run_id).values_list(
        "name", "occurrence", "status", "attempt"))


@pytest.mark.slow
def test_a_sigkill_while_an_async_steps_end_is_held_repeats_it_with_the_same_key(
        worker_env: dict[str, str]) -> None:
    run = enqueue("tests.async_step_chain", {"n": 3, "pause_after": 1})
    env = {**worker_env, "AGENTRUNS_TEST_END_HELD": "3600"}
    worker = helpers.start_manage(["runworker"], env)
    # Step 1's end is written alone as step 2 ends (no write between them); step 2's is
    # held while the agent pauses, so the kill leaves no record of it.
    helpers.wait_until(lambda: len(executions(run.pk)) == 2 and RunStep.objects.filter(
        run=run, status="done").exists(), message="step 2 executed, step 1 recorded")
    assert steps_of(run) == [("call", 1, "done", 1)]
    run = kill_and_finish(worker, run, worker_env)
    key = f"run-{run.pk}/call/"
    assert executions(run.pk) == [key + "1", key + "2", key + "2", key + "3"]
    assert steps_of(run) == [("call", 1, "done", 1), ("call", 2, "done", 2),
                             ("call", 3, "done", 2)]
