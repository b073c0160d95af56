"""Usage and budgets: `ctx.record_usage` adds to the run's totals in a fenced write (and an
event); past its budget an attempt stops at its next context call and the run is
dead-lettered `budget_exhausted`; `retry(run_id, budget=...)` lets it go on."""

from __future__ import annotations

import pytest

from django_agentruns import InvalidInputError, agent, enqueue, retry, transitions
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.outcomes import AttemptRef, Renewal, UsageTotals
from django_agentruns.registry import unregister
from django_agentruns.rules.limits import Budget, check_budget
from django_agentruns.runtime.attempt_store import AttemptStore
from django_agentruns.runtime.worker import Worker

pytestmark = pytest.mark.django_db(transaction=True)


def burst() -> None:
    Worker(burst=True, reap_interval=0, max_contention_wait=10).run(install_signals=False)


def types(run_id: int) -> list[str]:
    return list(RunEvent.objects.filter(run_id=run_id).order_by("seq")
                .values_list("type", flat=True))


def test_a_budget_stops_the_run_at_its_third_step_and_a_raised_one_lets_it_finish() -> None:
    """1,000 tokens, 400 per step: the third step's usage passes it, and the next context
    call (its checkpoint) stops the attempt."""
    run = enqueue("tests.spender", {"steps": 5})
    burst()
    run.refresh_from_db()
    assert (run.status, run.reason) == (Status.FAILED, Reason.BUDGET_EXHAUSTED)
    assert run.is_dead_letter
    assert (run.input_tokens, run.output_tokens, run.checkpoint_count) == (900, 300, 2)
    assert run.cost == pytest.approx(0.03)
    assert run.requeue_count == 0
    assert run.error_type == "BudgetExhausted"
    assert "tokens 1200 > 1000" in run.error_message
    assert types(run.pk) == ["run.started", "run.usage", "run.checkpoint", "run.usage",
                             "run.checkpoint", "run.usage", "run.dead_lettered"]
    usage = RunEvent.objects.filter(run=run, type=transitions.USAGE).first()
    assert usage is not None
    assert usage.payload == {"input_tokens": 300, "output_tokens": 100, "cost": 0.01,
                             "model": "gpt-test"}

    # A retry with the same budget stops again at once (its first context call).
    assert retry(run.pk) is True
    burst()
    run.refresh_from_db()
    assert (run.status, run.reason, run.input_tokens) == (
        Status.FAILED, Reason.BUDGET_EXHAUSTED, 900)

    assert retry(run.pk, budget={"tokens": 5000}) is True
    assert AgentRun.objects.get(pk=run.pk).budget == {"tokens": 5000}
    burst()
    run.refresh_from_db()
    assert (run.status, run.output) == (Status.SUCCEEDED, {"steps": 5})
    # Resumed at checkpoint 2: step 3 ran (and spent) again; 1,200 + 3 x 400.
    assert (run.input_tokens + run.output_tokens, run.checkpoint_count) == (2400, 5)
    retried = RunEvent.objects.filter(run=run, type=transitions.RETRIED).last()
    assert retried is not None
    assert retried.payload["budget"] == {"tokens": 5000}


def test_an_async_agent_with_a_cost_budget() -> None:
    run = enqueue("tests.async_spender", {"steps": 5})
    burst()
    run.refresh_from_db()
    # 0.01 per step, budget 0.025: the third step passes it.
    assert (run.status, run.reason, run.checkpoint_count) == (
        Status.FAILED, Reason.BUDGET_EXHAUSTED, 2)
    assert "cost 0.03 > 0.025" in run.error_message


def test_usage_without_a_budget_only_adds_up() -> None:
    @agent("tests.budgetless")
    def budgetless(ctx):  # type: ignore[no-untyped-def]
        for _ in range(3):
            ctx.record_usage(input_tokens=10**6, output_tokens=1, cost=1.5, model="big")
        ctx.record_usage()  # nothing at all: still a step boundary
        return {}

    try:
        run = enqueue("tests.budgetless")
        burst()
        run.refresh_from_db()
        assert run.status == Status.SUCCEEDED
        assert (run.input_tokens, run.output_tokens, run.cost) == (3 * 10**6, 3, 4.5)
    finally:
        unregister("tests.budgetless")


@pytest.mark.parametrize("kwargs", [
    {"input_tokens": -1}, {"output_tokens": 1.5}, {"input_tokens": True}, {"cost": -0.1},
    {"cost": float("nan")}, {"cost": "1"}, {"model": 7}, {"model": "x" * 101},
    {"model": "a\x00b"},
])
def test_bad_usage_is_a_clear_error_that_writes_nothing(kwargs: dict[str, object]) -> None:
    @agent("tests.bad_usage", max_requeues=0)
    def bad_usage(ctx):  # type: ignore[no-untyped-def]
        ctx.record_usage(**kwargs)

    try:
        run = enqueue("tests.bad_usage")
        burst()
        run.refresh_from_db()
        assert (run.status, run.reason) == (Status.FAILED, Reason.NOT_RETRYABLE)
        assert run.error_type == "django_agentruns.exceptions.InvalidInputError"
        assert (run.input_tokens, run.output_tokens, run.cost) == (0, 0, 0.0)
        assert transitions.USAGE not in types(run.pk)
    finally:
        unregister("tests.bad_usage")


def test_usage_is_fenced() -> None:
    """A writer that lost the run adds nothing to its totals."""
    run = enqueue("tests.noop")
    (claimed,) = transitions.claim("w1", ["default"], 1, transitions.ScopePolicy(), {}, 60.0)
    stale = AttemptRef(run.pk, claimed.attempt, "someone-else", 60.0)
    assert transitions.record_usage(stale, 5, 5, 1.0, "m").renewal is Renewal.LOST
    assert AgentRun.objects.values_list("input_tokens", "cost").get(pk=run.pk) == (0, 0.0)
    mine = AttemptRef(run.pk, claimed.attempt, "w1", 60.0)
    assert transitions.record_usage(mine, 5, 6, 1.0, "m") == UsageTotals(Renewal.OK, 11, 1.0)


def test_usage_writes_go_through_the_attempt_store() -> None:
    """A worker's usage writes are batched with its other writes: each keeps its fence,
    and answers its run's totals after it."""
    run = enqueue("tests.noop")
    (claimed,) = transitions.claim("w1", ["default"], 1, transitions.ScopePolicy(), {}, 60.0)
    mine = AttemptRef(run.pk, claimed.attempt, "w1", 60.0)
    stale = AttemptRef(run.pk, claimed.attempt, "someone-else", 60.0)
    store = AttemptStore(writers=1)
    try:
        first = store.call(transitions.UsageWrite(mine, 3, 4, 0.5, "m"))
        lost = store.call(transitions.UsageWrite(stale, 100, 100, 9.0, "m"))
        second = store.call(transitions.UsageWrite(mine, 1, 2, 0.25, "m"))
    finally:
        store.close()
    assert first == UsageTotals(Renewal.OK, 7, 0.5)
    assert lost == UsageTotals(Renewal.LOST, 7, 0.5)
    assert second == UsageTotals(Renewal.OK, 10, 0.75)
    assert RunEvent.objects.filter(run_id=run.pk, type="run.usage").count() == 2


@pytest.mark.parametrize("budget", [
    {"tokenz": 5}, {"tokens": -1}, {"tokens": 1.5}, {"cost": float("inf")}, {"cost": -1},
    [("tokens", 5)], "lots",
])
def test_bad_budgets_are_refused_and_write_nothing(budget: object) -> None:
    with pytest.raises(InvalidInputError, match="budget"):
        check_budget(budget)
    with pytest.raises(InvalidInputError, match="budget"):
        agent("tests.bad_budget", budget=budget)  # type: ignore[arg-type]
    run = enqueue("tests.always_fails")
    burst()
    before = AgentRun.objects.values().get(pk=run.pk)
    with pytest.raises(InvalidInputError, match="budget"):
        retry(run.pk, budget=budget)  # type: ignore[arg-type]
    assert AgentRun.objects.values().get(pk=run.pk) == before


def test_budget_arithmetic() -> None:
    budget = Budget(tokens=1000, cost=2.0)
    assert budget.exceeded_by(1000, 2.0) is None  # reaching it is not passing it
    assert budget.exceeded_by(1001, 0) == "tokens 1001 > 1000"
    assert budget.exceeded_by(0, 2.5) == "cost 2.5 > 2"
    assert check_budget({"tokens": 5}) == Budget(tokens=5)
    assert check_budget({}) == Budget()
