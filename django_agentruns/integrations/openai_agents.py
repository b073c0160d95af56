"""Run an OpenAI Agents SDK agent durably inside an agent run: `DurableRunner`.

    from agents import Agent, RunConfig
    from django_agentruns.integrations.openai_agents import DurableRunner

    @agent("support")
    async def answer(ctx):
        result = await DurableRunner.run(triage_agent, ctx.input["question"])
        return result.final_output

Each model call (through the run's model provider) and each function-tool call is a
durable step: a resumed attempt gets them back from their records without calling the
provider or the tool again, so the run goes on where it was, handoffs included (they
happen inside the same run). The model's text streams to `ctx.stream`; each response's
usage goes to `record_usage`. A tool with `needs_approval` becomes `ctx.request_approval`:
the run waits for an answer in the admin (or `approve` / `reject`), then the SDK's run
goes on with the tool approved or rejected.

Models are resolved by the run's model provider (`RunConfig(model_provider=...)`, or the
SDK's default), by name: an agent whose `model` is a `Model` instance is refused, since
its calls would not be steps.
"""

from __future__ import annotations

from ._bridge import require

require("agents", "openai-agents")

import contextvars  # noqa: E402 (after the check: a missing extra is named)
import dataclasses  # noqa: E402
import json  # noqa: E402
import weakref  # noqa: E402
from collections.abc import AsyncIterator  # noqa: E402
from typing import Any  # noqa: E402

from agents import Agent, FunctionTool, Runner, RunResult  # noqa: E402
from agents.exceptions import UserError  # noqa: E402
from agents.items import ModelResponse  # noqa: E402
from agents.model_settings import ModelSettings  # noqa: E402
from agents.models.interface import Model, ModelProvider  # noqa: E402
from agents.models.multi_provider import MultiProvider  # noqa: E402
from agents.run_config import RunConfig  # noqa: E402
from agents.usage import Usage as AgentsUsage  # noqa: E402
from openai.types.responses import ResponseOutputItem  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from ..runtime.context import RunContext as AgentRunContext  # noqa: E402
from ._bridge import RunBridge, Usage, genai_span, set_usage, step_name  # noqa: E402

__all__ = ["DurableRunner"]

_PREFIX = "openai-agents"
_OUTPUT = TypeAdapter(list[ResponseOutputItem])
_calls: weakref.WeakKeyDictionary[AgentRunContext, int] = weakref.WeakKeyDictionary()
_active: contextvars.ContextVar[_Durable | None] = contextvars.ContextVar(
    "agentruns_openai_agents", default=None)


@dataclasses.dataclass
class _Durable:
    bridge: RunBridge
    prefix: str


class DurableRunner:
    """`Runner.run` / `Runner.run_sync` with durable model and tool calls (see the module)."""

    @classmethod
    async def run(cls, starting_agent: Agent[Any], input: Any, **kwargs: Any) -> RunResult:
        durable = _start(RunBridge.current(threaded=False, entry="DurableRunner.run"))
        token = _active.set(durable)
        try:
            return await _run(durable, starting_agent, input, kwargs)
        finally:
            _active.reset(token)

    @classmethod
    def run_sync(cls, starting_agent: Agent[Any], input: Any, **kwargs: Any) -> RunResult:
        import asyncio

        durable = _start(RunBridge.current(threaded=True, entry="DurableRunner.run_sync"))
        context = contextvars.copy_context()
        context.run(_active.set, durable)
        return context.run(asyncio.run, _run(durable, starting_agent, input, kwargs))


def _start(bridge: RunBridge) -> _Durable:
    # The n-th runner call of this attempt: the same n in every attempt (the agent's code
    # runs again from its start); it names the steps.
    number = _calls.get(bridge.ctx, 0) + 1
    _calls[bridge.ctx] = number
    return _Durable(bridge, step_name(_PREFIX, str(number)))


async def _run(durable: _Durable, agent: Agent[Any], input: Any,
               kwargs: dict[str, Any]) -> RunResult:
    _make_tools_durable(agent, set())
    config: RunConfig = kwargs.pop("run_config", None) or RunConfig()
    provider = config.model_provider or MultiProvider()
    model = config.model
    if isinstance(model, Model):
        model = _StepModel(model, durable)
    # Usage is what a run's budget counts: ask for it also from a provider the SDK does not
    # recognise as OpenAI's (a proxy, a local server), unless the caller said otherwise.
    settings = config.model_settings or ModelSettings()
    if settings.include_usage is None:
        settings = dataclasses.replace(settings, include_usage=True)
    config = dataclasses.replace(config, model=model, model_settings=settings,
                                 model_provider=_StepProvider(provider, durable))
    result = await Runner.run(agent, input, run_config=config, **kwargs)
    while result.interruptions:  # tools that need approval: each a wait of the run
        state = result.to_state()
        for item in result.interruptions:
            call_id = str(getattr(item.raw_item, "call_id", "") or getattr(item.raw_item, "id", ""))
            arguments = getattr(item.raw_item, "arguments", None) or "{}"
            try:
                args = json.loads(arguments)
            except ValueError:
                args = arguments
            key = step_name(durable.prefix, "approve", str(item.tool_name), call_id)
            answer = await durable.bridge.request_approval(
                key, {"tool": item.tool_name, "args": args})
            if answer.approved:
                state.approve(item)
            else:
                state.reject(item, rejection_message=(
                    f"The tool call was rejected by {answer.by or 'a person'}"
                    + (f": {answer.note}" if answer.note else ".")))
        result = await Runner.run(agent, state, run_config=config, **kwargs)
    return result


class _StepProvider(ModelProvider):
    def __init__(self, wrapped: ModelProvider, durable: _Durable) -> None:
        self.wrapped, self.durable = wrapped, durable

    def get_model(self, model_name: str | None) -> Model:
        return _StepModel(self.wrapped.get_model(model_name), self.durable)


class _StepModel(Model):
    """Each call a step: streamed from the provider (text to `ctx.stream`), stored as the
    response's output items (JSON) and usage, and read back from them on a replay."""

    def __init__(self, wrapped: Model, durable: _Durable) -> None:
        self.wrapped, self.durable = wrapped, durable

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        bridge = self.durable.bridge
        model_name = str(getattr(self.wrapped, "model", "") or "")

        async def body() -> tuple[Any, Usage | None]:
            with genai_span("chat", system="openai", model=model_name) as span:
                completed = None
                async for event in self.wrapped.stream_response(*args, **kwargs):
                    if event.type == "response.output_text.delta":
                        await bridge.stream(event.delta)
                    elif event.type == "response.completed":
                        completed = event.response
                if completed is None:
                    raise RuntimeError("the model's stream ended without a response")
                raw = completed.usage
                usage = Usage(input_tokens=raw.input_tokens if raw else 0,
                              output_tokens=raw.output_tokens if raw else 0,
                              model=str(completed.model or model_name))
                set_usage(span, usage, str(completed.model or ""))
            return {"output": [item.model_dump(mode="json") for item in completed.output],
                    "input_tokens": usage.input_tokens,
                    "output_tokens": usage.output_tokens}, usage

        stored = await bridge.step(step_name(self.durable.prefix, "model"), body)
        tokens_in, tokens_out = int(stored["input_tokens"]), int(stored["output_tokens"])
        return ModelResponse(output=_OUTPUT.validate_python(stored["output"]),
                             usage=AgentsUsage(requests=1, input_tokens=tokens_in,
                                               output_tokens=tokens_out,
                                               total_tokens=tokens_in + tokens_out),
                             response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise UserError("DurableRunner runs with run() / run_sync(); the model's text "
                        "streams to ctx.stream (run_streamed is not durable)")


def _make_tools_durable(agent: Agent[Any], seen: set[int]) -> None:
    """Route the function tools of `agent` and of the agents it hands off to through steps
    while a `DurableRunner` runs them (as they were, outside one)."""
    if id(agent) in seen:
        return
    seen.add(id(agent))
    if isinstance(agent.model, Model):
        raise UserError(f"DurableRunner: agent {agent.name!r} has a Model instance; name its "
                        f"model and give the run a model_provider, so its calls are steps")
    for tool in agent.tools:
        if isinstance(tool, FunctionTool) and not getattr(tool, "_agentruns_durable", False):
            tool.on_invoke_tool = _durable_tool(tool.name, tool.on_invoke_tool)
            tool._agentruns_durable = True  # type: ignore[attr-defined]
    for handoff in agent.handoffs:
        if isinstance(handoff, Agent):
            _make_tools_durable(handoff, seen)


def _durable_tool(name: str, invoke: Any) -> Any:
    async def on_invoke_tool(tool_context: Any, arguments: str) -> Any:
        durable = _active.get()
        if durable is None:
            return await invoke(tool_context, arguments)
        call_id = str(getattr(tool_context, "tool_call_id", "") or "")

        async def body() -> tuple[Any, Usage | None]:
            with genai_span("execute_tool", system=_PREFIX, tool=name, call_id=call_id):
                return await invoke(tool_context, arguments), None

        step = step_name(durable.prefix, "tool", name, call_id)
        return await durable.bridge.step(step, body)
    return on_invoke_tool
