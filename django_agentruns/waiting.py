"""The public calls of waiting runs: deliver, approve, reject (`wait_for_run` and
`await_run` share a listener: streaming/waiters.py).

`deliver` writes in the caller's transaction, like `enqueue`: a webhook view that stores
its own record and delivers the payload commits both or neither. The writes themselves
are `transitions.waiting`'s.
"""

from __future__ import annotations

from typing import Any

from . import transitions
from .conf import app_settings
from .exceptions import InvalidInputError
from .outcomes import DeliverResult
from .validation import capped_json, check_key, storable_text


def deliver(run_id: int, key: str, payload: Any = None, *, by: str = "") -> DeliverResult:
    """Deliver `payload` (JSON) for `key` to run `run_id`; a run that waits for it is
    queued again. The first payload stands: delivering again is ALREADY_DELIVERED; a
    payload that comes before the wait is STORED, and `receive` finds it.

    Raises `InvalidInputError` (bad id, key or payload) before anything is written, and
    `LimitExceeded` for a key the run has not waited for once it holds
    MAX_DELIVERIES_PER_RUN such payloads unread (a delivery its wait takes always goes).
    """
    return _deliver(run_id, key, payload, by, answers_approval=False)


def approve(run_id: int, key: str, *, by: str, note: str = "",
            proposal: Any = None) -> DeliverResult:
    """Approve what the run proposed for `key`; `proposal`, if given, replaces it (an edit
    by the approver).

    Raises `InvalidInputError`, writing nothing, when the run never asked for approval of
    `key` (the message names the keys it does wait for); answering twice is
    ALREADY_DELIVERED.
    """
    return _deliver(run_id, key, _answer(True, by, note, proposal), by,
                    answers_approval=True)


def reject(run_id: int, key: str, *, by: str, note: str = "") -> DeliverResult:
    """Reject what the run proposed for `key` (the same checks as `approve`)."""
    return _deliver(run_id, key, _answer(False, by, note, None), by, answers_approval=True)


def _deliver(run_id: int, key: str, payload: Any, by: Any, *,
             answers_approval: bool) -> DeliverResult:
    from .api import run_id_of

    rid = run_id_of(run_id)
    key = check_key(key)
    capped_json(payload, f"Payload delivered for {key!r}", "MAX_INPUT_BYTES")
    if not isinstance(by, str):
        raise InvalidInputError(f"by must be a string, not {type(by).__name__}")
    return transitions.waiting.deliver(
        rid, key, payload, storable_text(by[:255]), answers_approval=answers_approval,
        max_unread=int(app_settings.MAX_DELIVERIES_PER_RUN),
        max_events=int(app_settings.MAX_EVENTS_PER_RUN))


def _answer(approved: bool, by: Any, note: Any, proposal: Any) -> dict[str, Any]:
    if not isinstance(by, str) or not by:
        raise InvalidInputError("by must name who answers (a non-empty string)")
    if not isinstance(note, str):
        raise InvalidInputError(f"note must be a string, not {type(note).__name__}")
    return {"approved": approved, "by": by[:255], "note": note[:2000], "proposal": proposal}
