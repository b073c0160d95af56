"""django-agentruns: durable agent runs on your Django database.

Public API (stable): `agent`, `RunContext`, `Retryable`, `NotRetryable`, `enqueue`,
`enqueue_many`, `RunRequest`, `cancel`, `retry`, `run_now`, `CancelResult`, `Snooze`,
`set_limit`.
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
    Snooze,
    UnknownAgentError,
)
from .registry import agent

if TYPE_CHECKING:
    from .api import RunRequest, cancel, enqueue, enqueue_many, retry, run_now
    from .context import RunContext
    from .limits import set_limit
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
    "Snooze",
    "UnknownAgentError",
    "agent",
    "cancel",
    "enqueue",
    "enqueue_many",
    "retry",
    "run_now",
    "set_limit",
]

_LAZY = {"RunContext": "context", "CancelResult": "outcomes", "enqueue": "api",
         "enqueue_many": "api", "cancel": "api", "retry": "api", "run_now": "api",
         "RunRequest": "api", "set_limit": "limits"}


def __getattr__(name: str) -> Any:
    """These import the models, which need the app registry ready first."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'django_agentruns' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"django_agentruns.{module}"), name)
