"""Demo agents: the shape of real agent work, without the network.

Model and tool calls are simulated with short sleeps. Each agent emits an event per step
and checkpoints between steps, so a retry resumes where the last attempt left off instead
of paying for the same calls again.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from typing import Any

from django_agentruns import Retryable, RunContext, agent

# A tiny "search index" standing in for a web search tool.
_CORPUS = {
    "leases": "A lease gives one worker the right to run a job until it expires.",
    "fencing": "A fencing token lets storage reject writes from a worker that lost its lease.",
    "retries": "Bounded retries with backoff stop a poisoned job from looping forever.",
    "dead letters": "A dead letter keeps a job that cannot succeed, for an operator to inspect.",
    "ordering": "Ordered scopes run one job at a time per key, in the order they were fired.",
}


def _call_model(prompt: str) -> str:
    time.sleep(0.1)  # stands in for an LLM call
    return prompt


def _search(query: str) -> list[dict[str, str]]:
    time.sleep(0.05)  # stands in for a search API call
    words = set(query.lower().split())
    return [
        {"title": title, "snippet": text}
        for title, text in _CORPUS.items()
        if words & set(title.split()) or words & set(text.lower().split())
    ][:2]


@agent("demo.research", queue="default", max_requeues=3, timeout=60)
def research(ctx: RunContext) -> dict[str, Any]:
    """Plan a few queries, run the search tool for each, summarise what came back."""
    topic = str(ctx.input.get("topic", "durable execution"))
    state: dict[str, Any] = dict(ctx.state or {})

    if "plan" not in state:
        _call_model(f"Plan research on {topic}")
        state["plan"] = [f"{topic} leases", f"{topic} retries", f"{topic} dead letters"]
        ctx.emit("plan", {"topic": topic, "queries": state["plan"]})
        ctx.checkpoint(state)

    if "sources" not in state:
        sources: list[dict[str, str]] = []
        for query in state["plan"]:
            hits = _search(query)
            ctx.emit("tool_call", {"tool": "search", "query": query, "hits": len(hits)})
            sources.extend(hit for hit in hits if hit not in sources)
        state["sources"] = sources
        ctx.checkpoint(state)

    _call_model(f"Summarise {len(state['sources'])} sources on {topic}")
    summary = " ".join(source["snippet"] for source in state["sources"])
    ctx.emit("summary", {"sources": len(state["sources"]), "words": len(summary.split())})
    return {"topic": topic, "summary": summary, "sources": [s["title"] for s in state["sources"]]}


@agent("demo.flaky_tool", queue="default", max_requeues=3, timeout=30)
def flaky_tool(ctx: RunContext) -> dict[str, Any]:
    """Call a tool whose first call always fails transiently, as rate-limited APIs do."""
    city = str(ctx.input.get("city", "Lisbon"))
    # Same position since the last checkpoint on every attempt, so the retry's re-emit of
    # this event has the same id and adds nothing to the timeline.
    ctx.emit("tool_call", {"tool": "weather", "city": city})
    time.sleep(0.05)
    if ctx.attempt == 1:
        raise Retryable("weather API answered 503 Service Unavailable (simulated)")
    forecast = {"city": city, "forecast": "sunny", "high_c": 24}
    ctx.emit("tool_result", {"tool": "weather", **forecast})
    return forecast


@agent("demo.async_summarise", queue="default", max_requeues=3, timeout=60)
async def async_summarise(ctx: RunContext) -> dict[str, Any]:
    """Outline a text, then write the summary from the outline: two awaited model calls."""
    text = str(ctx.input.get("text", ""))
    state: dict[str, Any] = dict(ctx.state or {})

    if "outline" not in state:
        await asyncio.sleep(0.1)  # stands in for an async LLM call
        state["outline"] = [sentence.strip() for sentence in text.split(".") if sentence.strip()]
        await ctx.aemit("outline", {"points": len(state["outline"])})
        await ctx.acheckpoint(state)

    await asyncio.sleep(0.1)
    summary = "; ".join(point.split(",")[0] for point in state["outline"])
    await ctx.aemit("summary", {"chars": len(summary)})
    return {"summary": summary, "points": len(state["outline"])}


@agent("demo.refund", queue="default", max_requeues=3)
def refund(ctx: RunContext) -> dict[str, Any]:
    """Propose a refund and wait for an operator to approve it in the admin.

    While it waits the run is `waiting`: no worker slot, no lease, nothing to reap. The
    approval may change the amount; a rejection ends the run without refunding.
    """
    state: dict[str, Any] = dict(ctx.state or {})
    if "proposal" not in state:
        _call_model(f"should order {ctx.input.get('order')} be refunded?")
        state["proposal"] = {"order": ctx.input.get("order"),
                             "amount": ctx.input.get("amount", 0), "reason": "late delivery"}
        ctx.emit("proposed", state["proposal"])
        ctx.checkpoint(state)  # the next attempt resumes here, and asks again: same key
    answer = ctx.request_approval("refund", state["proposal"], timeout=7 * 24 * 3600)
    if not answer.approved:
        return {"refunded": 0, "rejected_by": answer.by, "note": answer.note}
    time.sleep(0.05)  # stands in for the payment provider's refund call
    return {"refunded": answer.proposal["amount"], "approved_by": answer.by}


@agent("demo.digest", every=300)
def digest(ctx: RunContext) -> dict[str, Any]:
    """A scheduled agent: every five minutes (ticks aligned to the epoch), one run however
    many workers serve its queue; the tick's time is in its input (`manage.py schedules`)."""
    from django_agentruns.models import AgentRun, Status

    finished = AgentRun.objects.filter(status=Status.SUCCEEDED).exclude(agent=ctx.agent)
    _call_model(f"Summarise the last {finished.count()} runs")
    return {"tick": ctx.input["tick"], "runs_done": finished.count()}


_REPLY = (
    "A run is claimed with a lease, so one worker owns it at a time. Its steps are stored "
    "as events, and its checkpoints let a retry resume where the last attempt stopped. "
    "This reply is streamed word by word: each word reaches the page at once, and the "
    "whole text is stored once, when the step ends."
)


@agent("demo.chat_reply", queue="default", max_requeues=3, timeout=60)
async def chat_reply(ctx: RunContext) -> dict[str, Any]:
    """Stream a reply token by token, as an LLM client library hands it over."""
    question = str(ctx.input.get("question", "How does a run survive a crash?"))
    await ctx.aemit("question", {"text": question})
    for word in _REPLY.split(" "):
        await asyncio.sleep(0.05)  # stands in for the model producing the next token
        await ctx.astream(word + " ")
    return {"question": question, "words": len(_REPLY.split(" "))}


class _RateLimited(Exception):
    """What an OpenAI-style client raises for a 429: a status and a Retry-After header."""

    status_code = 429

    def __init__(self, retry_after: str) -> None:
        super().__init__("429 Too Many Requests")
        self.response = type("Response", (), {"headers": {"retry-after": retry_after}})()


@agent("demo.llm_chain", limit_key="demo-llm", budget={"tokens": 2500})
def llm_chain(ctx: RunContext) -> dict[str, Any]:
    """Model calls under a limit key (at most 2 at once, set by the demo) and a budget of
    2,500 tokens, 1,000 per call. The first attempt of the first run meets a 429 with
    Retry-After: snoozed (no budget spent) and the key closed for every worker meanwhile.
    A run of 4 steps passes its budget at its third call and is dead-lettered."""
    if ctx.attempt == 1 and ctx.input.get("rate_limited"):
        raise _RateLimited("0.5")
    state = ctx.state or {"step": 0}
    for step in range(state["step"], int(ctx.input["steps"])):
        _call_model(f"step {step}")
        ctx.record_usage(input_tokens=800, output_tokens=200, cost=0.002, model="demo-model")
        ctx.checkpoint({"step": step + 1})
    return {"steps": ctx.input["steps"]}


@agent("demo.step_research", queue="default", max_requeues=3, timeout=60)
def step_research(ctx: RunContext) -> dict[str, Any]:
    """`demo.research` with durable steps instead of hand-written checkpoints: each model
    and tool call is a step, so a retry (or a crash) gets the finished ones from their
    records and pays only for the rest (docs/steps.md)."""
    topic = str(ctx.input.get("topic", "durable execution"))
    ctx.step("plan", _call_model, f"Plan research on {topic}")
    queries = [f"{topic} leases", f"{topic} retries", f"{topic} dead letters"]
    sources: list[dict[str, str]] = []
    for query in queries:
        hits = ctx.step("search", _search, query, retries=2)
        sources.extend(hit for hit in hits if hit not in sources)
    ctx.step("summarise", _call_model, f"Summarise {len(sources)} sources on {topic}")
    summary = " ".join(source["snippet"] for source in sources)
    return {"topic": topic, "summary": summary, "sources": [s["title"] for s in sources]}


# The chat page's Pydantic AI agent (demo.assistant), where the `example` extra installed it.
if importlib.util.find_spec("pydantic_ai") is not None:
    from . import assistant  # noqa: F401
