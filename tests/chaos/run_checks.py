"""The chaos suite's checks of one run at a time: its event stream replayed through the
state machine, its outcome against its plan, and its side effects.

`tests.chaos.invariants.check_all` calls them for every planned run; its docstring says
which clock each check may trust.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from django_agentruns import transitions as t
from django_agentruns.models import AgentRun, Reason, RunEvent, Status

if TYPE_CHECKING:
    from tests.chaos.invariants import Checker, PlannedRun
    from tests.testapp.models import SideEffect

# Timestamps of one machine's clock, written by different processes: allow for a lease
# keeper's renewal that computed its time a moment before an emit's renewal landed first.
CLOCK_SLACK = timedelta(milliseconds=50)
# run.interrupted (the database was out of reach, a graceful stop) and run.snoozed end an
# attempt too, spending no budget.
SETTLING = {t.SUCCEEDED, t.RETRYING, t.DEAD_LETTERED, t.CANCELLED, t.INTERRUPTED, t.SNOOZED}
FREE = {t.INTERRUPTED, t.SNOOZED}
TERMINAL_EVENTS = {t.SUCCEEDED: Status.SUCCEEDED, t.DEAD_LETTERED: Status.FAILED,
                   t.CANCELLED: Status.CANCELLED}
ATTEMPT_WRITES = {"step", t.CHECKPOINT, t.CANCEL_REQUESTED, t.STEP}
# Waiting (tests/chaos/waits.py checks them): a delivery and a resume may come at any time,
# a live attempt or none; run.waiting ends the live attempt without a settlement.
WAIT_STORY = {t.waiting.DELIVERED, t.waiting.RESUMED, t.waiting.WAIT_TIMED_OUT}
WORKER_PID = re.compile(r":(\d+):[0-9a-f]+$")
ATTEMPT_IN_MESSAGE = re.compile(r"\battempt (\d+)\b")
TIMEOUT_ERROR = "django_agentruns.exceptions.AttemptTimeout"


@dataclass
class Attempt:
    number: int
    started: RunEvent
    worker_pid: str
    last_renewal: datetime
    ended_by: str = ""  # the settling event's type, or "" while live


def check_lifecycle(
    checker: Checker, run: AgentRun, stream: list[RunEvent], ttl: timedelta,
    timeout: float | None = None,
) -> dict[int, Attempt]:
    """Replay the run's events through the state machine; one live attempt at a time.

    Returns the attempts seen, by number. An attempt's writes (step events, checkpoints)
    must fall between its `run.started` and its settlement; attempt n+1 may start only
    after attempt n settled; a takeover (`run.abandoned`, lease lapsed) must come after the
    attempt's lease ran out; exactly one terminal event ends the stream, and the row agrees.
    """
    rid = f"run {run.pk} ({run.agent})"
    attempts: dict[int, Attempt] = {}
    live: Attempt | None = None
    abandoned = False  # a run.abandoned awaits its retry / dead letter / cancel
    terminal: RunEvent | None = None
    requeues = 0
    snoozes = 0
    cancel_requested = False
    checkpoints: list[int] = []
    for event in stream:
        where = f"{rid} event #{event.seq} {event.type} (attempt {event.attempt})"
        if not checker.check(terminal is None, f"{where} after its settlement {terminal}"):
            continue
        if abandoned and not checker.check(event.type in SETTLING - {t.SUCCEEDED} - FREE,
                                           f"{where} right after run.abandoned"):
            continue
        if event.type == t.STARTED:
            checker.check(live is None, f"{where}: two attempts live, attempt "
                                        f"{live.number if live else '?'} was not settled")
            checker.check(event.attempt == len(attempts) + 1,
                          f"{where}: attempts must count up from 1, after {len(attempts)}")
            worker = str(event.payload.get("worker", ""))
            match = WORKER_PID.search(worker)
            live = Attempt(event.attempt, event, match.group(1) if match else worker,
                           event.created_at)
            attempts[event.attempt] = live
            continue
        if event.type == t.CANCELLED and live is None:
            terminal = event  # cancelled while queued or waiting
            continue
        if event.type in WAIT_STORY:
            continue
        if not checker.check(live is not None and event.attempt == live.number,
                             f"{where}: written while attempt "
                             f"{live.number if live else 'none'} was the live one"):
            if event.type in TERMINAL_EVENTS:
                terminal = event  # reported; do not call the run lost as well
            continue
        assert live is not None
        if event.type in ATTEMPT_WRITES:
            checker.check(not abandoned, f"{where} after the attempt was abandoned")
            if event.type == t.CANCEL_REQUESTED:
                cancel_requested = True
            else:
                live.last_renewal = event.created_at
            if event.type == t.CHECKPOINT:
                checkpoints.append(int(event.payload.get("count", -1)))
        elif event.type == t.waiting.WAITING:
            checker.check(not abandoned and not cancel_requested,
                          f"{where}: waits though abandoned or asked to cancel")
            live.ended_by = event.type
            live = None
        elif event.type == t.ABANDONED:
            abandoned = True
            if event.payload.get("why") == "lease lapsed":
                checker.check(
                    event.created_at > live.last_renewal + ttl - CLOCK_SLACK,
                    f"{where}: taken over at {event.created_at:%H:%M:%S.%f}, before the lease "
                    f"of its last write at {live.last_renewal:%H:%M:%S.%f} (+{ttl}) lapsed")
        elif event.type in SETTLING:
            checker.check(not (event.type == t.SUCCEEDED and abandoned),
                          f"{where}: succeeded after being abandoned")
            check_failure_is_the_attempts(checker, where, event, live, timeout)
            live.ended_by = event.type
            live, abandoned = None, False
            if event.type == t.RETRYING:
                requeues += 1
                checker.check(not cancel_requested, f"{where}: retried despite a cancel request")
                checker.check(event.payload.get("requeue") == requeues,
                              f"{where}: payload says requeue {event.payload.get('requeue')}, "
                              f"the stream {requeues}")
            elif event.type == t.SNOOZED:
                snoozes += 1
                checker.check(not cancel_requested, f"{where}: snoozed despite a cancel request")
            elif event.type != t.INTERRUPTED:
                terminal = event
        else:
            checker.check(False, f"{where}: unexpected event type")
    checker.check(terminal is not None, f"{rid} is lost: status {run.status}, no settlement "
                                        f"after {len(stream)} events")
    checker.check(sum(e.type in TERMINAL_EVENTS for e in stream) <= 1,
                  f"{rid} settled more than once: {[e.type for e in stream]}")
    if terminal is not None:
        checker.check(run.status == TERMINAL_EVENTS[terminal.type],
                      f"{rid}: status {run.status} but its settlement is {terminal.type}")
        if terminal.type == t.DEAD_LETTERED:
            checker.check(run.reason == terminal.payload.get("reason"),
                          f"{rid}: reason {run.reason!r}, event says "
                          f"{terminal.payload.get('reason')!r}")
    checker.check(run.attempt == len(attempts),
                  f"{rid}: row says attempt {run.attempt}, the stream {len(attempts)}")
    checker.check(run.requeue_count == requeues,
                  f"{rid}: requeue_count {run.requeue_count}, run.retrying events {requeues}")
    checker.check(run.snooze_count == snoozes,
                  f"{rid}: snooze_count {run.snooze_count}, run.snoozed events {snoozes}")
    checker.check(run.requeue_count <= run.max_requeues,
                  f"{rid}: requeue_count {run.requeue_count} over the budget {run.max_requeues}")
    checker.check(checkpoints == list(range(1, len(checkpoints) + 1)),
                  f"{rid}: checkpoint counts {checkpoints} are not 1..n in order")
    checker.check(run.checkpoint_count == len(checkpoints),
                  f"{rid}: checkpoint_count {run.checkpoint_count}, events {len(checkpoints)}")
    return attempts


def check_failure_is_the_attempts(checker: Checker, where: str, event: RunEvent,
                                  live: Attempt, timeout: float | None) -> None:
    """A settlement's error came from the attempt it is recorded for.

    A stale attempt settling under a newer one's feet would be recorded with the row's
    attempt number; its error gives it away: the chaos agents name their attempt in their
    errors, and no attempt times out sooner than its agent's timeout.
    """
    message = str(event.payload.get("message", ""))
    named = ATTEMPT_IN_MESSAGE.search(message)
    if named:
        checker.check(int(named.group(1)) == event.attempt,
                      f"{where}: the error is attempt {named.group(1)}'s: {message!r}")
    if timeout and event.payload.get("error_type") == TIMEOUT_ERROR:
        ran = (event.created_at - live.started.created_at).total_seconds()
        checker.check(ran >= timeout - CLOCK_SLACK.total_seconds(),
                      f"{where}: timed out after {ran:.3f}s, its timeout is {timeout}s")


def check_outcome(checker: Checker, run: AgentRun, planned: PlannedRun,
                  cancel_result: str | None) -> None:
    """The run ended as its plan allows; dead letters carry the right reason."""
    rid = f"run {run.pk} ({planned.kind})"
    if run.status == Status.SUCCEEDED:
        checker.check(run.output == {"steps": planned.steps},
                      f"{rid}: output {run.output!r}")
        checker.check(planned.kind not in ("fatal", "doomed"),
                      f"{rid} succeeded though it fails every time it gets there")
    elif run.status == Status.FAILED:
        checker.check(run.reason in planned.allowed_dead_letters(),
                      f"{rid}: dead-lettered {run.reason!r}, allowed "
                      f"{sorted(planned.allowed_dead_letters())}")
        if run.reason == Reason.RETRIES_EXHAUSTED:
            checker.check(run.requeue_count == run.max_requeues,
                          f"{rid}: retries_exhausted after {run.requeue_count} of "
                          f"{run.max_requeues} requeues")
        if run.reason == Reason.NOT_RETRYABLE:
            checker.check(run.error_type == "django_agentruns.exceptions.NotRetryable",
                          f"{rid}: not_retryable for a {run.error_type}")
    if cancel_result in ("cancelled", "requested"):
        allowed = {Status.CANCELLED} | ({Status.SUCCEEDED} if cancel_result == "requested"
                                        else set())
        checker.check(run.status in allowed,
                      f"{rid}: cancel() answered {cancel_result}, the run ended {run.status}")
    else:
        checker.check(run.status != Status.CANCELLED, f"{rid} cancelled, but nobody did")


def check_effects(
    checker: Checker, run: AgentRun, planned: PlannedRun, stream: list[RunEvent],
    effects: list[SideEffect], attempts: Mapping[int, Attempt],
) -> None:
    """Side effects are fenced, deduplicated by the checkpoint, and complete on success.

    Each step's effect exists at most once (it commits with the step's checkpoint, and the
    next attempt resumes after it); it was written by the worker of a live attempt, before
    the next attempt started; a succeeded run has one for every step.
    """
    rid = f"run {run.pk} ({planned.kind})"
    per_step = Counter(e.step for e in effects)
    checker.check(all(n == 1 for n in per_step.values()),
                  f"{rid}: steps executed with effect more than once: "
                  f"{ {s: n for s, n in per_step.items() if n > 1} }")
    fenced = {(e.attempt, int(e.payload.get("count", -1))) for e in stream
              if e.type == t.CHECKPOINT}
    for effect in effects:
        what = f"{rid}: effect of step {effect.step} by attempt {effect.attempt}"
        attempt = attempts.get(effect.attempt)
        if not checker.check(attempt is not None, f"{what}: no such attempt started"):
            continue
        assert attempt is not None
        checker.check(effect.worker == attempt.worker_pid,
                      f"{what}: written by pid {effect.worker}, the attempt's worker is "
                      f"{attempt.worker_pid}")
        checker.check((effect.attempt, effect.step + 1) in fenced,
                      f"{what}: no checkpoint of that attempt commits it")
        following = attempts.get(effect.attempt + 1)
        if following is not None:
            checker.check(effect.created_at < following.started.created_at,
                          f"{what} at {effect.created_at:%H:%M:%S.%f}, after attempt "
                          f"{following.number} started at "
                          f"{following.started.created_at:%H:%M:%S.%f}: a stale attempt wrote")
    steps_emitted = Counter(int(e.payload.get("n", -1)) for e in stream if e.type == "step")
    checker.check(all(n == 1 for n in steps_emitted.values()),
                  f"{rid}: a step event emitted twice (ids not deterministic?): {steps_emitted}")
    if run.status == Status.SUCCEEDED:
        missing = set(range(planned.steps)) - set(per_step)
        checker.check(not missing, f"{rid} succeeded without the effects of steps "
                                   f"{sorted(missing)}")
        checker.check(set(steps_emitted) == set(range(planned.steps)),
                      f"{rid} succeeded with step events {sorted(steps_emitted)}")
