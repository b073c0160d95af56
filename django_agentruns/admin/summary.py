"""The top of the run page: what state the run is in, why, and what to do about it.

An operator woken by an alert reads this first: the status with its reason (and a cancel's
reason), the error class and message, the advice of `diagnosis.advice`, and for a running
run its latest progress event, for a queued one whether any live worker will take it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from django.utils.safestring import SafeString

from ..models import AgentRun, RunEvent, Status
from ..ops.diagnosis import advice, short_error
from ..ops.workers import NOBODY_REAPS, Coverage, lapse, live_ids, rescuer
from . import display as show

PROGRESS_CHARS = 200


@dataclass(frozen=True)
class Summary:
    run: AgentRun
    badge: SafeString
    error: str
    advice: str
    progress: RunEvent | None
    progress_payload: str
    no_worker: str | None
    stuck: str | None = None  # "lease lapsed 42 s ago, worker w-1 gone"
    takes_back: str = ""  # who will take a stuck run back, or that nobody will


def summary(run: AgentRun) -> Summary:
    progress = None
    payload = ""
    if run.status == Status.RUNNING:
        progress = (RunEvent.objects.filter(run=run).exclude(type__startswith="run.")
                    .order_by("-seq").first())
        if progress is not None:
            payload = short_error(json.dumps(progress.payload, ensure_ascii=False),
                                  PROGRESS_CHARS)
    gap = Coverage.read().gap(run) if run.status == Status.QUEUED else None
    error = short_error(run.error_message, 500) if run.status == Status.FAILED else ""
    live = live_ids() if run.status == Status.RUNNING else None
    stuck = None if live is None else lapse(run, live)
    takes_back = "" if stuck is None else (rescuer(run, Coverage.read()) or NOBODY_REAPS)
    return Summary(run, show.status_badge(run, live), error, advice(run), progress, payload,
                   gap, stuck, takes_back)
