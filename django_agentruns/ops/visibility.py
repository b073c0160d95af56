"""Why a run is not starting: the due query's reasons, said in words. Read-only.

`why_not_started` asks the same questions the due query (`transitions.due_queued`) and the
claim ask, one at a time, and says which ones hold a run back. It only reads: it is safe
to call from the admin, a shell or `manage.py why` on a live system.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count
from django.utils import timezone

from .. import transitions
from ..models import AgentLimit, AgentRun, PausedQueue, Status
from ..queries import reading
from ..registry import claimable_version, find_agent
from ..rules.windows import KeyLimits, resolve, row_limits
from . import workers

NOT_QUEUED = "not_queued"
UNKNOWN_AGENT = "unknown_agent"
CANCEL_REQUESTED = "cancel_requested"
WAITING = "waiting"
BLOCKED = "blocked"
PAUSED = "paused"
KEY_CLOSED = "key_closed"
KEY_FULL = "key_full"
KEY_WINDOW = "key_window"
VERSION = "version"


@dataclass(frozen=True)
class Hold:
    """One reason a run is not starting. `blocker` is the run holding its scope, if any."""

    code: str
    message: str
    blocker: int | None = None
    blocker_status: str | None = None

    def __str__(self) -> str:
        return self.message


def why_not_started(run: AgentRun | int, at: datetime | None = None) -> list[Hold]:
    """Every reason `run` is not starting now; empty if it is due and a worker may take it.

    A run that is not queued gives one reason, its status. A queued run may have several:
    an unknown agent, a pending cancel request, a due time still ahead, its queue paused,
    an earlier run of its scope holding it back (ordered agents).
    """
    at = at or timezone.now()
    if not isinstance(run, AgentRun):
        run = AgentRun.objects.for_reading().get(pk=run)
    if run.status != Status.QUEUED:
        return [Hold(NOT_QUEUED, _not_queued(run, at))]
    holds = []
    spec = find_agent(run.agent)
    if spec is None:
        holds.append(Hold(UNKNOWN_AGENT, _unknown_agent(run, at)))
    elif not claimable_version(spec, run.agent_version):
        holds.append(Hold(VERSION, _version(run, spec.version)))
    if run.cancel_requested_at is not None:
        holds.append(Hold(CANCEL_REQUESTED, f"a cancel was requested at "
                                            f"{_when(run.cancel_requested_at)}"
                                            f"{_because(run.cancel_reason)}"))
    if run.available_at > at:
        seconds = (run.available_at - at).total_seconds()
        what = "retry backoff" if run.requeue_count else \
            "snoozed" if run.snooze_count else "run_after"
        holds.append(Hold(WAITING, f"waiting until {_when(run.available_at)} "
                                   f"({seconds:.1f}s from now, {what})"))
    pause = reading(PausedQueue.objects.filter(name=run.queue)).first()
    if pause is not None:
        holds.append(Hold(PAUSED, f"its queue {run.queue!r} was paused at "
                                  f"{_when(pause.paused_at)}"
                                  + (f" by {pause.paused_by}" if pause.paused_by else "")
                                  + " (resume_queue / manage.py queues resume)"))
    if spec is not None and spec.ordered:
        blocker = _scope_holder(run, spec.dead_letters_block)
        if blocker is not None:
            holds.append(_blocked(run, blocker, at))
    key = key_hold(run, at)
    if key is not None:
        holds.append(key)
    return holds


def key_hold(run: AgentRun, at: datetime) -> Hold | None:
    """Whether the run's limit key holds it back: closed (a 429), or at its limit."""
    if not run.limit_key:
        return None
    row = reading(AgentLimit.objects.filter(key=run.limit_key)).first()
    if row is None:
        return None  # no row: the key is unlimited
    if row.closed_until is not None and row.closed_until > at:
        seconds = (row.closed_until - at).total_seconds()
        return Hold(KEY_CLOSED, f"its limit key {row.key!r} is closed until "
                                f"{_when(row.closed_until)} ({seconds:.1f}s from now"
                                f"{_because(row.closed_reason)})")
    limits = key_limits(row)
    if limits.windowed:
        full = transitions.full_window(limits, transitions.window_use([row.key], at).get(
            row.key, transitions.WindowUse()), at)
        if full is not None:
            when = "" if full.room_at is None else \
                f"; it has room at {_when(full.room_at)}"
            return Hold(KEY_WINDOW, f"waiting for the {full.window} window of its limit key "
                                    f"{row.key!r}: {full.text}{when}")
    cap = limits.max_running
    if cap is None:
        return None
    running = AgentRun.objects.for_reading().filter(status=Status.RUNNING,
                                                    limit_key=row.key).count()
    if running < cap:
        return None
    return Hold(KEY_FULL, f"waiting for its limit key {row.key!r}: {running} of its runs are "
                          f"running, its limit is {cap}")

def count_due_elsewhere(
    queues: Iterable[str] | None, agents: frozenset[str], at: datetime | None = None, *,
    replica: bool = False,
) -> dict[tuple[str, str], int]:
    """Due runs a worker with only `agents` leaves queued, by (queue, agent): of any queue,
    or of `queues`. One grouped COUNT over the queued runs (`replica`: on the read
    database, for a gauge)."""
    due = transitions.due_elsewhere(queues, at or timezone.now(), agents)
    rows = ((reading(due) if replica else due).order_by()
            .values_list("queue", "agent").annotate(n=Count("id")))
    return {(queue, agent): n for queue, agent, n in rows}


def _unknown_agent(run: AgentRun, at: datetime) -> str:
    # This process cannot see which agents the workers have: it says what it knows.
    name = repr(run.agent)
    text = f"its agent {name} is not registered in this process: a worker only claims runs " \
           "of agents it has"
    if run.available_at <= at:
        text = f"run #{run.pk} is queued and due, but {text}, and no worker that knows " \
               f"{name} has claimed it"
    return f"{text}; check that a worker with {name} deployed serves queue {run.queue!r}"


def _version(run: AgentRun, here: int) -> str:
    if run.agent_version > here:
        return (f"it started under version {run.agent_version} of {run.agent!r}, newer than "
                f"version {here} registered here: only a worker with version "
                f"{run.agent_version} or later claims it")
    return (f"it started under version {run.agent_version} of {run.agent!r}; version {here} "
            f"registered here has no migrate, so it waits for a worker with version "
            f"{run.agent_version}")


def _scope_holder(run: AgentRun, dead_letters_block: bool) -> AgentRun | None:
    """The first run ahead of `run` in its scope's firing order that holds the scope."""
    return (AgentRun.objects.for_reading().ahead_of(run.agent, run.scope, run.fired_seq, run.pk)
            .holding(dead_letters_block).order_by("fired_seq", "id").first())


def _blocked(run: AgentRun, blocker: AgentRun, at: datetime) -> Hold:
    scope = f"scope {run.scope!r}" if run.scope else "the empty scope"
    text = (f"blocked by run #{blocker.pk} ({blocker.status}), ahead of it in firing order "
            f"in {scope}")
    if blocker.status == Status.FAILED:
        text += (f"; it is dead-lettered ({blocker.reason}) and {run.agent!r} lets dead "
                 "letters block its scope: retry or cancel it to go on")
    elif blocker.status == Status.QUEUED and blocker.available_at > at:
        text += f"; it is waiting until {_when(blocker.available_at)}"
    elif blocker.status == Status.RUNNING and blocker.lease_expires is not None \
            and blocker.lease_expires < at:
        text += f"; it is stuck ({_stuck(blocker, at)})"
    return Hold(BLOCKED, text, blocker=blocker.pk, blocker_status=blocker.status)


def _not_queued(run: AgentRun, at: datetime) -> str:
    text = f"run #{run.pk} is {run.status}, not queued"
    if run.status == Status.RUNNING:
        text += f" (attempt {run.attempt}, worker {run.claimed_by or '?'}"
        if run.lease_expires is None:
            text += ", interactive: no lease)"
        elif run.lease_expires < at:
            text += f", {_stuck(run, at)})"
        else:
            text += f", lease until {_when(run.lease_expires)})"
        if run.cancel_requested_at is not None:
            text += f"; a cancel was requested at {_when(run.cancel_requested_at)}"
    elif run.reason:
        text += f" ({run.reason})"
    return text


def _stuck(run: AgentRun, at: datetime) -> str:
    """A lapsed lease: taken back only if a live worker (or a cron reap) will do it."""
    lapsed = workers.lapse(run, workers.live_ids(at), at) or "lease lapsed"
    return f"{lapsed}; {workers.rescuer(run, workers.Coverage.read(at)) or workers.NOBODY_REAPS}"


def _when(value: datetime) -> str:
    return value.isoformat(timespec="milliseconds")


def _because(reason: str) -> str:
    return f": {reason}" if reason else ""


def key_limits(row: AgentLimit) -> KeyLimits:
    """A limits row's limits in force (its own, its pattern's, the setting's)."""
    patterns = {r.key: row_limits(r) for r in reading(AgentLimit.objects.filter(key__endswith="*"))}
    return resolve(row.key, row_limits(row), patterns)
