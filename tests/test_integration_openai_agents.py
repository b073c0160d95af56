"""An OpenAI Agents SDK agent run durably (`DurableRunner`) by real workers against the fake
provider: a two-turn conversation with a tool call, usage, streamed text, an approval, a crash after
the first answer, a 429 and a bad key. Each behaviour for a sync agent (`run_sync`) and an
async one (`await run`)."""

from __future__ import annotations

import importlib
import itertools
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

pytest.importorskip("agents")

from django_agentruns import approve, enqueue, transitions
from django_agentruns.models import Reason, RunEvent, RunStep, Status, StreamChunk
from django_agentruns.runtime.worker import Worker
from django_agentruns.streaming import transport as chunk_transport
from tests import fakeprovider, helpers
from tests.fakeprovider import ENV_VAR, FakeProvider, Fault, Reply, ToolCall
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

FRAMEWORK = "openai_agents"
"""Whose agents this module's worker subprocesses load (`env_for`)."""

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

AGENTS = ["tests.openai_agents", "tests.openai_agents_async"]




@pytest.mark.slow
def test_a_two_turn_agent_with_a_tool_call_completes_with_its_usage_and_a_429_snoozes(
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
        # Usage is what the provider reported for each of the two responses.
        assert (ok.input_tokens, ok.output_tokens) == (31, 9)
        assert stored_text(ok.pk) == "It is sunny in Paris."
        steps = RunStep.objects.filter(run_id=ok.pk).order_by("id")
        assert [(s.name.rsplit(".", 1)[-1] if ".model" in s.name else "tool", s.status)
                for s in steps] == [("model", "done"), ("tool", "done"), ("model", "done")]

        # A 429 with Retry-After (openai.RateLimitError, raised through the SDK) snoozes.
        limited = run(runs[f"limited-{name}"])
        assert limited.status == Status.SUCCEEDED, limited.error_message
        assert (limited.requeue_count, limited.snooze_count, limited.attempt) == (0, 1, 2)
        snoozed = RunEvent.objects.filter(run_id=limited.pk, type=transitions.SNOOZED).get()
        assert snoozed.payload["delay"] == 1.0
        assert fake_provider.count(f"limited-{name}") == 3
        assert (limited.input_tokens, limited.output_tokens) == (31, 9)

        # A 401 dead-letters at once.
        badkey = run(runs[f"badkey-{name}"])
        assert (badkey.status, badkey.reason, badkey.attempt) == (
            Status.FAILED, Reason.NOT_RETRYABLE, 1)
        assert fake_provider.count(f"badkey-{name}") == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", AGENTS)
def test_a_tool_that_needs_approval_waits_streams_first_and_runs_once_approved(
        worker_env: dict[str, str], fake_provider: FakeProvider, name: str) -> None:
    fake_provider.script(APPROVAL_TURNS)
    pk = enqueue(name, {"model": "m", "prompt": "Refund me"}).pk
    live = LiveReader(pk)
    env = env_for(worker_env, fake_provider, FRAMEWORK)
    with helpers.start_manage(["runworker"], env) as worker:
        helpers.wait_until(lambda: run(pk).status == Status.WAITING, timeout=60,
                           message="the run to wait for the approval")
        # The model's text was streamed live and stored, the tool not run.
        helpers.wait_until(lambda: live.text == "Let me refund that.", timeout=60,
                           message="the streamed text through stream_chunks, before the end")
        assert stored_text(pk) == "Let me refund that."
        assert tool_runs(pk) == []
        waiting = run(pk)
        assert "refund" in waiting.wait_key
        approve(pk, waiting.wait_key, by="tester")
        helpers.wait_until(lambda: finished(pk), timeout=60, message="the run to finish")
        assert worker.returncode is None, worker.output()
    live.join()
    done = run(pk)
    assert done.status == Status.SUCCEEDED, done.error_message
    assert done.output["output"] == "Refunded 5."
    assert tool_runs(pk) == ["refund:5"]  # once, after the approval
    assert fake_provider.count() == 2  # the first answer was replayed, not asked again
    assert (done.input_tokens, done.output_tokens) == (24, 7)


@pytest.mark.slow
@pytest.mark.parametrize("name", AGENTS)
def test_a_worker_killed_after_the_first_answer_resumes_without_asking_again(
        worker_env: dict[str, str], fake_provider: FakeProvider, name: str,
        tmp_path: Path) -> None:
    fake_provider.script(TWO_TURNS)
    gate = tmp_path / "gate"
    pk = enqueue(name, {"model": "m", "block_file": str(gate)}).pk
    env = env_for(worker_env, fake_provider, FRAMEWORK)
    with helpers.start_manage(["runworker"], env) as first:
        helpers.wait_until(lambda: tool_runs(pk) == ["weather:Paris"], timeout=60,
                           message="the tool to start, after the first answer")
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
    # The first model request was answered from its record: two requests in all.
    assert fake_provider.count() == 2
    # The tool was running when the worker died: it ran again (a step not finished is run).
    assert tool_runs(pk) == ["weather:Paris", "weather:Paris"]
    assert (done.input_tokens, done.output_tokens) == (31, 9)


@pytest.mark.slow
def test_a_handoff_happens_in_the_same_run_and_a_crash_after_it_does_not_repeat_it(
        worker_env: dict[str, str], fake_provider: FakeProvider, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDK refuses a call id used twice in a conversation (the fake numbers each
    # reply's calls from call_0): number them across the test instead.
    numbers = itertools.count()
    each_reply = fakeprovider._tool_calls
    monkeypatch.setattr(fakeprovider, "_tool_calls", lambda reply: [
        {**call, "id": f"call_{next(numbers)}"} for call in each_reply(reply)])
    fake_provider.script([Reply(tool_calls=[ToolCall("transfer_to_support", {})],
                                usage=(5, 1))], model="triage")
    fake_provider.script(TWO_TURNS, model="m")
    gate = tmp_path / "gate"
    pk = enqueue("tests.openai_agents_handoff", {"model": "m", "block_file": str(gate)}).pk
    env = env_for(worker_env, fake_provider, FRAMEWORK)
    with helpers.start_manage(["runworker"], env) as first:
        helpers.wait_until(lambda: tool_runs(pk) == ["weather:Paris"], timeout=60,
                           message="the support agent's tool to start, after the handoff")
        first.send_signal(signal.SIGKILL)
        first.wait()
    gate.touch()
    with helpers.start_manage(["runworker"], env) as second:
        helpers.wait_until(lambda: finished(pk), timeout=60, message="the resumed run")
        assert second.returncode is None, second.output()
    done = run(pk)
    assert done.status == Status.SUCCEEDED, done.error_message
    assert done.output == {"output": "It is sunny in Paris.", "agent": "support", "attempt": 2}
    # The triage answer and the support agent's first answer came from their records.
    assert (fake_provider.count("triage"), fake_provider.count("m")) == (1, 2)
    assert (done.input_tokens, done.output_tokens) == (36, 10)


@pytest.mark.parametrize("name", AGENTS)
def test_each_model_and_tool_call_is_a_genai_span_under_its_step_and_the_attempt(
        spans: InMemorySpanExporter, transactional_db: None,  # noqa: F811
        fake_provider: FakeProvider, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(ENV_VAR, fake_provider.url)
    monkeypatch.setattr(chunk_transport, "PRUNE_DELAY", 0.0)
    fake_provider.script(TWO_TURNS)
    pk = enqueue(name, {"model": "m"}).pk
    Worker(burst=True, reap_interval=0).run(install_signals=False)
    # SQLite: the live chunks' rows go while the test's database is still there.
    helpers.wait_until(lambda: not StreamChunk.objects.filter(run_id=pk).exists(),
                       message="the chunk rows pruned")
    assert run(pk).status == Status.SUCCEEDED, run(pk).error_message
    finished_spans = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished_spans if s.context is not None}

    def parent(span: ReadableSpan) -> ReadableSpan:
        assert span.parent is not None
        return by_id[span.parent.span_id]

    chats = [s for s in finished_spans if s.name == "chat m"]
    assert [((s.attributes or {})["gen_ai.usage.input_tokens"],
             (s.attributes or {})["gen_ai.usage.output_tokens"]) for s in chats] == \
        [(11, 3), (20, 6)]
    (tool,) = [s for s in finished_spans if s.name == "execute_tool weather"]
    assert (tool.attributes or {})["gen_ai.tool.name"] == "weather"
    for span in [*chats, tool]:
        step = parent(span)
        assert step.name.startswith("step openai-agents.1.")
        attempt = parent(step)
        assert (attempt.attributes or {})["messaging.message.id"] == str(pk)
    assert (chats[0].attributes or {})["gen_ai.request.model"] == "m"
    assert (chats[0].attributes or {})["gen_ai.operation.name"] == "chat"


def test_without_the_extra_the_import_error_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "agents" else real(name, *a))
    monkeypatch.delitem(sys.modules, "django_agentruns.integrations.openai_agents",
                        raising=False)
    with pytest.raises(ImportError, match=r"pip install 'django-agentruns\[openai-agents\]'"):
        importlib.import_module("django_agentruns.integrations.openai_agents")


def test_outside_an_agent_run_it_says_where_it_runs() -> None:
    from agents import Agent

    from django_agentruns.exceptions import InvalidInputError
    from django_agentruns.integrations.openai_agents import DurableRunner

    with pytest.raises(InvalidInputError, match="runs inside an agent run"):
        DurableRunner.run_sync(Agent(name="a"), "hi")
