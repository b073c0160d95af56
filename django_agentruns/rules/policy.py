"""Pure retry policy: how a failure is classified, and how long to back off.

No database here. Both functions take what they need as arguments (a random source,
the settings values), so they are tested with plain numbers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from ..exceptions import (
    MAX_DELAY_SECONDS,
    MAX_SNOOZE_SECONDS,
    InvalidInputError,
    NotRetryable,
    Retryable,
    Snooze,
    UnknownAgentError,
)
from ..outcomes import DecisionAction

RETRYABLE_STATUS = frozenset({408, 409, 425, 429})
# A provider's "not now": with a Retry-After these snooze the run (no budget spent), and a
# 429 also closes the run's limit key for every worker until then.
SNOOZING_STATUS = frozenset({429, 503})
NOT_RETRYABLE_NAMES = ("Authentication", "PermissionDenied", "Unauthorized", "Forbidden")
RETRYABLE_NAMES = ("Timeout", "TimedOut", "Connection", "RateLimit", "Unavailable", "Overloaded")


@dataclass(frozen=True)
class Failure:
    """How to treat one failure: retry it or not, and after how long if the error says."""

    retryable: bool
    delay: float | None = None
    snooze: bool = False  # requeue after `delay` without spending the budget
    closes_key: bool = False  # a 429: the run's limit key closes for `delay` too
    cause: str = ""  # what the timeline's run.snoozed says caused it


def bounded_delay(value: Any) -> float | None:
    """A delay an agent or a provider asked for, made safe to add to a date: a number in
    0..MAX_DELAY_SECONDS (larger or infinite ones are capped, negative ones are 0); NaN
    or what is not a number is None (the backoff decides). An unbounded one would make
    the settle's date arithmetic overflow, and the run be reaped as abandoned."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if math.isnan(value):
        return None
    return float(min(max(0.0, value), MAX_DELAY_SECONDS))


def classify(
    exc: BaseException,
    *,
    custom: Callable[[BaseException], bool | None] | None = None,
    unknown_retryable: bool = True,
) -> Failure:
    """Classify `exc` by its most recent underlying cause.

    Order: a custom hook's verdict; our own `Retryable`/`NotRetryable`; an HTTP status on
    the exception or its `response`; well-known timeout, connection and configuration
    errors; then wrappers (exception groups, fallback chains, `__cause__`) by their last
    attempt. What nothing recognises follows `unknown_retryable`.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        verdict = _direct(current, custom)
        if verdict is not None:
            return _bounded(verdict)
        current = _most_recent_inner(current)
    return Failure(retryable=unknown_retryable)


def _bounded(failure: Failure) -> Failure:
    delay = bounded_delay(failure.delay)
    if delay == failure.delay:
        return failure
    return Failure(retryable=failure.retryable, delay=delay, snooze=failure.snooze and delay is
                   not None, closes_key=failure.closes_key and delay is not None,
                   cause=failure.cause)


def _direct(
    exc: BaseException, custom: Callable[[BaseException], bool | None] | None
) -> Failure | None:
    if isinstance(exc, Snooze):
        return Failure(retryable=True, delay=exc.delay, snooze=True,
                       cause=f"Snooze: {exc}"[:200])
    if custom is not None:
        decided = custom(exc)
        if decided is not None:
            return Failure(retryable=bool(decided), delay=_retry_after(exc))
    if isinstance(exc, NotRetryable):
        return Failure(retryable=False)
    if isinstance(exc, Retryable):
        return Failure(retryable=True, delay=exc.delay)
    status = http_status(exc)
    if status is not None and 400 <= status <= 599:
        retryable = status in RETRYABLE_STATUS or status >= 500
        delay = _retry_after(exc) if retryable else None
        if status in SNOOZING_STATUS and delay is not None:
            return Failure(retryable=True, delay=min(delay, MAX_SNOOZE_SECONDS), snooze=True,
                           closes_key=status == 429, cause=f"HTTP {status} Retry-After")
        return Failure(retryable=retryable, delay=delay)
    # Python's own PermissionError (EACCES, EPERM) is a configuration problem, not a blip.
    if isinstance(exc, ImproperlyConfigured | InvalidInputError | UnknownAgentError
                  | PermissionError):
        return Failure(retryable=False)
    if isinstance(exc, TimeoutError | ConnectionError):
        return Failure(retryable=True)
    names = [cls.__name__ for cls in type(exc).__mro__]
    if any(marker in n for n in names for marker in NOT_RETRYABLE_NAMES):
        return Failure(retryable=False)
    if any(marker in n for n in names for marker in RETRYABLE_NAMES):
        return Failure(retryable=True, delay=_retry_after(exc))
    return None


def _most_recent_inner(exc: BaseException) -> BaseException | None:
    """The error a wrapper stands for: its last attempt, else what caused it."""
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return exc.exceptions[-1]
    for attr in ("exceptions", "attempts", "errors", "failures"):
        inner = getattr(exc, attr, None)
        if isinstance(inner, list | tuple) and inner and isinstance(inner[-1], BaseException):
            return inner[-1]
    return exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def http_status(exc: BaseException) -> int | None:
    for holder in (exc, getattr(exc, "response", None)):
        if holder is None:
            continue
        for attr in ("status_code", "status", "http_status", "code"):
            value = getattr(holder, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
                return value
    return None


def _retry_after(exc: BaseException) -> float | None:
    """Seconds from a `Retry-After` header (delta or HTTP date) on the error's response, or
    from OpenAI's `retry-after-ms` (milliseconds), which its clients read first."""
    for holder in (exc, getattr(exc, "response", None)):
        headers: Any = getattr(holder, "headers", None)
        if headers is None:
            continue
        try:
            raw = headers.get("Retry-After") or headers.get("retry-after")
            raw_ms = headers.get("retry-after-ms") or headers.get("Retry-After-Ms")
        except Exception:
            return None
        if raw_ms is not None:
            try:
                return bounded_delay(float(raw_ms) / 1000.0)
            except (TypeError, ValueError):
                pass
        if raw is None:
            continue
        try:
            return bounded_delay(float(raw))
        except (TypeError, ValueError):
            pass
        try:
            from django.utils import timezone

            return max(0.0, (parsedate_to_datetime(str(raw)) - timezone.now()).total_seconds())
        except (TypeError, ValueError):
            return None
    return None


def backoff(
    requeue_count: int,
    *,
    base: float,
    cap: float,
    jitter: float,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before retry number `requeue_count + 1`.

    Exponential: base * 2**requeue_count, capped, then up to `jitter` of it taken off at
    random. With base 2 s, cap 300 s, jitter 0.25: 1.5-2 s, 3-4 s, 6-8 s, ... 225-300 s.
    """
    if base <= 0 or cap <= 0:
        return 0.0
    exponent = min(requeue_count, 62)  # keeps 2**n a small int; the cap applies anyway
    delay = min(float(cap), float(base) * float(2**exponent))
    return delay * (1.0 - max(0.0, min(1.0, jitter)) * float(rand()))


@dataclass(frozen=True)
class Decision:
    """What happens to a run after a failed or abandoned attempt."""

    action: DecisionAction
    reason: str = ""  # the dead-letter reason, for DEAD_LETTER
    delay: float = 0.0  # seconds before the run is due again, for RETRY

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", DecisionAction(self.action))


def decide(
    failure: Failure,
    *,
    requeue_count: int,
    max_requeues: int,
    cancel_requested: bool,
    backoff_delay: Callable[[int], float],
) -> Decision:
    """The next step after a failure: a requested cancel wins, then the budget decides."""
    if cancel_requested:
        return Decision(DecisionAction.CANCEL)
    if not failure.retryable:
        return Decision(DecisionAction.DEAD_LETTER, reason="not_retryable")
    if requeue_count >= max_requeues:
        return Decision(DecisionAction.DEAD_LETTER, reason="retries_exhausted")
    delay = bounded_delay(failure.delay)
    if delay is None:
        delay = bounded_delay(backoff_delay(requeue_count)) or 0.0
    return Decision(DecisionAction.RETRY, delay=delay)
