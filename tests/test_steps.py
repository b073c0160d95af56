"""Durable steps: a step that completed is never executed again by the same run.

`ctx.step(name, fn)` stores fn's JSON result once; every later attempt that reaches it
(after a crash, a retry, a wait) gets the stored result without calling fn. A step that
started but whose end was never recorded runs again, with the same `ctx.step_key`. Real
executions are counted in SideEffect rows the step functions write.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db.models import F

from django_agentruns import deliver, enqueue, transitions
from django_agentruns.exceptions import LimitExceeded
from django_agentruns.models import AgentRun, Reason, RunEvent, RunStep, Status
from django_agentruns.outcomes import AttemptRef, Renewal
from django_agentruns.registry import scope_policy
from django_agentruns.runtime import reaper
from django_agentruns.runtime.worker import Worker
from tests import helpers
from tests.testapp.step_agents import executions

# Each test runs on plain history tables and on partitioned ones (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("history_layout")


def burst() -> None:
    Worker(burst=True, reap_interval=0).run(install_signals=False)


def steps_of(run: AgentRun) -> list[tuple[str, int, str, int]]:
    return list(RunStep.objects.filter(run=run).order_by("id").values_list(
        "name", "occurrence", "status", "attempt"))


# --------------------------------------------------------------------------- in one process


def test_a_steps_result_is_stored_and_each_call_of_a_name_is_its_next_occurrence(
        transactional_db: None) -> None:
    run = enqueue("tests.step_loop", {"n": 3})
    burst()
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED, run.error_message
    assert run.output == {"drafts": ["draft 0", "draft 1", "draft 2"]}
    assert steps_of(run) == [("draft", n, "done", 1) for n in (1, 2, 3)]
    assert executions(run.pk) == [f"run-{run.pk}/draft/{n}" for n in (1, 2, 3)]
    step = RunStep.objects.get(run=run, occurrence=3)
    assert (step.result, step.input_tokens, step.output_tokens, step.cost) == \
        ("draft 2", 10, 2, 0.5)  # usage recorded inside the step is the step's
    events = RunEvent.objects.filter(run=run, type=transitions.STEP).order_by("seq")
    assert [e.payload["occurrence"] for e in events] == [1, 2, 3]
    assert events[0].payload["status"] == "done"


def test_a_retried_run_gets_completed_steps_from_their_records(transactional_db: None) -> None:
    run = enqueue("tests.step_loop", {"n": 3, "fail": True})
    burst()
    run.refresh_from_db()
    assert (run.status, run.attempt) == (Status.SUCCEEDED, 2)
    assert run.output == {"drafts": ["draft 0", "draft 1", "draft 2"]}
    assert len(executions(run.pk)) == 3  # attempt 2 executed none of them
    assert run.input_tokens == 30  # nor recorded their usage again


def worker_burst(env: dict[str, str]) -> None:
    result = helpers.run_manage(["runworker", "--burst"], env)
    assert result.returncode == 0, result.stderr


def test_steps_across_a_wait_and_its_resume(worker_env: dict[str, str]) -> None:
    run = enqueue("tests.step_wait")
    worker_burst(worker_env)
    assert AgentRun.objects.get(pk=run.pk).status == Status.WAITING
    deliver(run.pk, "go", 7)
    worker_burst(worker_env)
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED, run.error_message
    assert run.output == {"before": "b", "after": "a:7"}
    assert executions(run.pk) == [f"run-{run.pk}/before/1", f"run-{run.pk}/after/1"]


def test_a_step_is_retried_within_the_attempt(transactional_db: None) -> None:
    run = enqueue("tests.step_retry", {"fail": 2, "retries": 2})
    burst()
    run.refresh_from_db()
    assert (run.status, run.attempt) == (Status.SUCCEEDED, 1)
    assert executions(run.pk) == [f"run-{run.pk}/flaky/1"] * 3  # same key each time
    assert steps_of(run) == [("flaky", 1, "done", 1)]
    failed = RunEvent.objects.filter(run=run, type=transitions.STEP,
                                     payload__status="failed").count()
    assert failed == 2


def test_a_step_out_of_retries_fails_the_attempt(transactional_db: None) -> None:
    run = enqueue("tests.step_retry", {"fail": 5, "retries": 1})
    burst()
    run.refresh_from_db()
    assert (run.status, run.reason) == (Status.FAILED, Reason.RETRIES_EXHAUSTED)
    assert len(executions(run.pk)) == 2
    step = RunStep.objects.get(run=run)
    assert step.status == "failed"
    assert "blip" in step.error


def test_a_not_retryable_error_is_not_retried_by_the_step(transactional_db: None) -> None:
    run = enqueue("tests.step_retry", {"fail": 5, "retries": 3, "error": "fatal"})
    burst()
    run.refresh_from_db()
    assert (run.status, run.reason) == (Status.FAILED, Reason.NOT_RETRYABLE)
    assert len(executions(run.pk)) == 1


def test_a_sync_step_past_its_timeout_is_failed_and_its_late_result_discarded(
        transactional_db: None) -> None:
    run = enqueue("tests.step_timeout", {"sleep": 1.0, "timeout": 0.2})
    burst()
    run.refresh_from_db()
    assert run.status == Status.FAILED
    assert run.error_type == "django_agentruns.exceptions.StepTimeout"
    assert f"run-{run.pk}/slow/1" in run.error_message
    step = RunStep.objects.get(run=run)
    assert (step.status, step.result) == ("failed", None)
    # The thread ran on and returned later: its result is nowhere.
    helpers.wait_until(lambda: "late" in executions(run.pk), message="the thread to end")
    step.refresh_from_db()
    assert (step.status, step.result) == ("failed", None)


def test_an_async_agents_asteps(worker_env: dict[str, str]) -> None:
    run = enqueue("tests.async_step_chain", {"n": 3})
    worker_burst(worker_env)
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED, run.error_message
    keys = [f"run-{run.pk}/call/{n}" for n in (1, 2, 3)]
    assert [r["key"] for r in run.output["results"]] == keys
    assert executions(run.pk) == keys


def test_an_async_step_past_its_timeout_is_cancelled(transactional_db: None) -> None:
    run = enqueue("tests.async_step_chain", {"n": 1, "sleep": 5, "timeout": 0.2})
    burst()
    run.refresh_from_db()
    assert run.error_type == "django_agentruns.exceptions.StepTimeout"
    assert RunStep.objects.get(run=run).status == "failed"


def test_a_non_json_result_is_a_clear_error_naming_the_step(transactional_db: None) -> None:
    from django_agentruns import agent
    from django_agentruns.registry import unregister

    @agent("tests.step_bad_result", max_requeues=0)
    def bad(ctx):  # type: ignore[no-untyped-def]
        return ctx.step("opaque", object)

    try:
        run = enqueue("tests.step_bad_result")
        burst()
    finally:
        unregister("tests.step_bad_result")
    run.refresh_from_db()
    assert (run.status, run.reason) == (Status.FAILED, Reason.NOT_RETRYABLE)
    assert "Result of step 'opaque'" in run.error_message


def test_the_cap_on_steps_per_run(transactional_db: None, settings: Any) -> None:
    settings.AGENTRUNS = {**settings.AGENTRUNS, "MAX_STEPS_PER_RUN": 2}
    run = enqueue("tests.step_loop", {"n": 3})
    burst()
    run.refresh_from_db()
    assert run.status == Status.FAILED
    assert "MAX_STEPS_PER_RUN" in run.error_message
    assert "'draft'" in run.error_message
    assert RunStep.objects.filter(run=run).count() == 2


# --------------------------------------------------------------------------- fencing


def claim_one(worker: str = "w-steps") -> AttemptRef:
    [run] = transitions.claim(worker, ["default"], 1, scope_policy(), {}, 2.0)
    return AttemptRef(run.pk, run.attempt, worker, 2.0)


def test_a_step_write_after_the_lease_moved_records_nothing(db: None) -> None:
    run = enqueue("tests.noop")
    ref = claim_one()
    start = transitions.StepStartWrite(ref, "pay", None, 0, 100)
    assert transitions.start_step(start).occurrence == 1
    # Another worker took the run over (its lease lapsed and was reclaimed).
    AgentRun.objects.filter(pk=run.pk).update(claimed_by="w-other", attempt=F("attempt") + 1)

    ended = transitions.end_step(transitions.StepEndWrite(ref, "pay", 1, done=True, result=1))
    assert ended is Renewal.LOST
    assert transitions.start_step(start).renewal is Renewal.LOST
    step = RunStep.objects.get(run=run)
    assert (step.status, step.result) == ("started", None)
    assert not RunEvent.objects.filter(run=run, type=transitions.STEP).exists()


def test_a_started_step_cap_is_checked_by_its_write(db: None) -> None:
    enqueue("tests.noop")
    ref = claim_one()
    transitions.start_step(transitions.StepStartWrite(ref, "a", None, 0, 1))
    with pytest.raises(LimitExceeded, match="'b'"):
        transitions.start_step(transitions.StepStartWrite(ref, "b", None, 0, 1))


def test_a_step_outside_a_running_attempt_is_a_clear_error(db: None) -> None:
    from django_agentruns.exceptions import InvalidInputError
    from django_agentruns.runtime.context import RunContext
    from django_agentruns.runtime.control import AttemptControl

    control = AttemptControl(AttemptRef(1, 1, "w", 2.0), None, 0)
    control.done.set()
    ctx = RunContext(run_id=1, agent="a", input={}, attempt=1, state=None, scope="",
                     control=control)
    with pytest.raises(InvalidInputError, match="running attempt"):
        ctx.step("x", lambda: 1)
    assert ctx.step_key is None


# --------------------------------------------------------------------------- real workers


def kill_and_finish(worker: helpers.ManageProcess, run: AgentRun,
                    env: dict[str, str]) -> AgentRun:
    worker.kill()
    worker.wait()
    helpers.wait_until(lambda: reaper.reap().requeued, timeout=60,
                       message="the dead worker's lease to lapse and be reaped")
    result = helpers.run_manage(["runworker", "--burst"], env)
    assert result.returncode == 0, result.stderr
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED, run.error_message
    return run


@pytest.mark.slow
def test_a_sigkill_after_a_steps_end_was_recorded_does_not_repeat_it(
        worker_env: dict[str, str]) -> None:
    run = enqueue("tests.step_chain", {"n": 3, "pause_after": 1})
    worker = helpers.start_manage(["runworker"], worker_env)
    helpers.wait_until(lambda: RunStep.objects.filter(run=run, status="done").count() == 2,
                       message="two steps done")
    run = kill_and_finish(worker, run, worker_env)
    keys = [f"run-{run.pk}/call/{n}" for n in (1, 2, 3)]
    assert executions(run.pk) == keys  # each executed once, across two attempts
    assert [r["key"] for r in run.output["results"]] == keys
    assert steps_of(run) == [("call", 1, "done", 1), ("call", 2, "done", 1),
                             ("call", 3, "done", 2)]


@pytest.mark.slow
def test_a_sigkill_inside_a_step_repeats_it_once_with_the_same_key(
        worker_env: dict[str, str]) -> None:
    run = enqueue("tests.step_chain", {"n": 3, "hang_in": 1})
    worker = helpers.start_manage(["runworker"], worker_env)
    helpers.wait_until(lambda: len(executions(run.pk)) == 2, message="inside step 2")
    # A step running past START_HELD has its start written by the lease keeper.
    helpers.wait_until(lambda: steps_of(run)[-1:] == [("call", 2, "started", 1)],
                       message="step 2's start written while it runs")
    run = kill_and_finish(worker, run, worker_env)
    key = f"run-{run.pk}/call/"
    assert executions(run.pk) == [key + "1", key + "2", key + "2", key + "3"]
    assert steps_of(run) == [("call", 1, "done", 1), ("call", 2, "done", 2),
                             ("call", 3, "done", 2)]


def test_the_guides_examples_run_as_printed(transactional_db: None) -> None:
    import re

    from django_agentruns import run_now
    from django_agentruns.registry import unregister

    guide = (helpers.REPO_ROOT / "docs" / "steps.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    for block in blocks:
        compile(block, "docs/steps.md", "exec")
    try:
        exec(blocks[0], {})
        exec(blocks[-1], {})
        assert run_now("support.triage", {"message": "hi"}) == {
            "verdict": "answer to 'Classify: hi'", "ticket": 1234}
        run = AgentRun.objects.get(agent="support.triage")
        assert [s.name for s in RunStep.objects.filter(run=run)] == ["classify", "ticket"]
        assert run.input_tokens == 120
        assert run_now("support.summarise") == {"done": 0}
    finally:
        unregister("support.triage")
        unregister("support.summarise")


def test_step_writes_of_many_runs_in_one_batch_keep_their_own_fences(db: None) -> None:
    from django.db import transaction

    from django_agentruns.outcomes import StepStart
    from django_agentruns.transitions import batched

    first, second = enqueue("tests.noop"), enqueue("tests.noop")
    [a, b] = [AttemptRef(r.pk, r.attempt, "w-steps", 2.0) for r in transitions.claim(
        "w-steps", ["default"], 2, scope_policy(), {}, 2.0)]
    AgentRun.objects.filter(pk=b.run_id).update(claimed_by="w-other")  # b lost its run
    with transaction.atomic():
        started = batched.apply_writes([transitions.StepStartWrite(a, "s", None, 0, 10),
                                        transitions.StepStartWrite(b, "s", None, 0, 10)])
    assert started == [StepStart(Renewal.OK, 1), StepStart(Renewal.LOST)]
    with transaction.atomic():
        ended = batched.apply_writes([transitions.StepEndWrite(a, "s", 1, True, [1]),
                                      transitions.StepEndWrite(b, "s", 1, True, [2])])
    assert ended == [Renewal.OK, Renewal.LOST]
    assert list(RunStep.objects.values_list("run_id", "status", "result")) == [
        (first.pk if a.run_id == first.pk else second.pk, "done", [1])]
    assert RunEvent.objects.filter(type=transitions.STEP).count() == 1
    with transaction.atomic():  # a later attempt reaching it gets the stored result
        [again] = batched.apply_writes([transitions.StepStartWrite(a, "s", 1, 0, 10)])
    assert again == StepStart(Renewal.OK, 1, done=True, result=[1])


def test_steps_are_counted_by_outcome_and_traced(transactional_db: None) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    def count(outcome: str) -> float:
        return prometheus_client.REGISTRY.get_sample_value(
            "agentruns_steps_total", {"agent": "tests.step_loop", "outcome": outcome}) or 0.0

    from opentelemetry import trace

    # The global provider can be set once per process; reuse one another test set.
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    before = {o: count(o) for o in ("done", "replayed", "failed")}
    run = enqueue("tests.step_loop", {"n": 3, "fail": True})
    burst()
    assert {o: count(o) - before[o] for o in before} == {"done": 3, "replayed": 3, "failed": 0}
    steps = [s for s in exporter.get_finished_spans() if s.name == "step draft"]
    exporter.shutdown()
    assert [s.attributes["agentruns.step.key"] for s in steps] == [
        f"run-{run.pk}/draft/{n}" for n in (1, 2, 3)]  # executions only, not replays
