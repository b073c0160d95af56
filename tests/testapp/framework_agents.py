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
import threading
import time
from pathlib import Path
from typing import Any

from django.db import connection

from django_agentruns import RunContext, agent
from django_agentruns.runtime.context import current_context

from .models import SideEffect

FRAMEWORKS_ENV = "AGENTRUNS_TEST_FRAMEWORKS"
"""Set in a worker subprocess's environment to load agent frameworks' agents: the
frameworks' names, comma-separated (`pydantic_ai`, `langgraph`, `openai_agents`), or `all`."""


def tool_ran(note: str) -> None:
    ctx = current_context()
    assert ctx is not None
    SideEffect.objects.create(run_id=ctx.run_id, step=0, attempt=ctx.attempt,
                              worker=str(os.getpid()), note=note)
    if threading.current_thread() is not threading.main_thread():
        connection.close()  # a framework's tool thread (a pool's): no session left behind
    block = ctx.input.get("block_file")
    if block:
        deadline = time.monotonic() + 120
        while not Path(block).exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def _wanted(framework: str, module: str) -> bool:
    """Installed, and asked for: the test process loads every framework; a worker
    subprocess only those its test names in FRAMEWORKS_ENV (each takes about 2 s of CPU
    to import; the integration tests name one)."""
    if importlib.util.find_spec(module) is None:
        return False
    if not os.environ.get("AGENTRUNS_TEST_SUBPROCESS"):
        return True
    asked = os.environ.get(FRAMEWORKS_ENV, "")
    return asked == "all" or framework in asked.split(",")


if _wanted("pydantic_ai", "pydantic_ai"):
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


if _wanted("langgraph", "langgraph"):
    import json
    import operator
    from typing import Annotated, TypedDict

    import openai
    from langgraph.config import get_stream_writer
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import interrupt

    from django_agentruns.integrations.langgraph import AgentRunsSaver, arun_graph, run_graph

    TOOLS = [{"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {arg: {"type": kind}},
                       "required": [arg]}}}
        for name, description, arg, kind in (("weather", "The weather in a city.", "city",
                                              "string"),
                                             ("refund", "Refund an amount.", "amount",
                                              "integer"))]

    class Conversation(TypedDict):
        messages: Annotated[list[dict[str, Any]], operator.add]

    def call_model(state: Conversation) -> dict[str, Any]:
        """The model, streamed: its text to the stream writer, its usage recorded."""
        ctx = current_context()
        assert ctx is not None
        client = openai.OpenAI(base_url=os.environ["FAKE_PROVIDER_URL"], api_key="sk-test",
                               max_retries=0)
        stream = client.chat.completions.create(
            model=ctx.input["model"], messages=state["messages"],  # type: ignore[arg-type]
            tools=TOOLS, stream=True, stream_options={"include_usage": True})  # type: ignore[arg-type]
        write = get_stream_writer()
        text, calls, usage = "", {}, None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                if choice.delta.content:
                    text += choice.delta.content
                    write(choice.delta.content)
                for call in choice.delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    entry["id"] += call.id or ""
                    entry["name"] += (call.function and call.function.name) or ""
                    entry["arguments"] += (call.function and call.function.arguments) or ""
        if usage is not None:
            ctx.record_usage(input_tokens=usage.prompt_tokens,
                             output_tokens=usage.completion_tokens, model=ctx.input["model"])
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls.values()]
        return {"messages": [message]}

    def call_tools(state: Conversation) -> dict[str, Any]:
        """The tools the model asked for; a refund is a person's decision (an interrupt)."""
        results = []
        for call in state["messages"][-1]["tool_calls"]:
            name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
            if name == "refund":
                answer = interrupt({"key": f"refund-{call['id']}", "tool": name, "args": args})
                if answer.get("approved"):
                    tool_ran(f"refund:{args['amount']}")
                    result = f"refunded {args['amount']}"
                else:
                    result = "refused"
            else:
                tool_ran(f"weather:{args['city']}")
                result = f"sunny in {args['city']}"
            results.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return {"messages": results}

    def route(state: Conversation) -> str:
        return "tools" if state["messages"][-1].get("tool_calls") else END

    builder = StateGraph(Conversation)
    builder.add_node("model", call_model)
    builder.add_node("tools", call_tools)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", route, ["tools", END])
    builder.add_edge("tools", "model")
    support_graph = builder.compile(checkpointer=AgentRunsSaver())

    def graph_input(ctx: RunContext) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": ctx.input.get("prompt", "Hi")}]}

    @agent("tests.langgraph", max_requeues=2)
    def langgraph_sync(ctx: RunContext) -> dict[str, Any]:
        values = run_graph(support_graph, graph_input(ctx))
        return {"output": values["messages"][-1]["content"], "attempt": ctx.attempt}

    @agent("tests.langgraph_async", max_requeues=2)
    async def langgraph_async(ctx: RunContext) -> dict[str, Any]:
        values = await arun_graph(support_graph, graph_input(ctx))
        return {"output": values["messages"][-1]["content"], "attempt": ctx.attempt}

    @agent("tests.langgraph_traced")
    def langgraph_traced(ctx: RunContext) -> dict[str, Any]:
        """A LangChain chat model and tool in a node: spans and usage come from callbacks."""
        from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
        from langchain_core.messages import AIMessage, AIMessageChunk
        from langchain_core.outputs import ChatGenerationChunk
        from langchain_core.tools import tool

        class StreamingUsageModel(GenericFakeChatModel):
            """Streams its answer as one chunk with its usage, as ChatOpenAI does with
            stream_usage (the generic fake drops the usage when streaming)."""

            def _stream(self, messages: Any, stop: Any = None, run_manager: Any = None,
                        **kwargs: Any) -> Any:
                answer = self._generate(messages, stop=stop, **kwargs).generations[0].message
                chunk = ChatGenerationChunk(message=AIMessageChunk(
                    content=answer.content, usage_metadata=answer.usage_metadata))
                if run_manager is not None:
                    run_manager.on_llm_new_token(str(answer.content), chunk=chunk)
                yield chunk

        model = StreamingUsageModel(messages=iter([AIMessage(
            "It is sunny.", usage_metadata={"input_tokens": 7, "output_tokens": 2,
                                            "total_tokens": 9})]))

        @tool
        def forecast(city: str) -> str:
            """The weather in a city."""
            return f"sunny in {city}"

        def node(state: Conversation) -> dict[str, Any]:
            found = forecast.invoke({"city": "Paris"})
            reply = model.invoke(f"Say: {found}")
            return {"messages": [{"role": "assistant", "content": reply.content}]}

        traced = StateGraph(Conversation)
        traced.add_node("node", node)
        traced.add_edge(START, "node")
        traced.add_edge("node", END)
        values = run_graph(traced.compile(checkpointer=AgentRunsSaver()), graph_input(ctx))
        return {"output": values["messages"][-1]["content"]}

    def _counter_graph() -> Any:
        counting = StateGraph(int)  # type: ignore[type-var]
        counting.add_node("add", lambda n: n + 1)
        counting.add_edge(START, "add")
        counting.add_edge("add", END)
        return counting.compile(checkpointer=AgentRunsSaver())

    @agent("tests.langgraph_thread")
    def langgraph_thread(ctx: RunContext) -> Any:
        """A graph with no model, on the thread input["thread"] names (else the run's own)."""
        thread = ctx.input.get("thread")
        config = {"configurable": {"thread_id": thread}} if thread else None
        return run_graph(_counter_graph(), ctx.input.get("n", 1), config=config)


if _wanted("openai_agents", "agents"):
    from agents import Agent as SdkAgent
    from agents import RunConfig, function_tool
    from agents.models.openai_provider import OpenAIProvider as SdkProvider
    from openai import AsyncOpenAI

    from django_agentruns.integrations.openai_agents import DurableRunner

    @function_tool
    def sdk_weather(city: str) -> str:
        """The weather in a city."""
        tool_ran(f"weather:{city}")
        return f"sunny in {city}"

    @function_tool(needs_approval=True)
    def sdk_refund(amount: int) -> str:
        """Refund an amount; a person approves it first."""
        tool_ran(f"refund:{amount}")
        return f"refunded {amount}"

    sdk_weather.name, sdk_refund.name = "weather", "refund"

    def sdk_agent_and_config(model: str) -> tuple[SdkAgent[Any], RunConfig]:
        client = AsyncOpenAI(base_url=os.environ["FAKE_PROVIDER_URL"], api_key="sk-test",
                             max_retries=0)
        support = SdkAgent(name="support", instructions="Answer with the tools.", model=model,
                           tools=[sdk_weather, sdk_refund])
        config = RunConfig(model_provider=SdkProvider(openai_client=client, use_responses=False),
                           tracing_disabled=True)
        return support, config

    @agent("tests.openai_agents", max_requeues=2)
    def openai_agents_sync(ctx: RunContext) -> dict[str, Any]:
        support, config = sdk_agent_and_config(ctx.input["model"])
        result = DurableRunner.run_sync(support, ctx.input.get("prompt", "Hi"),
                                        run_config=config)
        return {"output": result.final_output, "attempt": ctx.attempt}

    @agent("tests.openai_agents_async", max_requeues=2)
    async def openai_agents_async(ctx: RunContext) -> dict[str, Any]:
        support, config = sdk_agent_and_config(ctx.input["model"])
        result = await DurableRunner.run(support, ctx.input.get("prompt", "Hi"),
                                         run_config=config)
        return {"output": result.final_output, "attempt": ctx.attempt}

    @agent("tests.openai_agents_handoff", max_requeues=2)
    def openai_agents_handoff(ctx: RunContext) -> dict[str, Any]:
        """A triage agent (model "triage") that hands off to the support agent."""
        support, config = sdk_agent_and_config(ctx.input["model"])
        triage = SdkAgent(name="triage", instructions="Hand off.", model="triage",
                          handoffs=[support])
        result = DurableRunner.run_sync(triage, "Weather?", run_config=config)
        return {"output": result.final_output, "agent": result.last_agent.name,
                "attempt": ctx.attempt}
