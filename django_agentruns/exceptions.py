"""The exceptions agents raise and callers catch.

Agents raise `Retryable` or `NotRetryable` to state how a failure should be treated;
callers of the API catch `AgentRunsError` subclasses, each of which says what was wrong.
"""

from __future__ import annotations


class AgentRunsError(Exception):
    """Base class of every error django-agentruns raises at its callers."""


class UnknownAgentError(AgentRunsError, LookupError):
    """No agent of that name is registered."""

    def __init__(self, name: str, registered: list[str]) -> None:
        known = ", ".join(sorted(registered)) or "none (is the app with agents.py installed?)"
        super().__init__(f"Unknown agent {name!r}. Registered agents: {known}.")
        self.name = name
        self.registered = registered


class InvalidInputError(AgentRunsError, ValueError):
    """An argument to the API is not what it must be (non-JSON input, a bad queue name...)."""


class LimitExceeded(InvalidInputError):
    """A value or count is past one of the caps (the message names the setting).

    Not retryable: the same input, output, state or event would be refused again.
    """


class RunNotFoundError(AgentRunsError, LookupError):
    """No run has that id."""


class TooManyWaitersError(AgentRunsError):
    """`wait_for_run` / `await_run`: this process has WAITERS_PER_PROCESS callers waiting
    already (the message names the setting)."""


class RunNotFinishedError(InvalidInputError):
    """The call needs a finished (or cancelled) run, and this one is still queued, running
    or waiting: `erase` refuses it, since its worker would go on writing for it."""


class Retryable(Exception):
    """Raise from an agent for a transient failure: the run is retried within its budget.

    `delay` (seconds) overrides the backoff for this retry, as a Retry-After header would;
    it is capped at `MAX_DELAY_SECONDS` (a week), and a NaN one is ignored.
    """

    def __init__(self, message: str = "", *, delay: float | None = None) -> None:
        super().__init__(message)
        self.delay = delay


class Snooze(Exception):
    """Raise from an agent to put its run back in the queue for `delay` seconds without
    spending its requeue budget (a provider said "later": a rate limit, a busy tool).

    Snoozes are counted on the run; past `MAX_SNOOZES` one counts as an ordinary retry.
    """

    def __init__(self, delay: float, message: str = "") -> None:
        if isinstance(delay, bool) or not isinstance(delay, int | float) \
                or not 0 <= delay <= MAX_SNOOZE_SECONDS:
            raise InvalidInputError(f"Snooze(delay) takes seconds in 0..{MAX_SNOOZE_SECONDS}, "
                                    f"not {delay!r:.60}")
        super().__init__(message or f"snoozed for {delay}s")
        self.delay = float(delay)


MAX_SNOOZE_SECONDS = 7 * 24 * 3600
"""The longest snooze (a week): a Retry-After past it is taken as this."""

MAX_DELAY_SECONDS = MAX_SNOOZE_SECONDS
"""The longest delay before a retry (a week): a `Retryable(delay=)` or a Retry-After past
it, infinite included, is taken as this; a NaN one is ignored (the backoff decides)."""


class NotRetryable(Exception):
    """Raise from an agent for a failure no retry can fix: the run is dead-lettered at once."""


class AttemptTimeout(TimeoutError):
    """The attempt ran past its agent's `timeout`; retryable like any timeout."""


class StepTimeout(AgentRunsError, TimeoutError):
    """One execution of a step (`ctx.step(..., timeout=)`) took longer than its timeout.
    Retryable, like any timeout; a sync step's thread runs on and its late result is
    discarded."""


class AttemptStopped(BaseException):
    """Raised inside an agent's context call when its attempt must stop.

    A BaseException so that an agent's `except Exception` does not swallow it. The reason
    (cancelled, lease lost, timeout, shutdown) is kept on the attempt, not here.
    """


class RunCancelledError(AgentRunsError):
    """`run_now`: the run was cancelled while it ran."""


class WaitTimedOut(NotRetryable):
    """Raised by `ctx.receive` (and the other waits) in the attempt that resumes once the
    wait's deadline passed. Uncaught, it fails the run as not retryable."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the wait for {key!r} timed out")
        self.key = key
