"""The attempt's side of waiting: `ctx.receive`, approvals, child runs.

Each call is one fenced write (`transitions.waiting`). What is already there comes back at
once; otherwise the run becomes `waiting`, its lease released, and the attempt ends by
`AttemptStopped` (a BaseException, so an agent's `except Exception` lets it through). The
next attempt resumes from the last checkpoint and, reaching the same call, gets its answer.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from django.utils import timezone

from ..api import RunRequest, build_new_run, run_id_of
from ..exceptions import AttemptStopped, InvalidInputError, WaitTimedOut
from ..outcomes import Approval, Renewal, RunResult, StopReason, Waited, WaitState
from ..validation import capped_json, check_key, deadline_after

if TYPE_CHECKING:
    from .context import RunContext
    from .control import AttemptControl

def _control(ctx: RunContext) -> AttemptControl:
    control = ctx._control
    if control.done.is_set():
        raise InvalidInputError("receive, spawn and wait_for_runs are calls of a running "
                                "attempt; this one has ended")
    control.check()
    return control


def _wait(ctx: RunContext, key: str, **how: Any) -> Waited:
    """The fenced wait; returns only what the attempt goes on with (READY)."""
    from ..transitions import waiting

    control = _control(ctx)
    call = cast(Any, control.call)  # its writes return a Renewal; this one a Waited
    waited: Waited = call(functools.partial(waiting.wait_for, control.ref, key, **how))
    if waited.state is WaitState.READY:
        return waited
    if waited.state is WaitState.TIMED_OUT:
        raise WaitTimedOut(key)
    if waited.state is WaitState.WOULD_WAIT:
        raise InvalidInputError(f"run_now cannot wait for {key!r}: it holds no lease and "
                                f"no worker would resume it; enqueue the agent instead")
    if waited.state is WaitState.WAITING:
        control.end_waiting()
        raise AttemptStopped(StopReason.WAITING)
    control.apply(Renewal.LOST if waited.state is WaitState.LOST
                  else Renewal.CANCEL_REQUESTED)
    raise AssertionError("unreachable: apply() raised")


def receive(ctx: RunContext, key: str, *, timeout: Any = None, prompt: Any = None,
            kind: str = "input") -> Any:
    """The JSON payload delivered for `key`; if there is none yet, wait for it.

    Raises `WaitTimedOut` in the attempt that resumes once `timeout` seconds passed.
    """
    key = check_key(key)
    if prompt is not None:
        capped_json(prompt, f"Prompt of {key!r}", "MAX_EVENT_BYTES")
    deadline = deadline_after(timeout)
    return _wait(ctx, key, kind=kind, prompt=prompt, deadline=deadline).payload


def request_approval(ctx: RunContext, key: str, proposal: Any, *,
                     timeout: Any = None) -> Approval:
    """Wait for `approve` or `reject` of `proposal` (shown to the approver in the admin)."""
    answer = receive(ctx, key, timeout=timeout, prompt={"proposal": proposal},
                     kind="approval")
    if not isinstance(answer, dict) or not isinstance(answer.get("approved"), bool):
        raise InvalidInputError(f"the answer delivered for approval {key!r} is not an "
                                f"approval (use approve() or reject()): {answer!r:.200}")
    edited = answer.get("proposal")
    return Approval(approved=answer["approved"], by=str(answer.get("by", "")),
                    note=str(answer.get("note", "")),
                    proposal=proposal if edited is None else edited)


def spawn(ctx: RunContext, agent: str, input: Any = None, *, key: str,
          queue: str | None = None, scope: str | None = None,
          priority: int | None = None, budget: dict[str, Any] | None = None) -> int:
    """Enqueue a child run in the attempt's fenced write; the same `key` returns the same
    child in any later attempt of this run, never a second one.

    The child has its own budget (`budget`, else its agent's): what it spends does not
    count against the parent's. Past MAX_CHILDREN_PER_RUN children of this run, or
    MAX_SPAWN_DEPTH levels below the root run, a new child is refused (LimitExceeded)."""
    from ..conf import app_settings
    from ..rules.limits import check_budget
    from ..transitions import children

    key = check_key(key, "spawn key")
    checked = check_budget(budget)
    # No scope by default: the parent's own would hold an ordered child behind the parent.
    request = RunRequest(agent, input, scope="" if scope is None else scope,
                             queue=queue, priority=priority)
    new = build_new_run(request, timezone.now(), {})
    control = _control(ctx)
    call = cast(Any, control.call)
    renewal, child = call(functools.partial(
        children.spawn, control.ref, key, new,
        budget=None if checked is None else checked.as_dict(),
        max_depth=int(app_settings.MAX_SPAWN_DEPTH),
        max_children=int(app_settings.MAX_CHILDREN_PER_RUN)))
    control.apply(renewal)
    assert child is not None
    return int(child)


def wait_for_runs(ctx: RunContext, ids: Iterable[int], *,
                  timeout: Any = None) -> dict[int, RunResult]:
    """Each child run's result, once every one is finished; until then the run waits."""
    from ..transitions import waiting

    try:
        wanted = sorted({api_id(i) for i in ids})
    except TypeError:
        raise InvalidInputError(f"ids must be run ids, not {ids!r:.120}") from None
    if not wanted:
        return {}
    deadline = deadline_after(timeout)
    key = waiting.runs_key(wanted)
    return _wait(ctx, key, kind="runs", prompt={"runs": wanted}, deadline=deadline,
                 children=wanted).runs


def api_id(value: Any) -> int:
    return run_id_of(value)
