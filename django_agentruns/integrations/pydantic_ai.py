"""Run a Pydantic AI agent durably inside an agent run: `DurableAgent(agent)`.

    from django_agentruns import agent
    from django_agentruns.integrations.pydantic_ai import DurableAgent

    support = DurableAgent(Agent("openai:gpt-5.2", tools=[...]))

    @agent("support")
    def answer(ctx):
        return support.run_sync(ctx.input["question"]).output

Each model request and each tool call is a durable step (`ctx.step`): a resumed attempt
(after a crash, a wait, a snooze) gets them back from their records, without calling the
provider or the tool again, and the conversation goes on where it was. The model's text
streams to `ctx.stream` as it arrives; each response's usage goes to `record_usage`
(with its cost: the model's price in MODEL_PRICES, else where genai-prices knows it). A
tool that requires approval (`requires_approval=True`, or `ApprovalRequired` raised by the
tool) becomes
`ctx.request_approval`: the run waits, holding no worker, until someone approves or
rejects it in the admin (or with `approve` / `reject`); then the tool runs, or the model
is told it was refused.

It is built on Pydantic AI's public extension points (a capability that wraps the model
and the toolsets, and resolves deferred tool calls), not on its durable-engine base,
whose units assume an engine of their own (a workflow) around the whole run.
"""

from __future__ import annotations

from ._bridge import require

require("pydantic_ai", "pydantic-ai")

import weakref  # noqa: E402 (after the check: a missing extra is named, not a bare error)
from collections.abc import AsyncIterator, Sequence  # noqa: E402
from contextlib import asynccontextmanager  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Generic, TypeVar  # noqa: E402

from pydantic_ai import messages as _messages  # noqa: E402
from pydantic_ai.agent import AbstractAgent  # noqa: E402
from pydantic_ai.capabilities import AbstractCapability  # noqa: E402
from pydantic_ai.exceptions import UserError  # noqa: E402
from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse  # noqa: E402
from pydantic_ai.models.wrapper import WrapperModel  # noqa: E402
from pydantic_ai.run import AgentRunResult  # noqa: E402
from pydantic_ai.settings import ModelSettings  # noqa: E402
from pydantic_ai.tools import (  # noqa: E402
    DeferredToolRequests,
    DeferredToolResults,
    RunContext,
    ToolApproved,
    ToolDenied,
)
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset  # noqa: E402

from ..rules.pricing import price_of  # noqa: E402
from ..runtime.context import RunContext as AgentRunContext  # noqa: E402
from ._bridge import RunBridge, Usage, genai_span, set_usage, step_name  # noqa: E402

__all__ = ["DurableAgent"]

OutputT = TypeVar("OutputT")
_SYSTEM_PREFIX = "pydantic-ai"
_calls: weakref.WeakKeyDictionary[AgentRunContext, int] = weakref.WeakKeyDictionary()


class DurableAgent(Generic[OutputT]):
    """A Pydantic AI `Agent` whose runs, inside an agent run, are made of durable steps.

    `run_sync(...)` (in a sync agent) and `await run(...)` (in an async one) take what the
    agent's own do and return its `AgentRunResult`. Outside an agent run they raise.
    """

    def __init__(self, agent: AbstractAgent[Any, OutputT], *, name: str | None = None) -> None:
        self.agent = agent
        self.name = name or agent.name or "agent"

    def run_sync(self, user_prompt: Any = None, **kwargs: Any) -> AgentRunResult[Any]:
        bridge = RunBridge.current(threaded=True, entry="DurableAgent.run_sync")
        return self.agent.run_sync(user_prompt, **self._durable(bridge, kwargs))

    async def run(self, user_prompt: Any = None, **kwargs: Any) -> AgentRunResult[Any]:
        bridge = RunBridge.current(threaded=False, entry="DurableAgent.run")
        result: AgentRunResult[Any] = await self.agent.run(
            user_prompt, **self._durable(bridge, kwargs))
        return result

    def _durable(self, bridge: RunBridge, kwargs: dict[str, Any]) -> dict[str, Any]:
        if kwargs.get("event_stream_handler") is not None:
            raise UserError("DurableAgent streams the model's text to ctx.stream itself; "
                            "an event_stream_handler is not supported")
        # The n-th agent run of this attempt: the same n in every attempt, since the agent's
        # code runs again from its start. It names the steps and Pydantic AI's run id, so a
        # replayed response belongs to the run that reads it back.
        number = _calls.get(bridge.ctx, 0) + 1
        _calls[bridge.ctx] = number
        prefix = step_name(_SYSTEM_PREFIX, self.name, str(number))
        kwargs.setdefault("run_id", f"agentrun-{bridge.ctx.run_id}-{prefix}")
        capability = _Durability(bridge=bridge, prefix=prefix)
        kwargs["capabilities"] = [*(kwargs.get("capabilities") or ()), capability]
        return kwargs


@dataclass
class _Durability(AbstractCapability[Any]):
    """Wraps the model and the toolsets in steps, and answers deferred tool calls with
    approvals of the run."""

    bridge: RunBridge
    prefix: str
    requests: list[int] = field(default_factory=lambda: [0])  # model requests so far

    @classmethod
    def get_serialization_name(cls) -> str | None:
        return None

    def get_wrapper_model(self, model: Model) -> Model | None:
        return _StepModel(model, self)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        return _StepToolset(toolset, durability=self)

    async def handle_deferred_tool_calls(self, ctx: RunContext[Any], *,
                                         requests: DeferredToolRequests) -> DeferredToolResults:
        results = DeferredToolResults()
        for call in requests.approvals:
            # The key names the model request that asked, so a tool call id the provider
            # reuses in a later turn ("call_0") asks again.
            key = step_name(self.prefix, f"approve-{self.requests[0]}", call.tool_name,
                            call.tool_call_id)
            answer = await self.bridge.request_approval(
                key, {"tool": call.tool_name, "args": call.args_as_dict()})
            if not answer.approved:
                results.approvals[call.tool_call_id] = ToolDenied(
                    f"The tool call was rejected by {answer.by or 'a person'}"
                    + (f": {answer.note}" if answer.note else "."))
                continue
            edited = answer.proposal.get("args") if isinstance(answer.proposal, dict) else None
            results.approvals[call.tool_call_id] = ToolApproved(
                override_args=edited if isinstance(edited, dict) and
                edited != call.args_as_dict() else None)
            if answer.by:
                results.answered_by[call.tool_call_id] = answer.by
        return results


class _StepModel(WrapperModel):
    """Each request a step: streamed from the provider (text to `ctx.stream`), stored as
    Pydantic AI's own JSON form of the response, and read back from it on a replay."""

    def __init__(self, wrapped: Model, durability: _Durability) -> None:
        super().__init__(wrapped)
        self.durability = durability

    async def request(self, messages: list[_messages.ModelMessage],
                      model_settings: ModelSettings | None,
                      model_request_parameters: ModelRequestParameters) -> _messages.ModelResponse:
        self.durability.requests[0] += 1
        bridge = self.durability.bridge

        async def body() -> tuple[Any, Usage | None]:
            with genai_span("chat", system=self.wrapped.system,
                            model=self.wrapped.model_name) as span:
                async with self.wrapped.request_stream(messages, model_settings,
                                                       model_request_parameters) as stream:
                    async for event in stream:
                        await bridge.stream(_text_of(event))
                    response = stream.get()
                usage = _usage(response)
                set_usage(span, usage, response.model_name or "")
            return _dump(response), usage

        stored = await bridge.step(step_name(self.durability.prefix, "model"), body)
        return _load(stored)

    @asynccontextmanager
    async def request_stream(self, messages: list[_messages.ModelMessage],
                             model_settings: ModelSettings | None,
                             model_request_parameters: ModelRequestParameters,
                             run_context: RunContext[Any] | None = None,
                             ) -> AsyncIterator[StreamedResponse]:
        raise UserError("DurableAgent runs with run() / run_sync(); its text streams to "
                        "ctx.stream (run_stream and event handlers are not durable)")
        yield  # pragma: no cover  (an async generator, for asynccontextmanager)


@dataclass
class _StepToolset(WrapperToolset[Any]):
    """Each tool call a step, named by the tool and its call id (parallel calls of one
    response finish in any order; their names, not their order, find their records)."""

    durability: _Durability = field(kw_only=True)

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any],
                        tool: ToolsetTool[Any]) -> Any:
        async def body() -> tuple[Any, Usage | None]:
            with genai_span("execute_tool", system=_SYSTEM_PREFIX, tool=name,
                            call_id=ctx.tool_call_id or ""):
                result = await self.wrapped.call_tool(name, tool_args, ctx, tool)
            return result, None

        step = step_name(self.durability.prefix, "tool", name, ctx.tool_call_id or "")
        return await self.durability.bridge.step(step, body)


def _text_of(event: _messages.ModelResponseStreamEvent) -> str:
    if isinstance(event, _messages.PartStartEvent) and isinstance(event.part, _messages.TextPart):
        return event.part.content
    if isinstance(event, _messages.PartDeltaEvent) and \
            isinstance(event.delta, _messages.TextPartDelta):
        return event.delta.content_delta
    return ""


def _usage(response: _messages.ModelResponse) -> Usage:
    # A price in MODEL_PRICES wins (record_usage applies it to a cost of 0); else the one
    # genai-prices knows.
    cost = 0.0
    if price_of(response.model_name or "") is None:
        try:
            cost = float(response.cost().total_price)
        except Exception:  # no price known for the model, or no usage reported
            cost = 0.0
    return Usage(input_tokens=response.usage.input_tokens or 0,
                 output_tokens=response.usage.output_tokens or 0, cost=cost,
                 model=response.model_name or "")


def _dump(response: _messages.ModelResponse) -> Any:
    dumped: list[Any] = _messages.ModelMessagesTypeAdapter.dump_python([response], mode="json")
    return dumped[0]


def _load(stored: Any) -> _messages.ModelResponse:
    loaded: Sequence[_messages.ModelMessage] = \
        _messages.ModelMessagesTypeAdapter.validate_python([stored])
    response = loaded[0]
    assert isinstance(response, _messages.ModelResponse), response
    return response
