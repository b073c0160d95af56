"""The two internal agents that run `@task` functions, registered when this module imports.

Each attempt: import the task by path, send `task_started`, call it (with a `TaskContext`
if it takes one), and return its JSON return value or re-raise. The worker then settles the
run as for any agent: an exception is classified by `policy.classify`, so `Retryable`,
timeouts and 5xx are retried within the budget and the rest dead-letter.

`task_finished` is sent from what the worker wrote, not from a guess at it: the attempt
keeps how it ended (`Attempt.finish`), and the settle signal for that run and attempt
(`run_succeeded`, `run_requeued`, `run_dead_lettered`, `run_cancelled`) sends it with the
matching status, once the outcome has committed. A task's `SystemExit` or
`KeyboardInterrupt` is its failure too (the worker records it as one), so it sends
`task_finished` as any exception does. An attempt that was stopped (cancel, shutdown, lost
lease) never reaches `finish`, and a lost lease writes nothing: neither sends
`task_finished`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from .. import signals
from ..registry import agent
from ..runtime.context import storage_call
from . import compat
from .results import ASYNC_AGENT, SYNC_AGENT, TASK_AGENTS, as_enqueued, load_task, read_result

if TYPE_CHECKING:
    from ..runtime.context import RunContext

# What a task may raise that ends its attempt as a failure. Not AttemptStopped nor
# asyncio's CancelledError: the worker stopped the attempt, the task did not fail.
TASK_FAILURES = (Exception, SystemExit, KeyboardInterrupt)


@agent(SYNC_AGENT)
def run_task(ctx: RunContext) -> Any:
    attempt = Attempt.begin(ctx)
    try:
        value = attempt.returned(attempt.call())
    except TASK_FAILURES as exc:
        attempt.finish(exc)
        raise
    attempt.finish(None, value)
    return value


@agent(ASYNC_AGENT)
async def run_async_task(ctx: RunContext) -> Any:
    # The ORM and the signal receivers are synchronous: they run off the event loop. The
    # task itself runs on the worker's loop, where a cancel or a shutdown cancels it.
    attempt = await storage_call(ctx, Attempt.begin, ctx)
    try:
        value = attempt.returned(await attempt.acall())
    except TASK_FAILURES as exc:
        attempt.finish(exc)
        raise
    attempt.finish(None, value)
    return value


class Attempt:
    """One attempt at a task: its `TaskResult`, as the task and the signals see it."""

    def __init__(self, run_id: int, attempt: int, task: compat.Task[Any, Any],
                 result: compat.TaskResult[Any, Any]) -> None:
        self.run_id = run_id
        self.attempt = attempt
        self.task = task
        self.result = result
        self.error: BaseException | None = None

    @classmethod
    def begin(cls, ctx: RunContext) -> Attempt:
        from ..models import AgentRun
        from .backend import AgentRunsBackend

        payload = ctx.input if isinstance(ctx.input, dict) else {}
        run = AgentRun.objects.get(pk=ctx.run_id)
        task = as_enqueued(load_task(payload.get("task")), run)
        attempt = cls(ctx.run_id, ctx.attempt, task, read_result(run, task))
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
        """The return value as JSON (tuples become lists, as Django does), or the error
        Django's contract names: a TypeError (ValueError for undecodable bytes). Caused by
        a NotRetryable, so the policy does not retry it: it would fail the same way."""
        from ..exceptions import NotRetryable
        from ..validation import ensure_json

        what = f"Return value of task {self.task.module_path!r}"
        try:
            normal = compat.normalize_json(value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{what} must be JSON-serialisable: {exc}") from NotRetryable(
                "a return value that is not JSON fails every attempt alike")
        return ensure_json(normal, what)

    def finish(self, error: BaseException | None, value: Any = None) -> None:
        """Keep how the task ended; `task_finished` goes once the worker has written it."""
        from ..runtime.recording import describe

        result = self.result
        self.error = error
        if error is None:
            object.__setattr__(result, "_return_value", value)
        else:
            result.errors.append(compat.TaskError(
                exception_class_path=f"{type(error).__module__}.{type(error).__qualname__}",
                traceback=describe(error).traceback))
        with _ended_lock:
            _ended[(self.run_id, self.attempt)] = self
        _listen()

    def announce(self, status: compat.TaskResultStatus) -> None:
        """Send `task_finished` with the status the stored outcome reads as."""
        from .backend import AgentRunsBackend

        object.__setattr__(self.result, "status", status)
        if status != compat.TaskResultStatus.READY:
            object.__setattr__(self.result, "finished_at", timezone.now())
        error, self.error = self.error, None
        if error is None:
            compat.task_finished.send(sender=AgentRunsBackend, task_result=self.result)
            return
        # Django's receivers read the task's exception from sys.exc_info(), as its own
        # backends send the signal inside their except block (its ERROR line carries the
        # traceback): send it from inside one, with the exception the task raised.
        try:
            raise error
        except BaseException:
            compat.task_finished.send(sender=AgentRunsBackend, task_result=self.result)


# Attempts that returned or raised, by (run id, attempt), until their settle signal. An
# entry whose outcome this process never writes (its write failed; another process reaped
# the run) stays: one small object per such failure.
_ended: dict[tuple[int, int], Attempt] = {}
_ended_lock = threading.Lock()

# What each settle signal reads as; None: nothing was written, nothing to announce.
SETTLED_AS = {
    signals.run_succeeded: "SUCCESSFUL",
    signals.run_requeued: "READY",  # retried: what `get_result` reads until the next attempt
    signals.run_dead_lettered: "FAILED",
    signals.run_cancelled: "FAILED",
    signals.run_lease_lost: None,
}


def _settled(signal: Any, run_id: int, agent: str, attempt: int, **kwargs: Any) -> None:
    if agent not in TASK_AGENTS:
        return
    with _ended_lock:
        ended = _ended.pop((run_id, attempt), None)
    status = SETTLED_AS.get(signal)
    if ended is not None and status is not None:
        ended.announce(compat.TaskResultStatus[status])


_listening = False


def _listen() -> None:
    """Connect `_settled` to the settle signals, at the first task attempt that ends in
    this process: until then no attempt of a task waits for one, and a worker that imports
    this module (any project with the tasks backend) but runs only agents would pay a
    receiver's call on every run's settle."""
    global _listening
    if _listening:
        return
    for signal in SETTLED_AS:
        signal.connect(_settled, dispatch_uid="django_agentruns.tasks.runner")
    _listening = True
