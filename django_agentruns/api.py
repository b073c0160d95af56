"""The public calls: enqueue, cancel, retry, fork, run_now, set_limit."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from . import signals, transitions
from .exceptions import InvalidInputError, RunNotFoundError
from .models import AgentRun
from .registry import QUEUE_RULE, get_agent, is_queue_name
from .rules.fairness import FairKey, resolve_fair_key
from .rules.limits import LimitKey, check_budget, check_limit_key, resolve_limit_key
from .rules.windows import KEEP
from .rules.windows import check_field as check_limit_field
from .transitions import CancelResult, NewRun
from .validation import capped_json, is_short_text, storable_text

logger = logging.getLogger("django_agentruns.limits")

SCOPE_MAX = 255
DEDUPE_KEY_MAX = 255
QUEUE_MAX = 100
PRIORITY_RANGE = (-32768, 32767)
# The latest due time accepted: a year short of the largest datetime, so that showing it in
# any time zone, or adding a lease or a backoff to it, cannot overflow.
LATEST_RUN_AFTER = datetime(9999, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class RunRequest:
    """One run to enqueue with `enqueue_many`."""

    agent: str
    input: Any = None
    scope: str = ""
    queue: str | None = None
    priority: int | None = None
    run_after: datetime | timedelta | float | None = None
    fired_seq: int = 0
    dedupe_key: str | None = None
    limit_key: str | list[str] | None = None
    fair_key: str | None = None
    debounce: float | None = None
    supersede: bool = False


MAX_DEBOUNCE = 86400 * 365  # a year: a debounce is a pause, not a schedule


def enqueue(
    agent: str,
    input: Any = None,
    *,
    scope: str = "",
    queue: str | None = None,
    priority: int | None = None,
    run_after: datetime | timedelta | float | None = None,
    fired_seq: int = 0,
    dedupe_key: str | None = None,
    limit_key: str | list[str] | None = None,
    debounce: float | None = None,
    supersede: bool = False,
    fair_key: str | None = None,
) -> AgentRun:
    """Queue a run of `agent`, in the caller's transaction: roll back and it never existed.

    `run_after` is a datetime, a timedelta or seconds from now. With `dedupe_key`, an
    unfinished (queued or running) run of the agent with that key is returned instead of
    a new one, its `deduplicated` True; race-free across processes. `limit_key` overrides
    the agent's (see django_agentruns.rules.limits), `fair_key` its fairness group (see
    django_agentruns.rules.fairness). With `dedupe_key`: `debounce=seconds` makes a
    queued run holding the key take this input and start `seconds` from now instead (its
    `debounced` True; a new run starts then too, and gives up the key as it starts);
    `supersede=True` cancels the unfinished run holding the key ("superseded by run N")
    and queues this one in its place. Raises
    `UnknownAgentError` or `InvalidInputError` before anything is written. One INSERT:
    in autocommit it is the whole transaction (one round trip); PostgreSQL's trigger
    wakes the queue's workers once it commits.
    """
    at = timezone.now()
    request = RunRequest(agent, input, scope, queue, priority, run_after, fired_seq, dedupe_key,
                         limit_key, fair_key)
    new = build_new_run(request, at, {})
    if debounce is None and supersede is False:
        (run,) = transitions.insert_runs([new], at)
    else:
        run = _enqueue_on_holder(new, at, debounce, supersede, run_after)
    _announce([run])
    return run


def _enqueue_on_holder(new: transitions.NewRun, at: datetime, debounce: Any, supersede: Any,
                       run_after: Any) -> AgentRun:
    """`enqueue` with `debounce` or `supersede`, checked first (a bad one writes nothing)."""
    if not isinstance(supersede, bool):
        raise InvalidInputError(f"supersede must be True or False, not {supersede!r:.40}")
    if not new.dedupe_key:
        raise InvalidInputError("debounce and supersede act on the run holding a dedupe key: "
                                "give a dedupe_key")
    if debounce is None:
        return transitions.enqueue_superseding(new, at)
    if supersede:
        raise InvalidInputError("give debounce or supersede, not both")
    if run_after is not None:
        raise InvalidInputError("a debounced run starts `debounce` seconds after the last "
                                "enqueue: give debounce or run_after, not both")
    if isinstance(debounce, bool) or not isinstance(debounce, int | float) \
            or not math.isfinite(debounce) or not 0 <= debounce <= MAX_DEBOUNCE:
        raise InvalidInputError(f"debounce must be seconds in 0..{MAX_DEBOUNCE}, "
                                f"not {debounce!r:.40}")
    return transitions.enqueue_debounced(
        new._replace(available_at=at + timedelta(seconds=debounce)), at)


def enqueue_many(requests: Iterable[RunRequest | Mapping[str, Any]]) -> list[AgentRun]:
    """Queue many runs in one statement: all or none are written, in any transaction.

    A request with `debounce` or `supersede` acts on the run holding its dedupe key as
    `enqueue` does, after the plain ones and in request order (so of two requests with one
    key, the later one's input wins); with any, the call is one transaction."""
    at = timezone.now()
    agents: dict[str, _AgentPolicy] = {}
    asked = [r if isinstance(r, RunRequest) else _request(r) for r in requests]
    new = [build_new_run(r, at, agents) for r in asked]
    if not new:
        return []
    on_holder = [i for i, r in enumerate(asked)
                 if r.debounce is not None or r.supersede is not False]
    if not on_holder:
        created = transitions.insert_runs(new, at)
    else:
        runs: list[AgentRun | None] = [None] * len(new)
        plain = [i for i in range(len(new)) if i not in set(on_holder)]
        with transaction.atomic():
            for i, run in zip(plain, transitions.insert_runs([new[i] for i in plain], at)
                              if plain else [], strict=True):
                runs[i] = run
            for i in on_holder:
                runs[i] = _enqueue_on_holder(new[i], at, asked[i].debounce, asked[i].supersede,
                                             asked[i].run_after)
        created = [r for r in runs if r is not None]
    _announce(created)
    return created


def _announce(runs: list[AgentRun]) -> None:
    if not signals.run_enqueued.has_listeners():
        return  # bulk enqueues skip building kwargs nobody reads
    for run in runs:
        if run.deduplicated:
            continue  # announced when it was enqueued
        signals.send_after_commit(signals.run_enqueued, run_id=run.pk, agent=run.agent,
                                  attempt=run.attempt, queue=run.queue, scope=run.scope)


def check_request(request: RunRequest) -> None:
    """Check `request` as `enqueue` would, writing nothing: `add_schedule` refuses an
    input its runs could never be enqueued with."""
    build_new_run(request, timezone.now(), {})


def _request(data: Mapping[str, Any]) -> RunRequest:
    try:
        return RunRequest(**data)
    except TypeError as exc:
        raise InvalidInputError(f"Bad run request {dict(data)!r}: {exc}") from exc


@dataclass(frozen=True)
class _AgentPolicy:
    """What an agent's runs take from it and from the settings: looked up once per call."""

    name: str
    queue: str
    priority: int
    max_requeues: int
    limit_key: LimitKey = None
    version: int = 1
    fair_key: FairKey = None


def _policy(name: Any, agents: dict[str, _AgentPolicy]) -> _AgentPolicy:
    known = agents.get(name) if isinstance(name, str) else None  # a list is no agent name
    if known is None:
        spec = get_agent(name)
        known = agents[spec.name] = _AgentPolicy(spec.name, spec.effective_queue(),
                                                 spec.priority, spec.effective_max_requeues(),
                                                 spec.limit_key, spec.version, spec.fair_key)
    return known


def build_new_run(request: RunRequest, at: datetime,
                  agents: dict[str, _AgentPolicy]) -> NewRun:
    """Check one request; `agents` keeps agent policies for the rest of the call.

    Public for the callers that insert runs their own way (`run_now`, `ctx.spawn`)."""
    agent = _policy(request.agent, agents)
    payload = {} if request.input is None else request.input
    text = capped_json(payload, f"Input of agent {request.agent!r}", "MAX_INPUT_BYTES")
    scope = _check_str(request.scope, "scope", SCOPE_MAX, allow_empty=True)
    queue = request.queue if request.queue is not None else agent.queue
    if not is_queue_name(queue):
        raise InvalidInputError(f"queue must be {QUEUE_RULE}, not {queue!r:.120}")
    priority = agent.priority if request.priority is None else request.priority
    if isinstance(priority, bool) or not isinstance(priority, int) or \
            not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise InvalidInputError(f"priority must be an integer in {PRIORITY_RANGE}, "
                                f"not {priority!r}")
    fired_seq = request.fired_seq
    if isinstance(fired_seq, bool) or not isinstance(fired_seq, int) or \
            not -(2**63) <= fired_seq < 2**63:
        raise InvalidInputError(f"fired_seq must be a 64-bit integer, not {fired_seq!r}")
    key = "" if request.dedupe_key is None else \
        _check_str(request.dedupe_key, "dedupe_key", DEDUPE_KEY_MAX, allow_empty=False)
    return NewRun(agent=agent.name, queue=queue, priority=priority, scope=scope,
                  fired_seq=fired_seq, input=payload, input_json=text,
                  max_requeues=agent.max_requeues,
                  available_at=_due_time(request.run_after, at), dedupe_key=key,
                  limit_keys=resolve_limit_key(agent.name, agent.limit_key, request.limit_key,
                                               payload), agent_version=agent.version,
                  fair_key=resolve_fair_key(agent.name, agent.fair_key, request.fair_key,
                                            payload))


def _check_str(value: Any, name: str, limit: int, *, allow_empty: bool) -> str:
    if not isinstance(value, str):
        raise InvalidInputError(f"{name} must be a string, not {type(value).__name__}")
    if not is_short_text(value, limit, empty=allow_empty):
        raise InvalidInputError(f"{name} must be {'0' if allow_empty else '1'}-{limit} "
                                f"characters with no NUL or surrogate, not {value[:50]!r}")
    return value


def _due_time(run_after: datetime | timedelta | float | None, at: datetime) -> datetime:
    if run_after is None:
        return at
    due = _due_time_unbounded(run_after, at)
    if due >= LATEST_RUN_AFTER:
        raise InvalidInputError(f"run_after must be before {LATEST_RUN_AFTER.isoformat()}, "
                                f"not {run_after!r}")
    return due


def _due_time_unbounded(run_after: datetime | timedelta | float, at: datetime) -> datetime:
    try:
        if isinstance(run_after, datetime):
            if timezone.is_naive(run_after):
                raise InvalidInputError("run_after must be an aware datetime")
            run_after.astimezone(UTC)  # stored in UTC: must be representable there
            return run_after
        if isinstance(run_after, timedelta):
            return at + run_after
    except OverflowError:
        raise InvalidInputError(f"run_after is out of range: {run_after!r}") from None
    # Range first: math.isfinite() cannot take an int too large for a float.
    if isinstance(run_after, int | float) and not isinstance(run_after, bool) \
            and 0 <= run_after < 10**9 and math.isfinite(run_after):
        return at + timedelta(seconds=run_after)
    raise InvalidInputError(f"run_after must be a datetime, a timedelta or seconds >= 0, "
                            f"not {run_after!r}")


def cancel(run_id: int, reason: str = "") -> CancelResult:
    """Cancel a queued run now, or ask a running one to stop.

    A finished run gives `CancelResult.NOT_CANCELLABLE`, not an error.
    """
    result = transitions.cancel(run_id_of(run_id), storable_text(str(reason)[:2000]))
    if result is None:
        raise RunNotFoundError(f"No run with id {run_id!r}")
    return result


def retry(run_id: int, by: str = "", *, budget: dict[str, Any] | None = None) -> bool:
    """Requeue a failed or cancelled run with a fresh budget. False: it is neither.

    `budget` ({"tokens": N, "cost": X}) replaces the agent's for this run from now on: a
    run dead-lettered `budget_exhausted` is retried with a raised one."""
    checked = check_budget(budget)
    result = transitions.operator_retry(run_id_of(run_id), by=storable_text(str(by)[:255]),
                                        budget=None if checked is None else checked.as_dict())
    if result is None:
        raise RunNotFoundError(f"No run with id {run_id!r}")
    return result  # PostgreSQL's trigger wakes the queue's workers (migration 0002)


def fork(run_id: int, *, checkpoint: int | None = None, input: Any = None,
         by: str = "", replay: bool = False, agent: str | None = None) -> AgentRun:
    """Queue a new run of `run_id`'s agent that starts from its checkpoint `checkpoint`
    (numbered from 1 in the order saved; None: the last), with `input` in place of the
    run's own when given. The new run's `forked_from` is the origin, and its timeline
    opens with a `run.forked` event; the origin is left as it was. The fork keeps the
    origin's limit key (so it counts against the same limit, and a closed key holds it
    too) and its fair key (its tenant's fairness group); given a new `input`, an agent
    whose `limit_key` or `fair_key` is a callable has it computed from that input. The
    fork copies only the state it starts from, none of the origin's other checkpoints, so
    purging the origin never breaks it; an origin keeps its latest `CHECKPOINT_HISTORY`
    states, so only those can be forked from.

    `replay=True`: every step the origin completed returns the origin's recorded result
    in the fork, without calling its function (copied: purging the origin never breaks
    the fork); steps it never reached, or that the code names differently, execute.
    `agent`: the fork runs this registered agent instead (e.g. a new version, against
    the origin's recorded steps), at its version, keeping the origin's limit key.

    Checked before anything is written: the run exists, the agent that would run the fork
    is registered here, the checkpoint was reached and is kept, the input is JSON within
    MAX_INPUT_BYTES.
    """
    pk = run_id_of(run_id)
    if checkpoint is not None and (isinstance(checkpoint, bool)
                                   or not isinstance(checkpoint, int) or checkpoint < 1):
        raise InvalidInputError(f"checkpoint must be a whole number >= 1 (or None for the "
                                f"last), not {checkpoint!r}")
    if not isinstance(replay, bool):
        raise InvalidInputError(f"replay must be True or False, not {replay!r}")
    origin_agent = AgentRun.objects.filter(pk=pk).values_list("agent", flat=True).first()
    if origin_agent is None:
        raise RunNotFoundError(f"No run with id {run_id!r}")
    # UnknownAgentError: nothing here could run the fork (the origin's agent need not be
    # registered when another one runs it).
    spec = get_agent(origin_agent if agent is None else agent)
    limit_key = fair_key = None  # None: the origin's
    if input is not None:
        capped_json(input, f"Input of agent {spec.name!r}", "MAX_INPUT_BYTES")
        if callable(spec.limit_key):
            keys = resolve_limit_key(spec.name, spec.limit_key, None, input)
            limit_key = keys[0] if keys else ""  # the first of a failover list
        if callable(spec.fair_key):
            fair_key = resolve_fair_key(spec.name, spec.fair_key, None, input)
    run = transitions.insert_fork(
        pk, checkpoint, input, storable_text(str(by)[:255]), timezone.now(), replay=replay,
        agent=None if agent is None else spec.name,
        queue=None if agent is None else spec.effective_queue(), version=spec.version,
        limit_key=limit_key, fair_key=fair_key)
    if run is None:
        raise RunNotFoundError(f"No run with id {run_id!r}")
    _announce([run])
    return run


def run_id_of(run_id: Any) -> int:
    """A run id from what a caller hands in (an int, its text, an AgentRun), checked."""
    if isinstance(run_id, AgentRun):
        return int(run_id.pk)
    try:
        if isinstance(run_id, bool):
            raise TypeError
        value = int(run_id)
        if not isinstance(run_id, str) and value != run_id:
            raise ValueError  # int() truncates 7.5 to 7: another run's id
        return value
    except (TypeError, ValueError):
        raise InvalidInputError(f"Run id must be an integer, not {run_id!r}") from None


def set_limit(
    key: str, max_running: Any = KEEP, *, per_minute: Any = KEEP,
    tokens_per_minute: Any = KEEP, cost_per_day: Any = KEEP,
) -> None:
    """Set a key's limits, across all workers from the next claim on (runs already running
    are left to finish): `max_running` at once (0 pauses the key), `per_minute` runs
    started per rolling minute, `tokens_per_minute` tokens and `cost_per_day` cost recorded
    per rolling window. An argument left out leaves that field as it is; None puts it back
    to the LIMITS setting (or unbounded). A key ending in `*` is a pattern: each key with
    that prefix gets windows of its own of that size. Raises InvalidInputError (writing
    nothing) for a bad key or value."""
    check_limit_key(key, "key")
    given = {"max_running": max_running, "per_minute": per_minute,
             "tokens_per_minute": tokens_per_minute, "cost_per_day": cost_per_day}
    fields = {name: check_limit_field(name, value) for name, value in given.items()
              if value is not KEEP}
    transitions.write_limit(key, fields)



def open_key(key: str) -> bool:
    """Reopen a limit key closed by a 429 (a `Snooze` that closes its key)
    before its time: its runs may start at the next claim. False if it was not closed."""
    check_limit_key(key, "key")
    opened = transitions.open_key(key)
    if opened:
        logger.info("limit key %s reopened", key, extra={"limit_key": key})
    return opened
