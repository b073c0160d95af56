"""django-agentruns: durable agent runs on your Django database.

Public API (stable): `agent`, `RunContext`, `Retryable`, `NotRetryable`, `enqueue`,
`enqueue_many`, `RunRequest`, `cancel`, `retry`, `fork`, `run_now`, `CancelResult`,
`add_schedule`, `remove_schedule`, `pause_queue`, `resume_queue`; waiting runs:
`deliver`, `DeliverResult`, `approve`, `reject`, `wait_for_run`, `await_run`, `WaitTimedOut`,
`Approval`, `RunResult`; live output: `stream_chunks`, `stream_url`; flow control: `Snooze`,
`set_limit`; erasure: `erase`, `RunNotFinishedError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .exceptions import (
    AgentRunsError,
    InvalidInputError,
    LimitExceeded,
    NotRetryable,
    Retryable,
    RunCancelledError,
    RunNotFinishedError,
    RunNotFoundError,
    Snooze,
    TooManyWaitersError,
    UnknownAgentError,
    WaitTimedOut,
)
from .registry import agent

if TYPE_CHECKING:
    from .api import RunRequest, cancel, enqueue, enqueue_many, fork, retry, run_now, set_limit
    from .chunks import stream_chunks
    from .context import RunContext
    from .queues import pause_queue, resume_queue
    from .retention import erase
    from .schedules import add_schedule, remove_schedule
    from .streaming.signing import stream_url
    from .streaming.waiters import await_run, wait_for_run
    from .transitions import CancelResult
    from .wait_results import Approval, DeliverResult, RunResult
    from .waiting import approve, deliver, reject

__version__ = "0.1.0"

__all__ = [
    "AgentRunsError",
    "Approval",
    "CancelResult",
    "DeliverResult",
    "InvalidInputError",
    "LimitExceeded",
    "NotRetryable",
    "Retryable",
    "RunCancelledError",
    "RunContext",
    "RunNotFinishedError",
    "RunNotFoundError",
    "RunRequest",
    "RunResult",
    "Snooze",
    "TooManyWaitersError",
    "UnknownAgentError",
    "WaitTimedOut",
    "add_schedule",
    "agent",
    "approve",
    "await_run",
    "cancel",
    "deliver",
    "enqueue",
    "enqueue_many",
    "erase",
    "fork",
    "pause_queue",
    "reject",
    "remove_schedule",
    "resume_queue",
    "retry",
    "run_now",
    "set_limit",
    "stream_chunks",
    "stream_url",
    "wait_for_run",
]

_LAZY = {"RunContext": "context", "CancelResult": "outcomes", "enqueue": "api",
         "enqueue_many": "api", "cancel": "api", "retry": "api", "run_now": "api",
         "RunRequest": "api", "Approval": "wait_results", "DeliverResult": "wait_results",
         "RunResult": "wait_results", "deliver": "waiting", "approve": "waiting",
         "reject": "waiting", "wait_for_run": "streaming.waiters", "await_run": "streaming.waiters",
         "fork": "api", "pause_queue": "queues", "resume_queue": "queues",
         "add_schedule": "schedules", "remove_schedule": "schedules", "set_limit": "api",
         "stream_chunks": "chunks", "stream_url": "streaming.signing", "erase": "retention"}


def __getattr__(name: str) -> Any:
    """These import the models, which need the app registry ready first."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'django_agentruns' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"django_agentruns.{module}"), name)
