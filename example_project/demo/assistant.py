"""The chat page's agent: a real Pydantic AI agent, run durably with `DurableAgent`.

It answers a customer; asked for a refund, it calls its `refund` tool, which needs a
person's approval (`requires_approval=True`): the run waits (no worker held) until someone
approves or rejects the call on the run's admin page, then the tool runs once, or the model
is told it was refused. Its text streams to the page live (`ctx.stream`), each model call
and tool call is a durable step, and each response's tokens are recorded as the run's usage.

Which model: a real provider when the environment names one (`OPENAI_API_KEY`, or
`OPENAI_BASE_URL` for an OpenAI-compatible server; `DEMO_MODEL` picks the model, default
gpt-4o-mini), else the demo's canned model server (`model_server`), started in the worker.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from django_agentruns import RunContext, agent
from django_agentruns.integrations.pydantic_ai import DurableAgent

from . import model_server

NAME = "demo.assistant"
QUESTION = "My order 1042 arrived two weeks late. Can I have a refund of 20 EUR?"
INSTRUCTIONS = (
    "You are a shop's support assistant. When a customer asks for a refund, call the refund "
    "tool once with the order number and the amount in euros, then tell them in one "
    "sentence how it went. Otherwise answer in at most three sentences."
)


def uses_real_provider() -> bool:
    return bool(os.environ.get("OPENAI_API_KEY") or os.environ.get("OPENAI_BASE_URL"))


def model_name() -> str:
    return os.environ.get("DEMO_MODEL", "gpt-4o-mini") if uses_real_provider() else "demo-model"


@functools.cache
def durable_assistant() -> DurableAgent[str]:
    """Built on first use in the process that runs it (the worker), not at import."""
    if uses_real_provider():
        provider = OpenAIProvider()  # reads OPENAI_API_KEY and OPENAI_BASE_URL
    else:
        provider = OpenAIProvider(base_url=model_server.base_url(), api_key="demo")
    support = Agent(OpenAIChatModel(model_name(), provider=provider), name="assistant",
                    instructions=INSTRUCTIONS)

    @support.tool_plain(requires_approval=True)
    def refund(order: int, amount: int) -> str:
        """Refund `amount` euros on order `order`; a person approves each call first."""
        return f"refunded {amount} EUR on order {order}"

    return DurableAgent(support)


@agent(NAME, queue="default", max_requeues=3, timeout=120)
async def assistant(ctx: RunContext) -> dict[str, Any]:
    question = str(ctx.input.get("question") or QUESTION)
    result = await durable_assistant().run(question)
    return {"question": question, "answer": result.output, "model": model_name()}
