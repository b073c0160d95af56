"""Lifecycle signals, sent once the transition they announce has committed.

Receivers get `sender=AgentRun` and keyword arguments `run_id`, `agent` and `attempt`,
plus what the transition says (listed per signal). They run in the process that made
the transition (the worker, the reaper, the web process for enqueue and cancel); a
receiver that raises is logged and does not undo anything.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.dispatch import Signal

logger = logging.getLogger("django_agentruns.signals")

run_enqueued = Signal()
"""A run was queued (`queue`, `scope`)."""
run_started = Signal()
"""An attempt claimed the run (`worker_id`)."""
run_succeeded = Signal()
"""The run succeeded."""
run_requeued = Signal()
"""A failed or abandoned attempt was requeued (`delay`, `error_type`)."""
run_dead_lettered = Signal()
"""The run failed for good (`reason`, `error_type`)."""
run_cancelled = Signal()
"""The run was cancelled (`reason`)."""
run_reaped = Signal()
"""A lapsed lease was taken back (`outcome`: requeued, dead_lettered or cancelled)."""
usage_recorded = Signal()
"""An attempt recorded usage (`input_tokens`, `output_tokens`, `cost`, `model`)."""
run_lease_lost = Signal()
"""An attempt found its lease gone and stopped without recording anything (`worker_id`)."""


def send_after_commit(signal: Signal, **kwargs: Any) -> None:
    """Send once the current transaction commits (at once outside a transaction)."""
    transaction.on_commit(lambda: _send(signal, kwargs))


def _send(signal: Signal, kwargs: dict[str, Any]) -> None:
    from .models import AgentRun

    for receiver, result in signal.send_robust(sender=AgentRun, **kwargs):
        if isinstance(result, Exception):
            logger.error("signal receiver %r failed", receiver, exc_info=result)
