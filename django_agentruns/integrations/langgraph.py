"""Run a LangGraph graph durably inside an agent run: `AgentRunsSaver`, `run_graph`.

    from django_agentruns.integrations.langgraph import AgentRunsSaver, run_graph

    graph = builder.compile(checkpointer=AgentRunsSaver())

    @agent("support")
    def answer(ctx):
        return run_graph(graph, {"messages": [...]})

The graph checkpoints after every super-step into this project's tables, fenced by the
run's lease. An attempt that resumes the run (after a crash, a snooze, a wait) goes on
from the graph's last checkpoint instead of starting again: nodes that finished are not
run again. An `interrupt(value)` in a node becomes a wait: the run is `waiting`, holding no
worker, until `deliver(run_id, key, answer)` (or `approve` / `reject`, or the admin's
answer form); then the graph resumes with `Command(resume=answer)`. The key is
`value["key"]` when the interrupt's value is a dict with one, else the interrupt's id.
Text a node writes with LangGraph's stream writer (`get_stream_writer()("...")`, or
`{"text": "..."}`) and chat-model tokens (`messages` stream mode) reach `ctx.stream`.
"""

from __future__ import annotations

from ._bridge import require

require("langgraph", "langgraph")

from typing import Any  # noqa: E402 (after the check: a missing extra is named)

from langchain_core.runnables import RunnableConfig  # noqa: E402
from langgraph.types import Command, Interrupt, StateSnapshot  # noqa: E402

from ..exceptions import InvalidInputError  # noqa: E402
from ..runtime.context import RunContext, current_context  # noqa: E402
from ._graph_saver import AgentRunsSaver  # noqa: E402
from ._graph_telemetry import GenAICallbacks  # noqa: E402

__all__ = ["AgentRunsSaver", "arun_graph", "run_graph"]

RUN_KEY = "agentrun_id"
"""Checkpoint metadata naming the run that runs the graph on its thread: a later attempt
of that run resumes the thread; another run starts a new turn on it."""
STREAM_MODES = ["custom", "messages"]


def run_graph(graph: Any, input: Any, *, config: RunnableConfig | None = None) -> Any:
    """Run `graph` (compiled with a checkpointer) to its end in this agent run, and return
    its final state's values. `config["configurable"]["thread_id"]` defaults to one thread
    per run (`agentrun-<id>`)."""
    ctx = _context("run_graph")
    config = _configured(ctx, config)
    state = graph.get_state(config)
    while True:
        command = _next_command(ctx, state, input, ctx.receive)
        if command is _FINISHED:
            return state.values
        for mode, chunk in graph.stream(command, config, stream_mode=STREAM_MODES,
                                        durability="sync"):
            text = _text(mode, chunk)
            if text:
                ctx.stream(text)
        state = graph.get_state(config)


async def arun_graph(graph: Any, input: Any, *, config: RunnableConfig | None = None) -> Any:
    """`run_graph` for async agents (`graph.astream`)."""
    ctx = _context("arun_graph")
    config = _configured(ctx, config)
    state = await graph.aget_state(config)
    while True:
        command = _next_command(ctx, state, input, None)
        if command is _FINISHED:
            return state.values
        if isinstance(command, _Receive):
            answer = await ctx.areceive(command.key, prompt=command.prompt)
            command = Command(resume={command.interrupt_id: answer})
        async for mode, chunk in graph.astream(command, config, stream_mode=STREAM_MODES,
                                               durability="sync"):
            text = _text(mode, chunk)
            if text:
                await ctx.astream(text)
        state = await graph.aget_state(config)


class _Receive:
    """An interrupt to wait for (async: awaited by the caller)."""

    def __init__(self, interrupt: Interrupt) -> None:
        self.interrupt_id = interrupt.id
        value = interrupt.value
        key = value.get("key") if isinstance(value, dict) else None
        self.key = key if isinstance(key, str) and key else interrupt.id
        self.prompt = value


_FINISHED = object()


def _next_command(ctx: RunContext, state: StateSnapshot, input: Any, receive: Any) -> Any:
    """What to run the graph with next: the input (a graph this run has not started on
    its thread), None (go on from the checkpoint), a resume with the interrupt's answer
    (waiting for it first), or `_FINISHED`."""
    metadata = state.metadata or {}
    if metadata.get(RUN_KEY) != ctx.run_id:
        return input
    if state.interrupts:
        wait = _Receive(state.interrupts[0])
        if receive is None:
            return wait
        return Command(resume={wait.interrupt_id: receive(wait.key, prompt=wait.prompt)})
    if state.next:
        return None
    return _FINISHED


def _configured(ctx: RunContext, config: RunnableConfig | None) -> RunnableConfig:
    """The caller's config with a default thread (one per run) and this run's id in the
    metadata LangGraph copies into every checkpoint."""
    given: RunnableConfig = config or {}
    configurable = dict(given.get("configurable") or {})
    configurable.setdefault("thread_id", f"agentrun-{ctx.run_id}")
    metadata = dict(given.get("metadata") or {})
    metadata[RUN_KEY] = ctx.run_id
    callbacks = given.get("callbacks")
    if callbacks is None or isinstance(callbacks, list):  # a manager is the caller's own
        callbacks = [*(callbacks or []), GenAICallbacks()]
    return {**given, "configurable": configurable, "metadata": metadata,
            "callbacks": callbacks}


def _context(entry: str) -> RunContext:
    ctx = current_context()
    if ctx is None:
        raise InvalidInputError(f"{entry} runs inside an agent run (an @agent function a "
                                f"worker executes); none is running here")
    return ctx


def _text(mode: str, chunk: Any) -> str:
    if mode == "custom":
        if isinstance(chunk, str):
            return chunk
        if isinstance(chunk, dict) and isinstance(chunk.get("text"), str):
            return str(chunk["text"])
        return ""
    if mode == "messages" and isinstance(chunk, tuple) and chunk:
        content = getattr(chunk[0], "content", None)
        return content if isinstance(content, str) else ""
    return ""
