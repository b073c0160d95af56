"""django-agentruns: durable agent runs on your Django database.

Public API (stable): `agent`, `RunContext`, `Retryable`, `NotRetryable`, `enqueue`,
`enqueue_many`, `RunRequest`, `cancel`, `retry`, `run_now`, `CancelResult`,
`stream_chunks`.
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
    RunNotFoundError,
    UnknownAgentError,
)
from .registry import agent

if TYPE_CHECKING:
    from .api import RunRequest, cancel, enqueue, enqueue_many, retry, run_now
    from .chunks import stream_chunks
    from .context import RunContext
    from .transitions import CancelResult

__version__ = "0.1.0"

__all__ = [
    "AgentRunsError",
    "CancelResult",
    "InvalidInputError",
    "LimitExceeded",
    "NotRetryable",
    "Retryable",
    "RunCancelledError",
    "RunContext",
    "RunNotFoundError",
    "RunRequest",
    "UnknownAgentError",
    "agent",
    "cancel",
    "enqueue",
    "enqueue_many",
    "retry",
    "run_now",
    "stream_chunks",
]

_LAZY = {"RunContext": "context", "CancelResult": "outcomes", "enqueue": "api",
         "enqueue_many": "api", "cancel": "api", "retry": "api", "run_now": "api",
         "RunRequest": "api", "stream_chunks": "chunks"}


def __getattr__(name: str) -> Any:
    """These import the models, which need the app registry ready first."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'django_agentruns' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"django_agentruns.{module}"), name)
