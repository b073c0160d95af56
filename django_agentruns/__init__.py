"""django-agentruns: durable agent runs on your Django database.

Public API (stable): `agent`, `RunContext`, `Retryable`, `NotRetryable`, `enqueue`,
`enqueue_many`, `RunRequest`, `cancel`, `retry`, `fork`, `run_now`, `CancelResult`,
`add_schedule`, `remove_schedule`, `pause_queue`, `resume_queue`; waiting runs:
`deliver`, `DeliverResult`, `approve`, `reject`, `wait_for_run`, `await_run`, `WaitTimedOut`,
`Approval`, `RunResult`; live output: `stream_chunks`, `stream_url`; flow control: `Snooze`,
`set_limit`; erasure: `erase`, `RunNotFinishedError`.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from importlib.machinery import PathFinder
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .conf import VERSION
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
    from .api import (
        RunRequest,
        cancel,
        enqueue,
        enqueue_many,
        fork,
        open_key,
        retry,
        set_limit,
    )
    from .ops.retention import erase
    from .outcomes import Approval, DeliverResult, RunResult
    from .queues import pause_queue, resume_queue
    from .runtime.context import RunContext
    from .runtime.interactive import run_now
    from .schedules import add_schedule, remove_schedule
    from .streaming.reader import stream_chunks
    from .streaming.signing import stream_url
    from .streaming.waiters import await_run, wait_for_run
    from .transitions import CancelResult
    from .waiting import approve, deliver, reject

__version__ = VERSION

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
    "open_key",
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

_LAZY = {"RunContext": "runtime.context", "CancelResult": "outcomes", "enqueue": "api",
         "enqueue_many": "api", "cancel": "api", "retry": "api", "run_now": "runtime.interactive",
         "RunRequest": "api", "Approval": "outcomes", "DeliverResult": "outcomes",
         "RunResult": "outcomes", "deliver": "waiting", "approve": "waiting",
         "reject": "waiting", "wait_for_run": "streaming.waiters", "await_run": "streaming.waiters",
         "fork": "api", "pause_queue": "queues", "resume_queue": "queues",
         "add_schedule": "schedules", "remove_schedule": "schedules", "set_limit": "api",
         "stream_chunks": "streaming.reader", "stream_url": "streaming.signing",
         "erase": "ops.retention", "open_key": "api"}


def __getattr__(name: str) -> Any:
    """These import the models, which need the app registry ready first."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'django_agentruns' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"django_agentruns.{module}"), name)


# Module paths of the flat layout, kept importable for one release (with a
# DeprecationWarning): the modules moved into runtime/, streaming/ and ops/.
MOVED = {
    "worker": ("runtime.worker",), "executor": ("runtime.executor",),
    "control": ("runtime.control",), "recording": ("runtime.recording",),
    "lease_keeper": ("runtime.lease_keeper",), "live": ("runtime.running",),
    "store": ("runtime.attempt_store",), "notify": ("runtime.wakeups", "db"),
    "reaper": ("runtime.reaper",), "usage": ("runtime.usage",),
    "receiving": ("runtime.receiving", "validation"), "context": ("runtime.context",),
    "chunks": ("streaming.chunks", "streaming.reader"),
    "chunk_transport": ("streaming.transport",), "fanout": ("streaming.hub",),
    "stream": ("streaming.sse",), "metrics": ("ops.metrics",), "backlog": ("ops.backlog",),
    "triage": ("ops.triage",), "visibility": ("ops.visibility",),
    "diagnosis": ("ops.diagnosis",), "tracing": ("ops.tracing",), "pooling": ("ops.pooling",),
    "retention": ("ops.retention",), "workers": ("ops.workers", "runtime.presence"),
    "wait_results": ("outcomes",),
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `django_agentruns.<old name>`: a module that warns, then hands out the names
    of the modules it became. Asked after the path finder, so it never hides a real module,
    and before an editable install's finder, which would find the old file elsewhere."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        package, _, old = fullname.partition(".")
        if package != __name__ or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__.partition(".")[2]
        homes = [importlib.import_module(f"{__name__}.{new}") for new in MOVED[old]]
        warnings.warn(f"{module.__name__} moved to "
                      f"{' and '.join(home.__name__ for home in homes)}; the old path goes "
                      "in the next release", DeprecationWarning, stacklevel=2)

        def moved_attribute(name: str) -> Any:
            for home in homes:
                if hasattr(home, name):
                    return getattr(home, name)
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

        module.__getattr__ = moved_attribute  # type: ignore[method-assign]


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    _after = [i for i, finder in enumerate(sys.meta_path) if finder is PathFinder]
    sys.meta_path.insert(_after[0] + 1 if _after else len(sys.meta_path), _MovedModules())
