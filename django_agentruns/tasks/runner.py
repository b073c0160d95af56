"""The two internal agents that run `@task` functions, registered when this module imports.

Each attempt: import the task by path, send `task_started`, call it (with a `TaskContext`
if it takes one), send `task_finished` (also when it raises, from inside the handler), and
return its JSON return value or re-raise. The worker then settles the run as for any
agent: an exception is classified by `policy.classify`, so `Retryable`, timeouts and 5xx
are retried within the budget and the rest dead-letter.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import close_old_connections
from django.utils import timezone

from ..registry import agent, get_agent
from . import compat
from .results import ASYNC_AGENT, SYNC_AGENT, as_enqueued, load_task, read_result

if TYPE_CHECKING:
    from ..context import RunContext

T = TypeVar("T")


@agent(SYNC_AGENT)
def run_task(ctx: RunContext) -> Any:
    attempt = Attempt.begin(ctx, SYNC_AGENT)
    try:
        value = attempt.returned(attempt.call())
    except Exception as exc:
        attempt.finish(exc)
        raise
    attempt.finish(None, value)
    return value


@agent(ASYNC_AGENT)
async def run_async_task(ctx: RunContext) -> Any:
    # The ORM and the signal receivers are synchronous: they run off the event loop. The
    # task itself runs on the worker's loop, where a cancel or a shutdown cancels it.
    attempt = await _off_loop(Attempt.begin, ctx, ASYNC_AGENT)
    try:
        value = attempt.returned(await attempt.acall())
    except Exception as exc:
        await _off_loop(attempt.finish, exc)
        raise
    await _off_loop(attempt.finish, None, value)
    return value


class Attempt:
    """One attempt at a task: its `TaskResult`, as the task and the signals see it."""

    def __init__(self, agent_name: str, run_id: int, task: compat.Task[Any, Any],
                 result: compat.TaskResult[Any, Any]) -> None:
        self.agent_name = agent_name
        self.run_id = run_id
        self.task = task
        self.result = result

    @classmethod
    def begin(cls, ctx: RunContext, agent_name: str) -> Attempt:
        from ..models import AgentRun
        from .backend import AgentRunsBackend

        payload = ctx.input if isinstance(ctx.input, dict) else {}
        run = AgentRun.objects.get(pk=ctx.run_id)
        task = as_enqueued(load_task(payload.get("task")), run)
        attempt = cls(agent_name, ctx.run_id, task, read_result(run, task))
        compat.task_started.send(sender=AgentRunsBackend, task_result=attempt.result)
        return attempt

    def _arguments(self) -> tuple[list[Any], dict[str, Any]]:
        args = list(self.result.args)
        if self.task.takes_context:
            args.insert(0, compat.TaskContext(task_result=self.result))
        return args, dict(self.result.kwargs)

    def call(self) -> Any:
        args, kwargs = self._arguments()
        return self.task.call(*args, **kwargs)

    async def acall(self) -> Any:
        args, kwargs = self._arguments()
        return await self.task.acall(*args, **kwargs)

    def returned(self, value: Any) -> Any:
        """The return value as JSON (tuples become lists, as Django does), or a clear error."""
        from ..context import ensure_json
        from ..exceptions import InvalidInputError

        try:
            normal = compat.normalize_json(value)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"Return value of task {self.task.module_path!r} must be "
                                    f"JSON-serialisable: {exc}") from exc
        return ensure_json(normal, f"Return value of task {self.task.module_path!r}")

    def finish(self, error: Exception | None, value: Any = None) -> None:
        """Send `task_finished`: SUCCESSFUL, or for an error FAILED, or READY when the
        error will be retried (what `get_result` reads once the worker has settled)."""
        from ..execution import describe
        from .backend import AgentRunsBackend

        result, statuses = self.result, compat.TaskResultStatus
        if error is None:
            status = statuses.SUCCESSFUL
            object.__setattr__(result, "_return_value", value)
        else:
            status = statuses.READY if self._will_retry(error) else statuses.FAILED
            info = describe(error)
            result.errors.append(compat.TaskError(
                exception_class_path=f"{type(error).__module__}.{type(error).__qualname__}",
                traceback=info.traceback))
        object.__setattr__(result, "status", status)
        if status != statuses.READY:
            object.__setattr__(result, "finished_at", timezone.now())
        compat.task_finished.send(sender=AgentRunsBackend, task_result=result)

    def _will_retry(self, error: Exception) -> bool:
        """The decision the worker is about to store, taken by the same pure policy."""
        from .. import policy
        from ..execution import classify_for
        from ..models import AgentRun

        row = AgentRun.objects.filter(pk=self.run_id).values(
            "requeue_count", "max_requeues", "cancel_requested_at").first()
        if row is None:
            return False
        decision = policy.decide(
            classify_for(get_agent(self.agent_name), error),
            requeue_count=row["requeue_count"], max_requeues=row["max_requeues"],
            cancel_requested=row["cancel_requested_at"] is not None,
            backoff_delay=lambda n: 0.0)  # how long does not matter here, only whether
        return decision.action == "retry"


async def _off_loop(func: Callable[..., T], *args: Any) -> T:
    """Run a synchronous call on an executor thread, whose connection obeys CONN_MAX_AGE."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, functools.partial(_call, func, *args))


def _call(func: Callable[..., T], *args: Any) -> T:
    close_old_connections()
    try:
        return func(*args)
    finally:
        close_old_connections()
