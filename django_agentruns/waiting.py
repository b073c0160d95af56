"""The public calls of waiting runs: deliver, approve, reject, wait_for_run, await_run.

`deliver` writes in the caller's transaction, like `enqueue`: a webhook view that stores
its own record and delivers the payload commits both or neither. The writes themselves
are `transitions.waiting`'s.
"""

from __future__ import annotations

import math
import time
from typing import Any

from asgiref.sync import sync_to_async

from . import transitions
from .conf import app_settings
from .exceptions import InvalidInputError, RunNotFoundError
from .models import TERMINAL, AgentRun
from .receiving import check_key
from .validation import capped_json, storable_text
from .wait_results import DeliverResult

FINISHED_CHANNEL = "agentruns_finished"
"""PostgreSQL channel a trigger (migration 0005) NOTIFYs with the id of a run that finished."""

# Polling between looks at the run where there is no NOTIFY (SQLite), and the longest a
# PostgreSQL waiter trusts its LISTEN without looking again.
POLL_START, POLL_MAX = 0.02, 0.5
LISTEN_RECHECK = 5.0


def deliver(run_id: int, key: str, payload: Any = None, *, by: str = "") -> DeliverResult:
    """Deliver `payload` (JSON) for `key` to run `run_id`; a run that waits for it is
    queued again. The first payload stands: delivering again is ALREADY_DELIVERED.

    Raises `InvalidInputError` (bad id, key or payload) before anything is written, and
    `LimitExceeded` for a key the run has not waited for once it holds
    MAX_DELIVERIES_PER_RUN such payloads unread (a delivery its wait takes always goes).
    """
    from .api import _run_id

    rid = _run_id(run_id)
    key = check_key(key)
    capped_json(payload, f"Payload delivered for {key!r}", "MAX_INPUT_BYTES")
    if not isinstance(by, str):
        raise InvalidInputError(f"by must be a string, not {type(by).__name__}")
    return transitions.waiting.deliver(
        rid, key, payload, storable_text(by[:255]),
        max_unread=int(app_settings.MAX_DELIVERIES_PER_RUN),
        max_events=int(app_settings.MAX_EVENTS_PER_RUN))


def approve(run_id: int, key: str, *, by: str, note: str = "",
            proposal: Any = None) -> DeliverResult:
    """Approve what the run proposed for `key`; `proposal`, if given, replaces it (an edit
    by the approver)."""
    return deliver(run_id, key, _answer(True, by, note, proposal), by=by)


def reject(run_id: int, key: str, *, by: str, note: str = "") -> DeliverResult:
    """Reject what the run proposed for `key`."""
    return deliver(run_id, key, _answer(False, by, note, None), by=by)


def _answer(approved: bool, by: Any, note: Any, proposal: Any) -> dict[str, Any]:
    if not isinstance(by, str) or not by:
        raise InvalidInputError("by must name who answers (a non-empty string)")
    if not isinstance(note, str):
        raise InvalidInputError(f"note must be a string, not {type(note).__name__}")
    return {"approved": approved, "by": by[:255], "note": note[:2000], "proposal": proposal}


def wait_for_run(run_id: int, *, timeout: float | None = None) -> AgentRun:
    """Block until the run is finished and return it; `TimeoutError` past `timeout` seconds.

    PostgreSQL: LISTEN on a connection of its own (through `LISTEN_DATABASE` when set), so
    the answer comes as the run finishes; elsewhere, polling with backoff.
    """
    from .api import _run_id
    from .db import is_postgres

    rid = _run_id(run_id)
    if timeout is not None and (isinstance(timeout, bool)
                                or not isinstance(timeout, int | float)
                                or not math.isfinite(timeout) or timeout < 0):
        # NaN compares false with every deadline, so it used to mean "wait for ever".
        raise InvalidInputError(f"timeout must be a finite number of seconds >= 0 or None, "
                                f"not {timeout!r}")
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    if is_postgres():
        _listen_until_finished(rid, deadline)
    else:
        _poll_until_finished(rid, deadline)
    return AgentRun.objects.get(pk=rid)


async def await_run(run_id: int, *, timeout: float | None = None) -> AgentRun:
    """`wait_for_run` for async callers: it blocks a thread of its own, not the loop."""
    return await sync_to_async(wait_for_run, thread_sensitive=False)(run_id, timeout=timeout)


def _finished(rid: int) -> bool:
    status = AgentRun.objects.filter(pk=rid).values_list("status", flat=True).first()
    if status is None:
        raise RunNotFoundError(f"No run with id {rid!r}")
    return status in TERMINAL


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the run did not finish in time")
    return left


def _poll_until_finished(rid: int, deadline: float | None) -> None:
    wait = POLL_START
    while not _finished(rid):
        left = _left(deadline)
        time.sleep(wait if left is None else min(wait, left))
        wait = min(POLL_MAX, wait * 2)


def _listen_until_finished(rid: int, deadline: float | None) -> None:
    import psycopg

    from .notify import connect_params, listen_alias

    with psycopg.connect(**connect_params(listen_alias()), autocommit=True) as conn:
        conn.execute(f"LISTEN {FINISHED_CHANNEL}")
        # Looked at after LISTEN: a run that finishes in between is seen either way.
        while not _finished(rid):
            left = _left(deadline)
            slice_ = LISTEN_RECHECK if left is None else min(LISTEN_RECHECK, left)
            for note in conn.notifies(timeout=slice_):
                if note.payload == str(rid):
                    break
