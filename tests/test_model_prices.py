"""Configured model prices (`AGENTRUNS["MODEL_PRICES"]`, per million tokens): the cost
`record_usage` records for a call given no cost is its tokens times the model's price; an
exact name wins over a prefix pattern, a longer pattern over a shorter; a given cost stands.
End to end, the real `openai` client against the fake provider, and a Pydantic AI agent
whose model has a configured price (which wins over the price list its framework knows)."""

from __future__ import annotations

from typing import Any

import pytest

from django_agentruns import RunContext, agent, enqueue
from django_agentruns.models import AgentRun, RunUsage, Status
from django_agentruns.registry import unregister
from django_agentruns.rules.pricing import Price, price_of
from django_agentruns.runtime.worker import Worker
from tests.fakeprovider import ENV_VAR, FakeProvider, Reply

PRICES = {"gpt-4o-mini": {"input": 0.15, "output": 0.6},
          "gpt-4o-mini-*": {"input": 0.2, "output": 0.8},
          "gpt-4o-*": {"input": 2.5, "output": 10}}


def test_the_price_of_a_model_exact_then_the_longest_pattern() -> None:
    assert price_of("gpt-4o-mini", PRICES) == Price(0.15, 0.6)
    assert price_of("gpt-4o-mini-2024-07-18", PRICES) == Price(0.2, 0.8)
    assert price_of("gpt-4o-2024-08-06", PRICES) == Price(2.5, 10)
    assert price_of("o3", PRICES) is None
    assert price_of("", PRICES) is None
    assert price_of("gpt-4o-x", {"gpt-4o-*": {"input": -1, "output": 1}}) is None  # E016's
    assert Price(0.15, 0.6).cost(1_000_000, 2_000_000) == pytest.approx(1.35)


@pytest.fixture
def priced_agent() -> Any:
    @agent("tests.priced_openai")
    def priced_openai(ctx: RunContext) -> dict[str, Any]:
        """One chat completion through the real client; usage recorded with no cost (the
        price is configured), or with the cost input["cost"] names."""
        import os

        import openai

        client = openai.OpenAI(base_url=os.environ[ENV_VAR], api_key="sk-test", max_retries=0)
        answer = client.chat.completions.create(
            model=ctx.input["model"], messages=[{"role": "user", "content": "Hi"}])
        assert answer.usage is not None
        ctx.record_usage(input_tokens=answer.usage.prompt_tokens,
                         output_tokens=answer.usage.completion_tokens,
                         cost=ctx.input.get("cost", 0.0), model=answer.model)
        return {"text": answer.choices[0].message.content}

    yield
    unregister("tests.priced_openai")


def with_prices(settings: Any, prices: dict[str, Any]) -> None:
    settings.AGENTRUNS = {**(settings.AGENTRUNS or {}), "MODEL_PRICES": prices}


def burst() -> None:
    Worker(burst=True, reap_interval=0).run(install_signals=False)


@pytest.mark.django_db(transaction=True)
def test_the_cost_recorded_is_the_tokens_times_the_configured_price(
        fake_provider: FakeProvider, monkeypatch: pytest.MonkeyPatch, priced_agent: None,
        settings: Any) -> None:
    with_prices(settings, PRICES)
    monkeypatch.setenv(ENV_VAR, fake_provider.url)
    fake_provider.script([Reply("a", usage=(1200, 300))], model="gpt-4o-mini")
    fake_provider.script([Reply("b", usage=(1000, 500))], model="gpt-4o-mini-2024-07-18")
    fake_provider.script([Reply("c", usage=(800, 200))], model="unpriced")
    fake_provider.script([Reply("d", usage=(1000, 1000))], model="gpt-4o-2024-08-06")
    ids = [enqueue("tests.priced_openai", given).pk for given in (
        {"model": "gpt-4o-mini"}, {"model": "gpt-4o-mini-2024-07-18"}, {"model": "unpriced"},
        {"model": "gpt-4o-2024-08-06", "cost": 0.5})]
    burst()
    exact, dated, unpriced, given = (AgentRun.objects.get(pk=pk) for pk in ids)
    for run in (exact, dated, unpriced, given):
        assert run.status == Status.SUCCEEDED, run.error_message
    assert exact.cost == pytest.approx((1200 * 0.15 + 300 * 0.6) / 1e6)
    assert dated.cost == pytest.approx((1000 * 0.2 + 500 * 0.8) / 1e6)
    assert unpriced.cost == 0.0
    assert given.cost == 0.5  # a cost the agent gives stands
    assert RunUsage.objects.get(run=exact).cost == pytest.approx(exact.cost)


@pytest.mark.django_db(transaction=True)
def test_a_pydantic_ai_agent_is_charged_the_configured_price_not_its_frameworks(
        fake_provider: FakeProvider, monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    pytest.importorskip("pydantic_ai")
    with_prices(settings, {"gpt-4o-mini": {"input": 1.0, "output": 3.0}})
    from django_agentruns.streaming import transport

    monkeypatch.setenv(ENV_VAR, fake_provider.url)
    monkeypatch.setattr(transport, "PRUNE_DELAY", 0.0)
    # genai-prices knows gpt-4o-mini at 0.15 / 0.6: the configured 1.0 / 3.0 must win.
    fake_provider.script([Reply("Hello.", usage=(2000, 1000))], model="gpt-4o-mini")
    pk = enqueue("tests.pydantic_ai", {"model": "gpt-4o-mini"}).pk
    burst()
    run = AgentRun.objects.get(pk=pk)
    assert run.status == Status.SUCCEEDED, run.error_message
    assert (run.input_tokens, run.output_tokens) == (2000, 1000)
    assert run.cost == pytest.approx((2000 * 1.0 + 1000 * 3.0) / 1e6)
