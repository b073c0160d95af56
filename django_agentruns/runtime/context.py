"""What an agent sees of its run: input, resume state, and the calls that write.

Every write goes through `transitions` with the attempt's fence, and every call is a
step boundary: it renews the lease and is where a stop (cancel, lost lease, timeout,
shutdown) reaches a sync agent, as `AttemptStopped`. The attempt's control (fence,
deadline, stop switch) is the executor's `AttemptControl`.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from .. import transitions
from ..conf import app_settings
from ..outcomes import Approval, RunResult
from ..streaming import chunks
from ..validation import capped_json, check_short_text
from . import receiving, steps, usage

if TYPE_CHECKING:
    from .control import AttemptControl

T = TypeVar("T")

_current: contextvars.ContextVar[RunContext | None] = contextvars.ContextVar(
    "agentruns_context", default=None)


def current_context() -> RunContext | None:
    """The context of the agent run executing here (None outside one), for code that runs
    inside an agent without being handed `ctx`: a framework integration's model wrapper."""
    return _current.get()


@contextmanager
def entered(ctx: RunContext) -> Iterator[None]:
    """Make `ctx` the one `current_context()` answers while the agent's code runs."""
    token = _current.set(ctx)
    try:
        yield
    finally:
        _current.reset(token)


class RunContext:
    """Passed to every agent. Sync agents call `emit`; async agents `await ctx.aemit`."""

    def __init__(
        self, *, run_id: int, agent: str, input: Any, attempt: int, state: Any,
        scope: str, control: AttemptControl, limit_key: str = "",
    ) -> None:
        self.run_id = run_id
        self.agent = agent
        self.input = input
        self.attempt = attempt
        self.state = state
        self.scope = scope
        # The limit key this attempt was started under: with failover keys, the one taken.
        self.limit_key = limit_key
        self._control = control

    @property
    def checkpoint_count(self) -> int:
        return self._control.checkpoints

    @property
    def stop_requested(self) -> bool:
        """True once the attempt must stop (a cancel, a lost lease, its timeout, a shutdown,
        or its run's budget spent by `record_usage`); the next context call will raise.
        An agent checks it before a paid call it can skip."""
        control = self._control
        return control.stop_reason is not None or control.timed_out() \
            or control.over_budget is not None

    def emit(self, type: str, payload: dict[str, Any] | None = None) -> None:
        """Append an event to the run's stream (a step boundary)."""
        write = self._event(type, payload)
        self._coalesce()
        self._control.apply(self._control.write(write))

    def checkpoint(self, state: Any) -> None:
        """Save the state the next attempt resumes from (a step boundary)."""
        write = self._checkpoint(state)
        self._coalesce()
        self._control.apply(self._control.write(write))
        self._saved(state)

    def heartbeat(self) -> None:
        """Renew the lease and take any stop request (a step boundary with no event)."""
        self._control.check()
        self._control.apply(self._control.write(transitions.RenewWrite(self._control.ref)))

    async def aemit(self, type: str, payload: dict[str, Any] | None = None) -> None:
        write = self._event(type, payload)
        await self._acoalesce()
        self._control.apply(await self._control.awrite(write))

    async def acheckpoint(self, state: Any) -> None:
        write = self._checkpoint(state)
        await self._acoalesce()
        self._control.apply(await self._control.awrite(write))
        self._saved(state)

    async def aheartbeat(self) -> None:
        self._control.check()
        self._control.apply(await self._control.awrite(transitions.RenewWrite(self._control.ref)))

    # Live output (django_agentruns.streaming.chunks): sent at once, stored at the next boundary.

    def stream(self, text: str, *, channel: str = "output") -> None:
        """Send `text` live to whoever watches the run; it is stored, with the rest of the
        channel's text, as one `stream` event at the next step boundary."""
        if chunks.stream(self._control, text, channel):
            self._coalesce()

    async def astream(self, text: str, *, channel: str = "output") -> None:
        """`stream` for async agents: the send never blocks the loop; a long buffer is
        stored through the attempt store, awaited."""
        if chunks.stream(self._control, text, channel):
            await self._acoalesce()

    def _coalesce(self) -> None:
        """Store each channel's text streamed since the last boundary (fenced, like emit)."""
        self._control.apply(chunks.coalesce(self._control))

    def _before_wait(self) -> None:
        """A wait releases the lease: the chunks sent so far go out live while this attempt
        still holds the run (the sender's writes are fenced on it: after the wait they would
        be dropped), and the streamed text is stored."""
        chunks.flush_sent(self._control)
        self._coalesce()

    async def _acoalesce(self) -> None:
        self._control.apply(await chunks.acoalesce(self._control))
    # Durable steps (django_agentruns.runtime.steps): run once per run, result stored.

    def step(self, name: str, fn: Callable[..., T], *args: Any, retries: int = 0,
             timeout: float | None = None, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` once per run as step `name` (its next occurrence) and
        return its JSON result; an attempt reaching a step done already gets the stored
        result without calling `fn`. `retries`: executions retried in this attempt on a
        retryable error; `timeout`: seconds one execution may take (a sync `fn` runs on
        in its thread past it; its late result is discarded)."""
        result: T = steps.run_step(self, name, fn, args, kwargs, retries, timeout)
        return result

    async def astep(self, name: str, fn: Callable[..., Any], *args: Any, retries: int = 0,
                    timeout: float | None = None, **kwargs: Any) -> Any:
        """`step` for an `async` fn (awaited; cancelled past `timeout`)."""
        return await steps.arun_step(self, name, fn, args, kwargs, retries, timeout)

    @property
    def step_key(self) -> str | None:
        """The idempotency key of the step executing now (e.g. "run-42/draft/1"), the same
        in every attempt that executes it; None outside a step. Give it to an API that
        takes one (Stripe, OpenAI...) and the step's effect happens once."""
        return steps.current_key()

    def record_usage(self, *, input_tokens: int = 0, output_tokens: int = 0, cost: float = 0.0,
                     model: str = "") -> None:
        """Add a model call's tokens and cost to the run's totals (a step boundary); once a
        total passes the run's budget, the next context call stops the attempt and the run
        is dead-lettered `budget_exhausted`."""
        write = usage.usage_write(self._control, input_tokens, output_tokens, cost, model)
        usage.recorded(self._control, self.agent, write, self._control.write(write))
        steps.attribute_usage(write.input_tokens, write.output_tokens, write.cost)

    async def arecord_usage(self, *, input_tokens: int = 0, output_tokens: int = 0,
                            cost: float = 0.0, model: str = "") -> None:
        write = usage.usage_write(self._control, input_tokens, output_tokens, cost, model)
        usage.recorded(self._control, self.agent, write, await self._control.awrite(write))
        steps.attribute_usage(write.input_tokens, write.output_tokens, write.cost)

    # Waiting (django_agentruns.runtime.receiving): the attempt may end with the run `waiting`.
    # Each is one fenced transaction of its own (`control.call`), on the attempt's thread;
    # an async agent's runs off the event loop (`in_thread`), never blocking it.

    def receive(self, key: str, *, timeout: float | None = None, prompt: Any = None) -> Any:
        """The payload delivered for `key`; if none yet, the run waits for it (see
        `receiving.receive`): checkpoint first, the next attempt resumes from there."""
        self._before_wait()
        return receiving.receive(self, key, timeout=timeout, prompt=prompt)

    def request_approval(self, key: str, proposal: Any, *,
                         timeout: float | None = None) -> Approval:
        """`receive` with a person's structured answer (`approve`, `reject`)."""
        self._before_wait()
        return receiving.request_approval(self, key, proposal, timeout=timeout)

    def spawn(self, agent: str, input: Any = None, *, key: str, queue: str | None = None,
              scope: str | None = None, priority: int | None = None,
              budget: dict[str, Any] | None = None) -> int:
        """Enqueue a child run once per `key`, whatever attempt asks; return its id. The
        child has its own budget (`budget`, else its agent's), not a share of this run's."""
        return receiving.spawn(self, agent, input, key=key, queue=queue, scope=scope,
                               priority=priority, budget=budget)

    def wait_for_runs(self, ids: Iterable[int], *,
                      timeout: float | None = None) -> dict[int, RunResult]:
        """Each child run's result once all are finished; until then the run waits."""
        self._before_wait()
        return receiving.wait_for_runs(self, ids, timeout=timeout)

    async def areceive(self, key: str, *, timeout: float | None = None,
                       prompt: Any = None) -> Any:
        return await storage_call(self, functools.partial(
            self.receive, key, timeout=timeout, prompt=prompt))

    async def arequest_approval(self, key: str, proposal: Any, *,
                                timeout: float | None = None) -> Approval:
        return await storage_call(self, functools.partial(
            self.request_approval, key, proposal, timeout=timeout))

    async def aspawn(self, agent: str, input: Any = None, *, key: str,
                     queue: str | None = None, scope: str | None = None,
                     priority: int | None = None,
                     budget: dict[str, Any] | None = None) -> int:
        return await storage_call(self, functools.partial(
            self.spawn, agent, input, key=key, queue=queue, scope=scope, priority=priority,
            budget=budget))

    async def await_runs(self, ids: Iterable[int], *,
                         timeout: float | None = None) -> dict[int, RunResult]:
        return await storage_call(self, functools.partial(
            self.wait_for_runs, ids, timeout=timeout))

    def _event(self, type: str, payload: dict[str, Any] | None) -> transitions.EmitWrite:
        """The write of one event, checked (the checks cost no database)."""
        control = self._control
        control.check()
        check_short_text(type, "Event type", 100)
        payload = {} if payload is None else payload
        capped_json(payload, f"Payload of event {type!r}", "MAX_EVENT_BYTES")
        event_id = transitions.emitted_event_id(self.run_id, control.checkpoints, control.position)
        control.position += 1
        return transitions.EmitWrite(control.ref, event_id, type, payload,
                                     max_events=int(app_settings.MAX_EVENTS_PER_RUN))

    def _checkpoint(self, state: Any) -> transitions.CheckpointWrite:
        control = self._control
        control.check()
        capped_json(state, "Checkpoint state", "MAX_STATE_BYTES")
        return transitions.CheckpointWrite(control.ref, state, control.checkpoints + 1,
                                           max_events=int(app_settings.MAX_EVENTS_PER_RUN))

    def _saved(self, state: Any) -> None:
        self._control.checkpoints += 1
        self._control.position = 0
        self.state = state


async def storage_call(ctx: RunContext, func: Callable[..., T], *args: Any) -> T:
    """Run a synchronous call that uses the database off the event loop, as `aemit` and
    the other async context calls do (for code built on an async agent, like the tasks
    runner)."""
    from .control import in_thread

    return await in_thread(ctx._control, func, *args)

