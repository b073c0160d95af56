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
run_waiting = Signal()
"""The run started waiting (`run`: the AgentRun as committed, `kind`: input, approval or
runs, `key`, `prompt`: what it asks, e.g. `{"proposal": ...}` for an approval)."""


def send_after_commit(signal: Signal, **kwargs: Any) -> None:
    """Send once the current transaction commits (at once outside a transaction). A
    signal nobody has connected to costs nothing (a worker sends two per run)."""
    if signal.receivers:
        transaction.on_commit(lambda: _send(signal, kwargs))


def send_waiting_after_commit(*, run_id: int, agent: str, attempt: int, kind: str,
                              key: str, prompt: Any) -> None:
    """`run_waiting`, with the run read after the commit: only when a receiver listens, so a
    wait costs no read in a project that does not use it."""
    if not run_waiting.has_listeners():
        return

    def send() -> None:
        from .models import AgentRun

        run = AgentRun.objects.filter(pk=run_id).first()
        if run is not None:
            _send(run_waiting, {"run_id": run_id, "agent": agent, "attempt": attempt,
                                "run": run, "kind": kind, "key": key, "prompt": prompt})

    transaction.on_commit(send)


def _send(signal: Signal, kwargs: dict[str, Any]) -> None:
    from .models import AgentRun

    for receiver, result in signal.send_robust(sender=AgentRun, **kwargs):
        if isinstance(result, Exception):
            logger.error("signal receiver %r failed", receiver, exc_info=result)
