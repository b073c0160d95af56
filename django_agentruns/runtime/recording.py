"""An attempt's outcome handed to storage: which transition, with what error, logged how.

The executor decides what happened (an `Outcome`); this module picks the transition that
writes it. Nothing here builds SQL.
"""

from __future__ import annotations

import functools
import logging
import traceback
from collections.abc import Callable

from django.db import connection

from .. import signals, transitions
from ..conf import app_settings
from ..exceptions import AttemptTimeout
from ..models import AgentRun
from ..outcomes import AttemptRef, ErrorInfo, Outcome, OutcomeKind, Settlement, StopReason
from ..registry import AgentSpec
from ..rules import policy
from ..transitions import Result, SettleWrite, SucceedWrite, Write
from ..validation import storable_text

logger = logging.getLogger("django_agentruns.worker")


def record(
    spec: AgentSpec | None, ref: AttemptRef, outcome: Outcome, *, interactive: bool = False,
    write: Callable[[Write], Result] | None = None,
) -> Settlement:
    """Hand the outcome to storage; a stop for a lost lease writes nothing at all.

    `write` applies the write (the worker passes its attempt store); by default it runs
    alone on this thread's connection, in any transaction the caller has open.
    """
    if waiting(outcome):
        return Settlement.WAITING
    step = transition(spec, ref, outcome, interactive=interactive)
    settlement = Settlement.LOST if step is None else \
        settled((write or transitions.apply_alone)(step))
    if settlement is Settlement.LOST:
        announce_lost(ref)
    return settlement


def waiting(outcome: Outcome) -> bool:
    """The attempt ended waiting: its wait write already released the lease, so
    nothing more is written."""
    return outcome.kind is OutcomeKind.STOPPED and outcome.stop_reason is StopReason.WAITING


def settled(result: Result) -> Settlement:
    assert isinstance(result, Settlement), result
    return result


def announce_lost(ref: AttemptRef) -> None:
    signals.send_after_commit(signals.run_lease_lost, run_id=ref.run_id, agent=ref.agent,
                              attempt=ref.attempt, worker_id=ref.worker_id)


def transition(
    spec: AgentSpec | None, ref: AttemptRef, outcome: Outcome, *, interactive: bool = False,
) -> Write | None:
    """The write that records `outcome`: None for a lost lease (nothing is written).

    The error is classified and described here, in the attempt's thread (a classifier is
    the application's code), so the write carries only what storage needs."""
    if outcome.kind is OutcomeKind.SUCCEEDED:
        return SucceedWrite(ref, outcome.output)
    if outcome.kind is OutcomeKind.STOPPED:
        if outcome.stop_reason is StopReason.LEASE_LOST:
            return None
        if outcome.stop_reason is StopReason.CANCELLED:
            return SettleWrite(ref, functools.partial(transitions.settle_cancelled, ref))
        if outcome.stop_reason is StopReason.SHUTDOWN:
            # A graceful stop is an interruption, not a failure: no budget spent.
            return SettleWrite(ref, functools.partial(transitions.interrupt, ref,
                                                      "the worker stopped"))
        if outcome.stop_reason is StopReason.INTERRUPTED:
            return SettleWrite(ref, functools.partial(transitions.interrupt, ref,
                                                      "the database was out of reach"))
        if outcome.stop_reason is StopReason.BUDGET:
            return SettleWrite(ref, functools.partial(
                transitions.exhaust_budget, ref, outcome.detail or "usage passed the budget"))
        error: BaseException = AttemptTimeout(
            f"attempt exceeded its timeout of {spec.timeout if spec else '?'}s")
    else:
        assert outcome.error is not None
        error = outcome.error
    failure = classify_for(spec, error)
    if failure.snooze and not interactive:  # flow control: requeued, no budget spent
        return SettleWrite(ref, functools.partial(transitions.snooze, ref, failure,
                                                  describe(error)))
    return SettleWrite(ref, functools.partial(transitions.settle_failed, ref, failure,
                                              describe(error), interactive=interactive))


def classify_for(spec: AgentSpec | None, error: BaseException) -> policy.Failure:
    custom: Callable[[BaseException], bool | None] | None = None
    if spec is not None and spec.classify is not None:
        custom = spec.classify
    else:
        custom = app_settings.classifier()
    unknown = bool(app_settings.UNKNOWN_ERRORS_RETRYABLE)
    try:
        return policy.classify(error, custom=custom, unknown_retryable=unknown)
    except Exception:
        # A classifier (or an attribute of the error) that raises must not leave the
        # attempt unrecorded: treat the error as one nothing recognises.
        logger.exception("classifying %s raised; treated as unrecognised", type(error))
        return policy.Failure(retryable=unknown)


def describe(error: BaseException) -> ErrorInfo:
    cls = type(error)
    name = cls.__qualname__ if cls.__module__ == "builtins" else \
        f"{cls.__module__}.{cls.__qualname__}"
    try:
        trace = "".join(traceback.format_exception(error))
    except Exception as exc:
        trace = f"<traceback unavailable: {type(exc).__name__}>"
    # storable_text: an agent's error may carry any text; a NUL or a lone surrogate in it
    # must not make the outcome impossible to record (the run would stay running).
    return ErrorInfo(
        type=storable_text(name),
        message=storable_text(error_text(error)[:10000]),
        traceback=storable_text(trace[-20000:]),
    )


def error_text(error: BaseException) -> str:
    """`str(error)`, or what it raised: an error whose `__str__` fails is still recorded."""
    try:
        return str(error)
    except Exception as exc:
        return f"<{type(error).__name__}: str() raised {type(exc).__name__}>"


FACT_FIELDS = ("reason", "cancel_reason", "wait_key")
TOLD = (Settlement.DEAD_LETTERED, Settlement.CANCELLED, Settlement.WAITING)


def settlement_facts(ref: AttemptRef, settlement: Settlement, *,
                     close: bool = False) -> dict[str, str]:
    """What the log line of a dead letter, a cancel or a wait names: the run's reason, its
    cancel's reason, the key it waits on (one read; these settlements are rare). Empty for
    any other settlement. `close`: the read ran on a thread that keeps no connection."""
    if settlement not in TOLD:
        return {}
    try:
        row = AgentRun.objects.filter(pk=ref.run_id).values(*FACT_FIELDS).first()
        return {k: str(v or "") for k, v in (row or {}).items()}
    finally:
        if close:
            connection.close()


def log_settlement(ref: AttemptRef, agent: str, settlement: Settlement, outcome: Outcome,
                   facts: dict[str, str] | str | None = None) -> None:
    """One line per settled attempt. The reason is said once (a budget stop's reason is the
    dead letter's too); a cancel names its reason, a wait its key."""
    if isinstance(facts, str):
        facts = {"reason": facts}
    facts = facts or {}
    extra = {"run_id": ref.run_id, "agent": agent, "attempt": ref.attempt,
             "worker_id": ref.worker_id, "outcome": settlement.value}
    if settlement is Settlement.LOST:
        logger.warning("run %s %s attempt %s: lease lost (%s); nothing recorded",
                       ref.run_id, agent, ref.attempt, outcome.stop_reason or outcome.kind,
                       extra=extra)
        return
    parts: list[str] = []
    level = logging.INFO
    reason = facts.get("reason", "")
    if settlement is Settlement.DEAD_LETTERED and reason:
        extra["reason"] = reason
        parts.append(reason)
    if outcome.stop_reason and outcome.stop_reason not in parts \
            and outcome.stop_reason != settlement.value \
            and not (settlement is Settlement.WAITING and outcome.stop_reason == "waiting"):
        parts.append(str(outcome.stop_reason))
    if settlement is Settlement.CANCELLED and facts.get("cancel_reason"):
        parts.append(f"cancel reason: {facts['cancel_reason']}")
    if settlement is Settlement.WAITING and facts.get("wait_key"):
        extra["wait_key"] = facts["wait_key"]
        parts.append(f"wait key {facts['wait_key']!r}")
    detail = f" ({'; '.join(parts)})" if parts else ""
    if outcome.error is not None:
        detail += f": {type(outcome.error).__name__}: {error_text(outcome.error)}"
        if not isinstance(outcome.error, Exception):
            level = logging.WARNING  # SystemExit, KeyboardInterrupt: rarely meant
    logger.log(level, "run %s %s attempt %s %s%s", ref.run_id, agent, ref.attempt,
               settlement.value, detail, extra=extra)
