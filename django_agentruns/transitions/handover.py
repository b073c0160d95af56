"""A worker's finished successes settled and its next runs claimed, in one statement.

A worker's loop is: settle what finished, claim what is due. On PostgreSQL the two are
one statement of CTEs (`hot_sql.settle_and_claim`): the successes' fenced UPDATE and their
end events (`settle_succeeded_many`'s statement), then the due runs locked with SKIP
LOCKED, started, and their start events (`claim`'s one-statement form, the same due
query: paused queues, limit keys, priorities, agents keep their meaning). One round trip
and one commit per run at concurrency 1. Each part keeps its own guard: a success whose
fence no longer holds is LOST (nothing written for it), a run another worker started
meanwhile is not claimed. The claim reads the statement's snapshot, in which the runs
being settled still run: nothing due depends on that but ordered scopes, which keep the
two-step form, as the plain claim does (it needs a transaction to re-check them).

Elsewhere (SQLite, a lapsed-lease scan, ordered scopes, inside a transaction) it is the
two transitions one after the other, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connection

from ..conf import app_settings
from ..db import is_postgres
from ..models import AgentRun, Reason, Status
from ..outcomes import AttemptRef, ScopePolicy, Settlement
from . import children, hot_sql, rawrows, rawsql
from .claiming import _announce_started, age_order, claim, fair_order
from .due import compiled_due
from .events import STARTED, SUCCEEDED, lifecycle_event_id, now
from .settling import _announce_succeeded, settle_succeeded_many

Successes = Sequence[tuple[AttemptRef, Any]]


def settle_and_claim(
    worker_id: str,
    successes: Successes,
    queues: Sequence[str],
    limit: int,
    scopes: ScopePolicy,
    lease_ttls: dict[str, float],
    default_ttl: float,
    at: datetime | None = None,
    *,
    include_lapsed: bool = True,
    agents: frozenset[str] | None = None,
    fair: bool = False,
) -> tuple[dict[AttemptRef, Settlement], list[AgentRun]]:
    """Record `successes` (attempts of `worker_id` that returned), then take up to `limit`
    due runs (as `claim`, same arguments): one statement where it can be."""
    at = at or now()
    queues = tuple(queues)
    one = (successes and limit > 0 and (agents is None or agents) and is_postgres()
           and not include_lapsed and not scopes.ordered
           and not connection.in_atomic_block)
    if one:
        done = _in_one_statement(worker_id, successes, queues, limit, scopes, lease_ttls,
                                 default_ttl, at, agents, fair)
        if done is not None:
            return done
    settled = settle_succeeded_many(worker_id, successes, at) if successes else {}
    claimed = claim(worker_id, queues, limit, scopes, lease_ttls, default_ttl, at,
                    include_lapsed=include_lapsed, agents=agents, fair=fair) if limit > 0 else []
    return settled, claimed


def _in_one_statement(
    worker_id: str, successes: Successes, queues: tuple[str, ...], limit: int,
    scopes: ScopePolicy, lease_ttls: dict[str, float], default_ttl: float, at: datetime,
    agents: frozenset[str] | None, fair: bool,
) -> tuple[dict[AttemptRef, Settlement], list[AgentRun]] | None:
    """None when an event of a settled run was appended after the statement's snapshot
    (an operator's cancel request, racing): its seq collided and nothing was written; the
    caller then takes the two-step form, whose settle sees that event."""
    if len({ref.run_id for ref, _ in successes}) != len(successes) or \
            any(ref.worker_id != worker_id for ref, _ in successes):
        raise ValueError("a batch settles distinct runs of one worker")
    rows = [(ref.run_id, ref.attempt, output, lifecycle_event_id())
            for ref, output in successes]
    # The same arguments, keywords included, as `claim`'s: one cached compilation for both.
    due = compiled_due(connection.vendor, queues, scopes, limit, ids_only=True, agents=agents,
                       naive=rawsql.naive_times(), fair=fair)
    special = {agent: at + timedelta(seconds=ttl) for agent, ttl in lease_ttls.items()
               if ttl != default_ttl}
    sql, params = hot_sql.settle_and_claim(
        rows, worker_id, Status.RUNNING, Status.SUCCEEDED, Reason.COMPLETED, SUCCEEDED, due,
        at, Status.QUEUED, special, at + timedelta(seconds=default_ttl), STARTED)
    try:
        with rawrows.cursor(prepared=bool(app_settings.PREPARED_STATEMENTS)) as cursor:
            cursor.execute(sql, params)
            fetched = cursor.fetchall()
            first = fetched[0]  # the LEFT JOIN answers one row at least
            names = rawrows.column_names(cursor, sql)
            ids, parents = first[names.index("settled_ids")], \
                first[names.index("settled_parents")]
            claimed = rawrows.runs_from(cursor, fetched, sql)
    except IntegrityError:
        return None
    done = set(ids or ())
    for run in claimed:
        run.__dict__.pop("settled_ids", None)
        run.__dict__.pop("settled_parents", None)
    claimed.sort(key=fair_order if fair else age_order)
    # Committed: parents waiting on these runs are resumed just after (and by the reaper,
    # should this worker die in between), as after `settle_succeeded_many`'s statement.
    children.resume_parents(parents or (), at)
    _announce_succeeded(successes, done)
    _announce_started(claimed, worker_id)
    return ({ref: Settlement.SUCCEEDED if ref.run_id in done else Settlement.LOST
             for ref, _ in successes}, claimed)
