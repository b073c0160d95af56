"""A worker's success settled after its attempt's thread (or coroutine) has moved on.

An attempt whose agent returned has one write left, its success, and nothing to do with
the answer but log it, count it and free its slot. Waiting for it cost a thread wake-up
per run (the answer back to the waiting attempt), on top of the two that carry the run
there and the success back. So the worker's attempts hand the success off
(`Handover.hand_off`) and return; whoever settles it (the claim loop's next statement,
else a store writer) ends the attempt through `then`: the log line, the metrics, the
worker's count, the slot. Until then the attempt stays in the worker's live set, its
lease renewed, as when its thread waited. A settle that failed takes the waiting path
after all, on a thread of its own: the attempt's own retries for half its lease.

Only a success, and only without a tracer configured (an attempt's span ends with its
outcome on the attempt's thread).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..db import close_all_connections
from ..models import AgentRun
from ..ops.tracing import AttemptSpan
from ..outcomes import Outcome, OutcomeKind, Settlement
from ..registry import AgentSpec
from ..transitions import Result, SucceedWrite, Write
from . import recording
from .control import AttemptControl

if TYPE_CHECKING:
    from .executor import Executor

logger = logging.getLogger("django_agentruns.worker")

Then = Callable[[Settlement | None], None]


class Deferred:
    """An attempt's result when its success was handed off: `then` will end it."""


DEFERRED = Deferred()


def hand_off(executor: Executor, run: AgentRun, spec: AgentSpec | None,
             control: AttemptControl, outcome: Outcome, began: float, span: AttemptSpan,
             then: Then | None, *, in_thread: bool) -> bool:
    """Whether the success of this attempt was handed off (then `then` ends it, once, on
    another thread). `in_thread`: a sync attempt in a pool thread, whose connections are
    closed first (the worker may stop as soon as `then` ran) and whose lost success is
    announced as `recording.record` does."""
    settles = executor.settles
    if then is None or settles is None or span.span is not None \
            or outcome.kind is not OutcomeKind.SUCCEEDED:
        return False
    if in_thread:
        close_all_connections()
    answered = functools.partial(_answered, executor, run, spec, control, outcome, began,
                                 then, in_thread)
    try:
        settles.hand_off(SucceedWrite(control.ref, outcome.output), answered)
    except RuntimeError:  # the store is closed: the attempt records it itself, as before
        return False
    return True


def _answered(executor: Executor, run: AgentRun, spec: AgentSpec | None,
              control: AttemptControl, outcome: Outcome, began: float, then: Then,
              announce: bool, result: Result | BaseException) -> None:
    if isinstance(result, BaseException):
        # Not written (the statement and the store's retries failed): the attempt's own
        # retry loop, which may sleep, so not on this thread. Rare.
        threading.Thread(target=_record, name="agentruns-settle", daemon=True,
                         args=(executor, run, spec, control, outcome, began, then,
                               result)).start()
        return
    settlement: Settlement | None = None
    try:
        settlement = recording.settled(result)
        if announce and settlement is Settlement.LOST:
            recording.announce_lost(control.ref)
        executor.settled(run, control, settlement, outcome, began)
    except Exception:
        logger.exception("run %s: could not record the attempt's outcome", run.pk)
        settlement = None
    finally:
        then(settlement)


def _record(executor: Executor, run: AgentRun, spec: AgentSpec | None,
            control: AttemptControl, outcome: Outcome, began: float, then: Then,
            error: BaseException) -> None:
    """The attempt's own retry loop, its first try being the hand-off that failed."""
    failed = [error]

    def write(step: Write) -> Result:
        if failed:
            raise failed.pop()
        assert executor.settles is not None
        return executor.settles.call(step)

    settlement: Settlement | None = None
    try:
        settlement = executor.record(spec, control.ref, outcome, write)
        executor.settled(run, control, settlement, outcome, began)
    except BaseException:
        logger.exception("run %s: could not record the attempt's outcome", run.pk)
        settlement = None
    finally:
        close_all_connections()
        then(settlement)
