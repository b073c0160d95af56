"""Agents written with agent frameworks (Pydantic AI...), run durably through
`django_agentruns.integrations`, against the fake provider (tests/fakeprovider.py) whose URL
the worker gets in FAKE_PROVIDER_URL. Registered only where the framework is installed.

Their tools record a SideEffect per execution (tests count them) and, given
input["block_file"], wait for that file to exist first: a test kills the worker while a tool
waits, after the model's first answer was recorded.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

from django_agentruns import RunContext, agent
from django_agentruns.context import current_context

from .models import SideEffect


def tool_ran(note: str) -> None:
    ctx = current_context()
    assert ctx is not None
    SideEffect.objects.create(run_id=ctx.run_id, step=0, attempt=ctx.attempt,
                              worker=str(os.getpid()), note=note)
    block = ctx.input.get("block_file")
    if block:
        deadline = time.monotonic() + 120
        while not Path(block).exists() and time.monotonic() < deadline:
            time.sleep(0.05)


if importlib.util.find_spec("pydantic_ai") is not None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from django_agentruns.integrations.pydantic_ai import DurableAgent

    def support_agent(model: str) -> DurableAgent[str]:
        provider = OpenAIProvider(base_url=os.environ["FAKE_PROVIDER_URL"], api_key="sk-test")
        support = Agent(OpenAIChatModel(model, provider=provider), name="support",
                        instructions="Answer with the weather tool.")

        @support.tool_plain
        def weather(city: str) -> str:
            """The weather in a city."""
            tool_ran(f"weather:{city}")
            return f"sunny in {city}"

        @support.tool_plain(requires_approval=True)
        def refund(amount: int) -> str:
            """Refund an amount; a person approves it first."""
            tool_ran(f"refund:{amount}")
            return f"refunded {amount}"

        return DurableAgent(support)

    @agent("tests.pydantic_ai", max_requeues=2)
    def pydantic_ai_sync(ctx: RunContext) -> dict[str, Any]:
        result = support_agent(ctx.input["model"]).run_sync(ctx.input.get("prompt", "Hi"))
        return {"output": result.output, "attempt": ctx.attempt}

    @agent("tests.pydantic_ai_async", max_requeues=2)
    async def pydantic_ai_async(ctx: RunContext) -> dict[str, Any]:
        result = await support_agent(ctx.input["model"]).run(ctx.input.get("prompt", "Hi"))
        return {"output": result.output, "attempt": ctx.attempt}
