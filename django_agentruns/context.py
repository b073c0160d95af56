"""What an agent sees of its run: input, resume state, and the calls that write.

Every write goes through `transitions` with the attempt's fence, and every call is a
step boundary: it renews the lease and is where a stop (cancel, lost lease, timeout,
shutdown) reaches a sync agent, as `AttemptStopped`. The attempt's control (fence,
deadline, stop switch) is the executor's `AttemptControl`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from . import transitions
from .conf import app_settings
from .exceptions import InvalidInputError
from .validation import capped_json, unstorable_text

if TYPE_CHECKING:
    from .executor import AttemptControl

T = TypeVar("T")


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
