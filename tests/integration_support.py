"""What the agent-framework integration tests share (tests/test_integration_*.py and the
browser test of a framework agent's approval): the worker subprocess's environment, the
two-turn script, a live reader of a run's chunks, and the reads every test makes.

The fake provider itself is the `fake_provider` fixture (tests/conftest.py); a worker
subprocess loads the framework agents (tests/testapp/framework_agents.py) only with
FRAMEWORKS_ENV naming their framework, which `env_for` sets.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

from django.db import connection

from django_agentruns import stream_chunks
from django_agentruns.models import AgentRun, RunEvent, Status
from tests.fakeprovider import FakeProvider, Reply, ToolCall
from tests.testapp.framework_agents import FRAMEWORKS_ENV
from tests.testapp.models import SideEffect

SETTINGS = {"BACKOFF_BASE": 0.0, "BACKOFF_CAP": 0.0, "POLL_INTERVAL": 0.05, "LEASE_TTL": 3,
            "REAP_INTERVAL": 0.5}
"""The worker subprocess's settings: no backoff, quick polls, a short lease and reap."""

TWO_TURNS = [Reply(tool_calls=[ToolCall("weather", {"city": "Paris"})], usage=(11, 3)),
             Reply("It is sunny in Paris.", usage=(20, 6), chunks=3)]
"""A tool call, then the answer: the conversation every framework's agent has."""

APPROVAL_TURNS = [Reply("Let me refund that.", tool_calls=[ToolCall("refund", {"amount": 5})],
                        usage=(9, 4)),
                  Reply("Refunded 5.", usage=(15, 3))]
"""Text and a call of the tool that needs approval, then the answer once it ran."""


def env_for(worker_env: dict[str, str], provider: FakeProvider,
            framework: str) -> dict[str, str]:
    """A worker subprocess's environment: this test's database, the fake provider's URL,
    SETTINGS, and the agents of `framework` loaded (`pydantic_ai`, `langgraph` or
    `openai_agents`: only its own, as each takes a worker about 2 s of CPU to import)."""
    return {**worker_env, **provider.env(), "AGENTRUNS_TEST_SETTINGS": json.dumps(SETTINGS),
            FRAMEWORKS_ENV: framework}


def run(run_id: int) -> AgentRun:
    return AgentRun.objects.get(pk=run_id)


def finished(run_id: int) -> bool:
    return run(run_id).status in (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)


def stored_text(run_id: int) -> str:
    """The run's streamed text as its stored `stream` events hold it."""
    return "".join(p["text"] for p in RunEvent.objects.filter(
        run_id=run_id, type="stream").order_by("seq").values_list("payload", flat=True))


def tool_runs(run_id: int) -> list[str]:
    """Each execution of a framework agent's tool, in order (tests/testapp/framework_agents)."""
    return list(SideEffect.objects.filter(run_id=run_id).values_list("note", flat=True))


@dataclass
class LiveReader:
    """`stream_chunks(run_id)` read to its end on a thread of its own: the live text."""

    run_id: int
    chunks: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            self.chunks.extend(chunk["text"] for chunk in stream_chunks(self.run_id))
        finally:
            connection.close()

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def join(self, timeout: float = 20) -> None:
        self._thread.join(timeout)
