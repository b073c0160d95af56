"""`run_now`: one run, here and now, in the caller's process: no worker, no lease."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from django.utils import timezone

from .. import transitions
from ..api import RunRequest, build_new_run
from ..models import AgentRun
from ..outcomes import OutcomeKind
from ..registry import AgentSpec, get_agent
from ..transitions import AttemptRef
from . import usage
from .executor import AttemptControl, Executor, stopped_error


def run_now(agent: str, input: Any = None, *, scope: str = "") -> Any:
    """Run an agent here and now, without a lease; return its output or raise its error.

    The run and its events are recorded like any other; a failure is not retried (the
    caller has the exception) and the reaper never touches the run.
    """
    spec: AgentSpec = get_agent(agent)
    at = timezone.now()
    new = build_new_run(RunRequest(agent, input, scope), at, {})
    run = AgentRun(agent=new.agent, agent_version=new.agent_version, queue=new.queue,
                   priority=new.priority, scope=new.scope, fired_seq=new.fired_seq,
                   max_requeues=new.max_requeues, available_at=new.available_at,
                   created_at=at)
    run.input = new.input  # a payload row, saved with the run
    worker_id = f"interactive:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    transitions.start_interactive(run, worker_id)
    ref = AttemptRef(run.pk, 1, worker_id, lease_ttl=None, agent=run.agent)
    control = AttemptControl(ref, spec.timeout, checkpoints=0)
    usage.arm(control, run, spec)  # flow control: the run's budget
    outcome = Executor(worker_id).interactive(spec, run, control)
    if outcome.kind is OutcomeKind.FAILED:
        assert outcome.error is not None
        raise outcome.error
    if outcome.kind is OutcomeKind.STOPPED:
        raise stopped_error(spec, outcome)
    return outcome.output
