"""What an agent sees of its run: input, resume state, and the calls that write.

Every write goes through `transitions` with the attempt's fence, and every call is a
step boundary: it renews the lease and is where a stop (cancel, lost lease, timeout,
shutdown) reaches a sync agent, as `AttemptStopped`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import DatabaseError, close_old_connections, connection

from . import transitions
from .conf import SETTING_NAME, app_settings
from .db import storage_unreachable
from .exceptions import AttemptStopped, InvalidInputError, LimitExceeded
from .limits import Budget
from .outcomes import AttemptRef, Renewal

T = TypeVar("T")

logger = logging.getLogger("django_agentruns.worker")


class StopReason:
    CANCELLED = "cancelled"
    LEASE_LOST = "lease_lost"
    TIMEOUT = "timeout"
    SHUTDOWN = "shutdown"
    INTERRUPTED = "interrupted"  # the database stayed out of reach: requeued, not charged
    BUDGET = "budget_exhausted"  # recorded usage passed the run's budget: dead-lettered


class AttemptControl:
    """The worker's handle on one attempt: its fence, its deadline, and a stop switch."""

    def __init__(self, ref: AttemptRef, timeout: float | None, checkpoints: int) -> None:
        self.ref = ref
        self.deadline = None if not timeout else time.monotonic() + timeout
        self.checkpoints = checkpoints
        self.position = 0
        self.stop_reason: str | None = None
        self.future: Any = None  # an async attempt's concurrent future, cancelled to stop it
        self.done = threading.Event()
        self.in_storage = 0
        self._lock = threading.Lock()
        # Flow control (django_agentruns.usage arms these): the run's budget, what it has
        # recorded so far, and what passed the budget once it has.
        self.budget: Budget | None = None
        self.spent: tuple[int, float] = (0, 0.0)
        self.over_budget: str | None = None

    def request_stop(self, reason: str) -> None:
        """Ask the attempt to stop; the first reason wins."""
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = reason
            future = self.future
        if future is not None:
            future.cancel()

    def timed_out(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def check(self) -> None:
        if self.stop_reason is None and self.timed_out():
            self.request_stop(StopReason.TIMEOUT)
        if self.stop_reason is None and self.over_budget is not None:
            self.request_stop(StopReason.BUDGET)
        if self.stop_reason is not None:
            raise AttemptStopped(self.stop_reason)

    def apply(self, renewal: Renewal) -> None:
        if renewal is Renewal.LOST:
            self.request_stop(StopReason.LEASE_LOST)
        elif renewal is Renewal.CANCEL_REQUESTED:
            self.request_stop(StopReason.CANCELLED)
        self.check()

    def call(self, write: Callable[..., T], *args: Any) -> T:
        """One storage call of the attempt, retried on a fresh connection while the
        database is out of reach (a restart, a killed session, lock contention).

        The engine's storage failures are not the agent's: past half the lease the attempt
        stops as interrupted, and is requeued without spending its budget. Each write is
        one guarded, idempotent transaction, so a retry after a lost commit adds nothing.
        Interactive runs (no lease, maybe in the caller's transaction) are not retried.
        """
        deadline = time.monotonic() + (self.ref.lease_ttl or 0.0) / 2
        wait = 0.05
        while True:
            raw = connection.connection
            try:
                with self.storage():
                    return write(*args)
            except DatabaseError as exc:
                if self.ref.lease_ttl is None or connection.in_atomic_block \
                        or not storage_unreachable(exc, raw):
                    raise
                with suppress(Exception):
                    connection.close()  # broken: the next try opens a fresh one
                if self.stop_reason is not None:
                    raise AttemptStopped(self.stop_reason) from exc
                if time.monotonic() + wait > deadline:
                    self.request_stop(StopReason.INTERRUPTED)
                    raise AttemptStopped(StopReason.INTERRUPTED) from exc
                logger.warning("run %s: storage call failed (%s); retrying in %.2fs",
                               self.ref.run_id, exc, wait)
                time.sleep(wait)
                wait = min(1.0, wait * 2)

    @contextmanager
    def storage(self) -> Iterator[None]:
        """Count storage calls in flight, so a stop never lands inside one."""
        with self._lock:
            self.in_storage += 1
        try:
            yield
        finally:
            with self._lock:
                self.in_storage -= 1


# Deeper JSON is refused: SQLite's JSON functions stop at 1000 levels, PostgreSQL does not.
MAX_JSON_DEPTH = 500
# Text neither engine stores alike: PostgreSQL refuses NUL in text and jsonb, and surrogate
# code points are not Unicode text at all (a pair given as two of them comes back as one).
_UNSTORABLE_TEXT = re.compile("[\x00\ud800-\udfff]")


def unstorable_text(text: str) -> bool:
    """Whether `text` holds a NUL character or a surrogate code point."""
    return _UNSTORABLE_TEXT.search(text) is not None


def storable_text(text: str) -> str:
    """Free text (an error message, a reason) as every engine stores it: NUL characters and
    surrogates written as backslash escapes, the rest unchanged."""
    if not unstorable_text(text):
        return text
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def ensure_json(value: Any, what: str) -> Any:
    """Return `value` if it is plain JSON (no NaN, no objects), else raise a clear error.

    The value must also store the same on every engine: no NUL characters or surrogates
    in its text, no nesting deeper than MAX_JSON_DEPTH.
    """
    json_text(value, what)
    return value


# One encoder for every call: json.dumps() builds a new one whenever it is given options.
_STRICT_JSON = json.JSONEncoder(allow_nan=False)


def json_text(value: Any, what: str) -> str:
    """`value` as JSON text, checked as `ensure_json` checks it: the text enqueue stores.

    The walk over the value runs only when the text shows it might find something: the
    encoder escapes every NUL and surrogate (``\\u0000``, ``\\udXXX``), and nesting deeper
    than MAX_JSON_DEPTH takes more opening brackets than that. Most values skip it.
    """
    try:
        text = _STRICT_JSON.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidInputError(f"{what} must be JSON-serialisable: {exc}") from exc
    suspect = "\\u0000" in text or "\\ud" in text \
        or text.count("[") + text.count("{") > MAX_JSON_DEPTH
    problem = _unstorable(value) if suspect else None
    if problem is None and "{" in text:  # no brace in the text, no dict in the value
        problem = _odd_key(value)
    if problem:
        raise InvalidInputError(f"{what} cannot be stored: {problem}")
    return text


def capped_json(value: Any, what: str, setting: str) -> str:
    """`json_text`, refused with `LimitExceeded` if longer than the size cap `setting`."""
    text = json_text(value, what)
    limit = int(getattr(app_settings, setting))
    # The encoder escapes every non-ASCII character, so the text's length is its size.
    if len(text) > limit:
        raise LimitExceeded(f"{what} is {len(text)} bytes as JSON, over the limit of {limit} "
                            f"bytes ({SETTING_NAME}['{setting}'])")
    return text


def _odd_key(value: Any) -> str | None:
    """A dict key that is not a string, if any: JSON would turn 1 into "1" (and merge it
    with a "1" beside it), so the value would not come back as it was given."""
    stack = [value]
    containers = (dict, list, tuple)
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, str):
                    return f"the key {key!r} is not a string (JSON keys are strings)"
            stack.extend(v for v in item.values() if isinstance(v, containers))
        else:
            stack.extend(v for v in item if isinstance(v, containers))
    return None


def _unstorable(value: Any) -> str | None:
    """What in a JSON-serialisable value no engine stores faithfully, if anything."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if unstorable_text(item):
                return f"the text {item[:40]!r} holds a NUL character or a surrogate code point"
        elif isinstance(item, dict | list | tuple):
            if depth >= MAX_JSON_DEPTH:
                return f"it is nested more than {MAX_JSON_DEPTH} levels deep"
            if isinstance(item, dict):
                stack.extend((key, depth + 1) for key in item if isinstance(key, str))
                stack.extend((child, depth + 1) for child in item.values())
            else:
                stack.extend((child, depth + 1) for child in item)
    return None


class RunContext:
    """Passed to every agent. Sync agents call `emit`; async agents `await ctx.aemit`."""

    def __init__(
        self, *, run_id: int, agent: str, input: Any, attempt: int, state: Any,
        scope: str, control: AttemptControl,
    ) -> None:
        self.run_id = run_id
        self.agent = agent
        self.input = input
        self.attempt = attempt
        self.state = state
        self.scope = scope
        self._control = control

    @property
    def checkpoint_count(self) -> int:
        return self._control.checkpoints

    @property
    def stop_requested(self) -> bool:
        """True once the attempt must stop; the next context call will raise."""
        return self._control.stop_reason is not None or self._control.timed_out()

    def emit(self, type: str, payload: dict[str, Any] | None = None) -> None:
        """Append an event to the run's stream (a step boundary)."""
        control = self._control
        control.check()
        if not isinstance(type, str) or not type or len(type) > 100 or unstorable_text(type):
            raise InvalidInputError(f"Event type must be a string of 1-100 characters with no "
                                    f"NUL or surrogate, not {type!r:.120}")
        payload = {} if payload is None else payload
        capped_json(payload, f"Payload of event {type!r}", "MAX_EVENT_BYTES")
        event_id = transitions.emitted_event_id(self.run_id, control.checkpoints, control.position)
        control.position += 1
        renewal = control.call(functools.partial(
            transitions.emit, max_events=int(app_settings.MAX_EVENTS_PER_RUN)),
            control.ref, event_id, type, payload)
        control.apply(renewal)

    def checkpoint(self, state: Any) -> None:
        """Save the state the next attempt resumes from (a step boundary)."""
        control = self._control
        control.check()
        capped_json(state, "Checkpoint state", "MAX_STATE_BYTES")
        renewal = control.call(functools.partial(
            transitions.checkpoint, max_events=int(app_settings.MAX_EVENTS_PER_RUN)),
            control.ref, state, control.checkpoints + 1)
        control.apply(renewal)
        control.checkpoints += 1
        control.position = 0
        self.state = state

    def heartbeat(self) -> None:
        """Renew the lease and take any stop request (a step boundary with no event)."""
        control = self._control
        control.check()
        renewal = control.call(transitions.renew, control.ref)
        control.apply(renewal)

    def record_usage(self, *, input_tokens: int = 0, output_tokens: int = 0, cost: float = 0.0,
                     model: str = "") -> None:
        """Add a model call's tokens and cost to the run's totals (a step boundary); once a
        total passes the run's budget, the next context call stops the attempt and the run
        is dead-lettered `budget_exhausted`."""
        from . import usage

        usage.record(self._control, self.agent, input_tokens, output_tokens, cost, model)

    async def arecord_usage(self, *, input_tokens: int = 0, output_tokens: int = 0,
                            cost: float = 0.0, model: str = "") -> None:
        await _in_thread(self._control, functools.partial(
            self.record_usage, input_tokens=input_tokens, output_tokens=output_tokens,
            cost=cost, model=model))

    async def aemit(self, type: str, payload: dict[str, Any] | None = None) -> None:
        await _in_thread(self._control, self.emit, type, payload)

    async def acheckpoint(self, state: Any) -> None:
        await _in_thread(self._control, self.checkpoint, state)

    async def aheartbeat(self) -> None:
        await _in_thread(self._control, self.heartbeat)


async def storage_call(ctx: RunContext, func: Callable[..., T], *args: Any) -> T:
    """Run a synchronous call that uses the database off the event loop, as `aemit` and
    the other async context calls do (for code built on an async agent, like the tasks
    runner)."""
    return await _in_thread(ctx._control, func, *args)


async def _in_thread(control: AttemptControl, func: Callable[..., T], *args: Any) -> T:
    """Run a storage call off the event loop: the ORM is synchronous."""
    if control.ref.lease_ttl is None:
        # `run_now` (no lease): back in the caller's thread, which waits in async_to_sync,
        # so the write uses the caller's connection and joins any transaction it is in.
        return await sync_to_async(func, thread_sensitive=True)(*args)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, functools.partial(_storage_call, func, *args))


def _storage_call(func: Callable[..., T], *args: Any) -> T:
    """One call on an executor thread, whose connection obeys CONN_MAX_AGE like any other."""
    close_old_connections()
    try:
        return func(*args)
    finally:
        close_old_connections()
