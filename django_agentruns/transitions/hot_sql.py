"""SQL text of the statements that settle successes and claim runs (PostgreSQL's hot
path): the fenced success UPDATE with its events and outputs, the claim's CTEs, and the
two in one statement (`settle_and_claim`). Built from `rawsql`'s pieces, once per shape;
nothing here executes a statement or decides a status.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connection, connections

from ..models import AgentRun, RunEvent
from . import payload_sql, rawsql
from .guards import still_sql
from .rawsql import SENTINEL_TIME, Compiled, prep, qn

Statement = tuple[str, list[Any]]
Builder = Callable[[datetime, dict[str, datetime], datetime], Statement]
"""A statement's text and parameters from its time, its agents' leases and the default
lease: called once per shape, with stand-ins (`_inlined`)."""


def settle_succeeded(
    items: Sequence[tuple[int, int, Any, Any]], worker_id: str, running: str, succeeded: str,
    completed: str, event_type: str, at: datetime, *, with_events: bool,
) -> tuple[str, list[Any]]:
    """Mark (run_id, attempt, output, event_id) rows succeeded where the fence holds.

    Returns (id, parent_id) of the runs it updated: the rest lost their lease meanwhile;
    a parent id says a waiting parent may need resuming, with no read to find out.
    `with_events` (PostgreSQL) appends their end events in the same statement.
    """
    head, update, params = _succeed_parts(items, worker_id, running, succeeded, completed, at)
    table = qn(AgentRun._meta.db_table)
    if not with_events:
        return f"{head}{update}RETURNING {table}.id, {table}.parent_id", params
    ctes, more = _succeed_ctes(head, update, event_type, at)
    return f"{ctes} SELECT id, parent_id FROM done", params + more


def _succeed_parts(
    items: Sequence[tuple[int, int, Any, Any]], worker_id: str, running: str, succeeded: str,
    completed: str, at: datetime,
) -> tuple[str, str, list[Any]]:
    """The rows' head and the fenced UPDATE of a settle of successes, and their params.

    The rows travel as one JSON parameter (`rawsql.json_rows`), not a VALUES list: the
    text is the same for every batch size, so a worker's settle-and-claim is one prepared
    statement, where a VALUES list of four placeholders a run made each size a statement
    of its own, parsed and planned afresh (some 2.6 ms of the server's time for a batch of
    50, and psycopg's adapting of 200 values). The status guard is `guards.still_sql`:
    statistics that count no running run (taken before the workers started) sent a plain
    one through every running run for its few."""
    table = qn(AgentRun._meta.db_table)
    params: list[Any] = [_rows(items), succeeded, completed, prep(AgentRun, "finished_at", at),
                         running, worker_id]
    update = (f"UPDATE {table} SET status = %s, reason = %s, "
              f"finished_at = %s, lease_expires = NULL FROM v "
              f"WHERE {table}.id {_among_ids()} AND {table}.id = v.run_id "
              f"AND {table}.attempt = v.run_attempt "
              f"AND {still_sql(table)} AND {table}.claimed_by = %s ")
    head = f"WITH v AS {rawsql.json_rows(_SUCCESSES)} "
    return head, update, params


_SUCCESSES = (("run_id", "bigint"), ("run_attempt", "integer"), ("run_output", "jsonb"),
              ("run_event", "uuid"))


def _rows(items: Sequence[tuple[int, int, Any, Any]]) -> str:
    """The successes' one parameter: (run_id, attempt, output, event_id) rows as JSON (an
    output of None is NULL: no payload row)."""
    return rawsql.json_values(items, [t for _, t in _SUCCESSES])


def _among_ids() -> str:
    """The settled runs' ids as a list the planner sees: a plan, which cannot count the
    JSON's rows, still finds the runs by id, as `rawsql.fenced_alone` does."""
    if connection.vendor == "postgresql":
        return "= ANY(ARRAY(SELECT v.run_id FROM v))"
    return "IN (SELECT v.run_id FROM v)"


def _succeed_ctes(head: str, update: str, event_type: str,
                  at: datetime) -> tuple[str, list[Any]]:
    """`WITH v, done (the settled: id, attempt, parent_id), ended (their end events),
    outputs (their output payload rows)`."""
    table = qn(AgentRun._meta.db_table)
    return (f"{head}, done AS ({update}RETURNING {table}.id, {table}.attempt, "
            f"{table}.parent_id), "
            f"ended AS ({_events_from('done', 'done_v.run_event', 'done_v')}), "
            f"outputs AS ({payload_sql.OUTPUTS_FROM_DONE})"), \
        [event_type, prep(RunEvent, "payload", {}), prep(RunEvent, "created_at", at),
         prep(RunEvent, "created_at", at)]


def _events_from(rows: str, event_id: str, join: str = "") -> str:
    """INSERT one event per row of CTE `rows` (id, attempt): type, payload, time as %s."""
    events = qn(RunEvent._meta.db_table)
    source = f"{rows} JOIN v {join} ON {join}.run_id = {rows}.id" if join else rows
    return (f"INSERT INTO {events} (run_id, seq, event_id, type, payload, attempt, created_at) "
            f"SELECT {rows}.id, COALESCE((SELECT MAX(e.seq) FROM {events} e "
            f"WHERE e.run_id = {rows}.id), 0) + 1, {event_id}, %s, %s::jsonb, {rows}.attempt, "
            f"%s FROM {source}")


def claim_returning(
    due: Compiled, at: datetime, worker_id: str, running: str, queued: str,
    lease_ttls: dict[str, datetime], default_lease: datetime, started: str,
) -> tuple[str, list[Any]]:
    """PostgreSQL: lock the due rows (SKIP LOCKED), start them and append their start
    events, all in one statement.

    Its constants are literals in the text, as `settle_and_claim`'s are: with the statuses
    as parameters a prepared statement's generic plan cannot use the backlog's partial
    indexes, so over a large history the server planned every claim afresh."""
    key = ("claim", id(due), tuple(lease_ttls), worker_id, running, queued, started)

    def build(at: datetime, leases: dict[str, datetime], default: datetime) -> Statement:
        ctes, params = _claim_ctes(due, at, worker_id, running, queued, leases, default, started)
        return f"WITH {ctes} SELECT * FROM claimed", params

    sql, slots = _shape(key, due, 0, lease_ttls, build)
    return sql, _times(slots, at, default_lease, lease_ttls)


def _claim_ctes(
    due: Compiled, at: datetime, worker_id: str, running: str, queued: str,
    lease_ttls: dict[str, datetime], default_lease: datetime, started: str,
) -> tuple[str, list[Any]]:
    """`picked` (the due rows, locked), `claimed` (them started, whole rows), `started`
    (their start events)."""
    table = qn(AgentRun._meta.db_table)
    params = due.bind(at)
    lease = "%s"
    lease_params: list[Any] = []
    if lease_ttls:
        whens = " ".join(["WHEN %s THEN %s"] * len(lease_ttls))
        lease = f"CASE {table}.agent {whens} ELSE %s END"
        for agent, until in lease_ttls.items():
            lease_params += [agent, until]
    lease_params.append(default_lease)
    params += [running, worker_id, *lease_params, at, queued,
               started, prep(RunEvent, "payload", {"worker": worker_id}), at]
    # The status guard is `guards.still_sql`: no partial index's predicate matches it, so
    # the UPDATE finds its rows by id (see there).
    sql = (f"picked AS ({due.sql}), "
           f"claimed AS (UPDATE {table} SET status = %s, claimed_by = %s, "
           f"attempt = {table}.attempt + 1, lease_expires = {lease}, started_at = %s, "
           f"dedupe_key = CASE WHEN {table}.release_dedupe_at_start THEN '' "
           f"ELSE {table}.dedupe_key END "
           f"FROM picked WHERE {table}.id = picked.id AND {still_sql(table)} "
           f"RETURNING {table}.*, picked.started_at AS previous_started_at, "
           f"{payload_sql.INPUT_OF_CLAIMED}), "
           f"started AS ({_events_from('claimed', 'gen_random_uuid()')})")
    return sql, params


def settle_and_claim(
    items: Sequence[tuple[int, int, Any, Any]], worker_id: str, running: str, succeeded: str,
    completed: str, ended: str, due: Compiled, at: datetime, queued: str,
    lease_ttls: dict[str, datetime], default_lease: datetime, started: str,
) -> tuple[str, list[Any]]:
    """PostgreSQL: `settle_succeeded` (with events) and `claim_returning` in one statement.

    Its rows are the claimed runs, each with `settled_ids` and `settled_parents` (the
    settled runs and their parents, in the same order); one row of NULLs but those two
    when nothing was claimed.

    What is the same for every statement of a worker (statuses, its id, the events'
    payloads, its queues and agents) is in the text as literals, built once per shape:
    only the successes (one JSON parameter, whatever their count) and the times are
    parameters, so the text is the same for every batch and, with PREPARED_STATEMENTS,
    one statement the server plans once."""
    key = (id(due), tuple(lease_ttls), worker_id, running, succeeded, completed, ended,
           queued, started)

    def build(at: datetime, leases: dict[str, datetime], default: datetime) -> Statement:
        return _full(items, worker_id, running, succeeded, completed, ended, due, at, queued,
                     leases, default, started)

    sql, slots = _shape(key, due, 1, lease_ttls, build)  # one own parameter: the rows
    return sql, [_rows(items), *_times(slots, at, default_lease, lease_ttls)]


# By the shape's constants: (the due query it was built with, its text, its slots).
_SHAPES: dict[tuple[Any, ...], tuple[Compiled, str, list[int]]] = {}


def _shape(
    key: tuple[Any, ...], due: Compiled, own: int, lease_ttls: dict[str, datetime],
    build: Builder,
) -> tuple[str, list[int]]:
    """The statement's text for this shape, built once: see `_inlined`."""
    kept = _SHAPES.get(key)
    if kept is None or kept[0] is not due:
        if len(_SHAPES) >= 256:
            _SHAPES.clear()  # a worker sends a few shapes: this many is another's churn
        kept = _SHAPES[key] = (due, *_inlined(own, lease_ttls, build))
    return kept[1], kept[2]


def _times(slots: list[int], at: datetime, default_lease: datetime,
           lease_ttls: dict[str, datetime]) -> list[Any]:
    leases = [default_lease, *lease_ttls.values()]
    return [at if slot < 0 else leases[slot] for slot in slots]


def _inlined(
    own: int, lease_ttls: dict[str, datetime],
    build: Builder,
) -> tuple[str, list[int]]:
    """The statement's text with every constant parameter a literal, and what each of the
    remaining parameters after the first `own` (the rows' own values) is: -1 the time,
    0 the default lease, k the lease of the k-th agent of `lease_ttls`.

    Built by `build` with stand-in times (told apart by value) for the time and the
    leases."""
    at = SENTINEL_TIME
    stand_ins = [at + timedelta(microseconds=k + 1) for k in range(len(lease_ttls) + 1)]
    sql, params = build(at, dict(zip(lease_ttls, stand_ins[1:], strict=True)), stand_ins[0])
    db = connections[DEFAULT_DB_ALIAS]
    db.ensure_connection()
    parts = re.split(r"(%%|%s)", sql)
    text: list[str] = []
    slots: list[int] = []
    position = 0
    for part in parts:
        if part != "%s":
            text.append(part)
            continue
        value = params[position]
        if position < own:
            text.append(part)
        elif value == at:
            text.append(part)
            slots.append(-1)
        elif value in stand_ins:
            text.append(part)
            slots.append(stand_ins.index(value))
        else:
            text.append(_literal(value, db.connection))
        position += 1
    return "".join(text), slots


def _literal(value: Any, raw: Any) -> str:
    """A constant as SQL text, quoted by psycopg; a `%` doubled, as the text is still
    read for placeholders (a worker id may hold one)."""
    from psycopg import sql as pgsql  # PostgreSQL only: psycopg need not be installed

    if isinstance(value, Enum):
        value = value.value
    return pgsql.Literal(value).as_string(raw).replace("%", "%%")


def _full(
    items: Sequence[tuple[int, int, Any, Any]], worker_id: str, running: str, succeeded: str,
    completed: str, ended: str, due: Compiled, at: datetime, queued: str,
    lease_ttls: dict[str, datetime], default_lease: datetime, started: str,
) -> tuple[str, list[Any]]:
    """The statement with every value a parameter."""
    head, update, params = _succeed_parts(items, worker_id, running, succeeded, completed, at)
    settle, more = _succeed_ctes(head, update, ended, at)
    claim, claim_params = _claim_ctes(due, at, worker_id, running, queued, lease_ttls,
                                      default_lease, started)
    sql = (f"{settle}, {claim} SELECT claimed.*, "
           f"s.settled_ids, s.settled_parents FROM (SELECT array_agg(id) AS settled_ids, "
           f"array_agg(parent_id) AS settled_parents FROM done) s LEFT JOIN claimed ON true")
    return sql, params + more + claim_params
