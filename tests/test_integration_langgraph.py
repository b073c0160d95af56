"""A LangGraph graph run durably (`run_graph`, `arun_graph`, `AgentRunsSaver`) by real
workers against the fake provider: a two-turn graph with a tool call, usage, streamed
text, an interrupt answered by `approve`, a crash after the first answer, a 429 and a bad
key; and the saver's checkpoints kept per thread, across runs."""

from __future__ import annotations

import importlib
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

pytest.importorskip("langgraph")

from django_agentruns import deliver, enqueue, transitions
from django_agentruns.history_models import GraphCheckpoint
from django_agentruns.models import Reason, RunEvent, Status, StreamChunk
from django_agentruns.runtime.worker import Worker
from django_agentruns.streaming import transport as chunk_transport
from tests import helpers
from tests.fakeprovider import FakeProvider, Fault
from tests.integration_support import (
    APPROVAL_TURNS,
    TWO_TURNS,
    LiveReader,
    env_for,
    finished,
    run,
    stored_text,
    tool_runs,
)
from tests.test_tracing import _exporter, spans  # noqa: F401 (fixtures)

FRAMEWORK = "langgraph"
"""Whose agents this module's worker subprocesses load (`env_for`)."""

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

AGENTS = ["tests.langgraph", "tests.langgraph_async"]




@pytest.mark.slow
def test_a_two_turn_graph_with_a_tool_call_completes_with_its_usage_and_a_429_snoozes(
        worker_env: dict[str, str], fake_provider: FakeProvider) -> None:
    runs: dict[str, int] = {}
    for name in AGENTS:
        fake_provider.script(TWO_TURNS, model=f"ok-{name}")
        fake_provider.script([Fault(429, retry_after=1), *TWO_TURNS], model=f"limited-{name}")
        fake_provider.script([Fault(401, message="Incorrect API key")], model=f"badkey-{name}")
        for case in ("ok", "limited", "badkey"):
            runs[f"{case}-{name}"] = enqueue(name, {"model": f"{case}-{name}"}).pk
    with helpers.start_manage(["runworker", "--concurrency", "6"],
                              env_for(worker_env, fake_provider, FRAMEWORK)) as worker:
        helpers.wait_until(lambda: all(finished(pk) for pk in runs.values()), timeout=90,
                           message="every run to finish")
        assert worker.returncode is None, worker.output()

    for name in AGENTS:
        ok = run(runs[f"ok-{name}"])
        assert ok.status == Status.SUCCEEDED, ok.error_message
        assert ok.output == {"output": "It is sunny in Paris.", "attempt": 1}
        assert fake_provider.count(f"ok-{name}") == 2
        assert tool_runs(ok.pk) == ["weather:Paris"]
        assert (ok.input_tokens, ok.output_tokens) == (31, 9)
        assert stored_text(ok.pk) == "It is sunny in Paris."
        # The graph checkpointed into the saver's table, on the run's own thread.
        rows = GraphCheckpoint.objects.filter(thread_id=f"agentrun-{ok.pk}")
        assert rows.count() >= 4
        assert {r.run_id for r in rows} == {ok.pk}

        limited = run(runs[f"limited-{name}"])
        assert limited.status == Status.SUCCEEDED, limited.error_message
        assert (limited.requeue_count, limited.snooze_count, limited.attempt) == (0, 1, 2)
        snoozed = RunEvent.objects.filter(run_id=limited.pk, type=transitions.SNOOZED).get()
        assert snoozed.payload["delay"] == 1.0
        assert fake_provider.count(f"limited-{name}") == 3

        badkey = run(runs[f"badkey-{name}"])
        assert (badkey.status, badkey.reason, badkey.attempt) == (
            Status.FAILED, Reason.NOT_RETRYABLE, 1)
        assert fake_provider.count(f"badkey-{name}") == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", AGENTS)
def test_an_interrupt_waits_streams_first_and_the_approval_resumes_the_graph_once(
        worker_env: dict[str, str], fake_provider: FakeProvider, name: str) -> None:
    fake_provider.script(APPROVAL_TURNS)
    pk = enqueue(name, {"model": "m", "prompt": "Refund me"}).pk
    live = LiveReader(pk)
    env = env_for(worker_env, fake_provider, FRAMEWORK)
    with helpers.start_manage(["runworker"], env) as worker:
        helpers.wait_until(lambda: run(pk).status == Status.WAITING, timeout=60,
                           message="the run to wait for the interrupt's answer")
        # The model's text before the interrupt was streamed live (the wait let the
        # sender deliver it first) and stored.
        helpers.wait_until(lambda: live.text == "Let me refund that.", timeout=60,
                           message="the streamed text through stream_chunks, before the wait")
        assert stored_text(pk) == "Let me refund that."
        assert tool_runs(pk) == []
        # The key is the one the interrupt's value names.
        assert run(pk).wait_key == "refund-call_0"
        # An input wait: answered with deliver (approve is for approval waits).
        deliver(pk, "refund-call_0", {"approved": True}, by="tester")
        helpers.wait_until(lambda: finished(pk), timeout=60, message="the run to finish")
        assert worker.returncode is None, worker.output()
    live.join()
    # Every live chunk, both answers': the one before the wait, then the resumed graph's.
    assert live.text == "Let me refund that.Refunded 5.", live.chunks
    done = run(pk)
    assert done.status == Status.SUCCEEDED, done.error_message
    assert done.output["output"] == "Refunded 5."
    assert tool_runs(pk) == ["refund:5"]
    assert fake_provider.count() == 2  # the model node before the interrupt was not run again
    assert (done.input_tokens, done.output_tokens) == (24, 7)


@pytest.mark.slow
@pytest.mark.parametrize("name", AGENTS)
def test_a_worker_killed_after_the_first_answer_resumes_the_graph_from_its_checkpoint(
        worker_env: dict[str, str], fake_provider: FakeProvider, name: str,
        tmp_path: Path) -> None:
    fake_provider.script(TWO_TURNS)
    gate = tmp_path / "gate"
    pk = enqueue(name, {"model": "m", "block_file": str(gate)}).pk
    env = env_for(worker_env, fake_provider, FRAMEWORK)
    with helpers.start_manage(["runworker"], env) as first:
        helpers.wait_until(lambda: tool_runs(pk) == ["weather:Paris"], timeout=60,
                           message="the tool node to start, after the first answer")
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert fake_provider.count() == 1
    gate.touch()
    with helpers.start_manage(["runworker"], env) as second:
        helpers.wait_until(lambda: finished(pk), timeout=60, message="the resumed run")
        assert second.returncode is None, second.output()
    done = run(pk)
    assert done.status == Status.SUCCEEDED, done.error_message
    assert done.output == {"output": "It is sunny in Paris.", "attempt": 2}
    assert fake_provider.count() == 2  # the first answer came from the checkpoint
    assert tool_runs(pk) == ["weather:Paris", "weather:Paris"]  # the node that was running
    assert (done.input_tokens, done.output_tokens) == (31, 9)


def test_the_saver_keeps_a_threads_checkpoints_and_forgets_them_when_deleted(
        transactional_db: None) -> None:
    from langgraph.graph import END, START, StateGraph

    from django_agentruns.integrations.langgraph import AgentRunsSaver

    builder = StateGraph(int)  # type: ignore[type-var]
    builder.add_node("add_one", lambda x: x + 1)
    builder.add_edge(START, "add_one")
    builder.add_edge("add_one", END)
    saver = AgentRunsSaver()
    graph = builder.compile(checkpointer=saver)
    config = {"configurable": {"thread_id": "t-1"}}
    assert graph.invoke(1, config) == 2
    assert graph.invoke(5, config) == 6  # the same thread, a second turn
    history = list(graph.get_state_history(config))
    assert len(history) == GraphCheckpoint.objects.filter(thread_id="t-1").count() >= 4
    assert graph.get_state(config).values == 6
    assert [c.config["configurable"]["checkpoint_id"] for c in saver.list(config, limit=2)] == \
        [c.config["configurable"]["checkpoint_id"] for c in history[:2]]
    saver.delete_thread("t-1")
    assert not GraphCheckpoint.objects.filter(thread_id="t-1").exists()
    assert graph.get_state(config).values is None or graph.get_state(config).values == {}


def test_without_the_extra_the_import_error_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "langgraph" else real(name, *a))
    monkeypatch.delitem(sys.modules, "django_agentruns.integrations.langgraph", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'django-agentruns\[langgraph\]'"):
        importlib.import_module("django_agentruns.integrations.langgraph")


def test_chat_model_and_tool_calls_are_genai_spans_and_the_usage_is_recorded(
        spans: InMemorySpanExporter, transactional_db: None,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunk_transport, "PRUNE_DELAY", 0.0)
    pk = enqueue("tests.langgraph_traced").pk
    Worker(burst=True, reap_interval=0).run(install_signals=False)
    # The chat model's tokens reached the live output (`messages` stream mode) and were
    # stored; SQLite: their rows go while the test's database is still there.
    assert stored_text(pk) == "It is sunny."
    helpers.wait_until(lambda: not StreamChunk.objects.filter(run_id=pk).exists(),
                       message="the chunk rows pruned")
    done = run(pk)
    assert done.status == Status.SUCCEEDED, done.error_message
    assert done.output == {"output": "It is sunny."}
    assert (done.input_tokens, done.output_tokens) == (7, 2)
    finished_spans = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished_spans if s.context is not None}
    (chat,) = [s for s in finished_spans if s.name.startswith("chat ")]
    (tool,) = [s for s in finished_spans if s.name == "execute_tool forecast"]
    assert ((chat.attributes or {})["gen_ai.usage.input_tokens"],
            (chat.attributes or {})["gen_ai.usage.output_tokens"]) == (7, 2)
    assert (chat.attributes or {})["gen_ai.operation.name"] == "chat"
    assert "gen_ai.request.model" in (chat.attributes or {})
    assert (tool.attributes or {})["gen_ai.tool.name"] == "forecast"
    for span in (chat, tool):
        ancestor = span
        while ancestor.parent is not None and ancestor.parent.span_id in by_id:
            ancestor = by_id[ancestor.parent.span_id]
        assert (ancestor.attributes or {}).get("messaging.message.id") == str(pk)
