"""Fair shares: the claim's order across fairness groups, and the groups' virtual times.

Stride scheduling per queue. Each group (`FairGroup`: a queue and a `fair_key`; "" for runs
without one) has a virtual time; the k-th due run of a group, at a priority, comes at
`vtime + k / weight`, and the claim takes runs by priority, then that time, then age. Each
start advances its group's time by 1/weight (`advance`, after the claim), and the groups
of the queue below the lowest time of those just started (idle ones) are lifted to it:
an idle group comes back at most one claim ahead, not owed a backlog of starts. A new
group starts at its queue's lowest time (`join_groups`, at enqueue).

Only a worker that has seen a group row pays for this (`FairClaim`): without one the claim
is the ordinary statement. The fair statement replaces only the claim's due query (the
`picked` rows of `hot_sql.claim_returning`); on PostgreSQL it reads each group's first due
runs through `agentruns_fair_due` (a LATERAL join), so a flood of one group costs the
claim only as many rows as it takes.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from django.db import OperationalError, connection, transaction
from django.db.models import QuerySet
from django.db.models.expressions import RawSQL

from ..db import retry_on_lock
from ..models import AgentRun, FairGroup, Status
from ..rules.fairness import fair_weights
from . import rawsql

Weights = tuple[tuple[str, float], ...]
# Candidates per group, as a multiple of the claim's size: concurrent claimers lock some
# of a group's first runs (SKIP LOCKED), and the claim takes the next ones instead.
SLACK = 2


class _Statement(rawsql.Compiled):
    """A statement built around a compiled queryset, with its "now" positions."""

    def __init__(self, sql: str, params: list[Any], now_at: list[int]) -> None:
        self.sql, self.params, self.now_at = sql, params, now_at


def _stride(column: str, weights: Weights) -> tuple[str, list[Any]]:
    """SQL for 1/weight of the group in `column` (groups not in `weights` weigh 1)."""
    if not weights:
        return "1.0", []
    params: list[Any] = []
    for key, weight in weights:
        params += [key, 1.0 / weight]
    return f"(CASE {column} {' '.join(['WHEN %s THEN %s'] * len(weights))} ELSE 1.0 END)", \
        params


def compile_fair(due: QuerySet[AgentRun], vendor: str, queues: Sequence[str], limit: int,
                 weights: Weights, *, ids_only: bool, naive: bool) -> rawsql.Compiled:
    """The due query `due` (claim filters, no lock, no limit) in fair order, locked
    (SKIP LOCKED on PostgreSQL) and limited as the claim's due query is."""
    table, groups = rawsql.qn(AgentRun._meta.db_table), rawsql.qn(FairGroup._meta.db_table)
    key = rawsql.qn("key")
    picks = "r.id, r.started_at" if ids_only else "r.*"
    if vendor == "postgresql":
        inner = rawsql.Compiled(
            due.filter(queue=RawSQL("fg.queue", ()), fair_key=RawSQL(f"fg.{key}", ()))
            .values("id", "priority", "available_at", "fired_seq")[:limit * SLACK], naive=naive)
        stride, stride_params = _stride(f"fg.{key}", weights)
        # Queues without a "" row (no fair run was ever enqueued there) still get theirs.
        # Materialized: the few candidates first, then their rows by id (never the other
        # way round, whatever the planner guesses of the backlog).
        head = (f"WITH f AS MATERIALIZED (SELECT c.* FROM ("
                f"SELECT g.queue, g.{key}, g.vtime FROM {groups} g WHERE g.queue IN "
                f"({', '.join(['%s'] * len(queues))}) UNION ALL SELECT q.queue, '', "
                f"COALESCE((SELECT MIN(m.vtime) FROM {groups} m WHERE m.queue = q.queue), 0) "
                f"FROM (VALUES {rawsql.values_rows(len(queues), 'varchar')}) AS q(queue) "
                f"WHERE NOT EXISTS (SELECT 1 FROM {groups} e WHERE e.queue = q.queue "
                f"AND e.{key} = '')) fg CROSS JOIN LATERAL (SELECT d.*, fg.vtime + "
                f"ROW_NUMBER() OVER (PARTITION BY d.priority ORDER BY d.available_at, "
                f"d.fired_seq, d.id) * {stride} AS vt FROM (")
        head_params = [*queues, *queues, *stride_params]
        # No status filter here, which would lead the planner to the backlog's index: a run
        # started since the snapshot is locked and returned, and the claim's UPDATE, whose
        # guard is its status, leaves it.
        # The best candidates in order (`o`), then their rows read by id (never a join the
        # planner might turn into a scan of the table), locked in that order up to the limit.
        tail = (f") d) c), o AS MATERIALIZED (SELECT f.id, ROW_NUMBER() OVER (ORDER BY "
                f"f.priority DESC, f.vt, f.available_at, f.fired_seq, f.id) AS pos FROM f) "
                f"SELECT {picks} FROM {table} r WHERE r.id = ANY(ARRAY(SELECT o.id FROM o "
                f"WHERE o.pos <= %s)) ORDER BY (SELECT o.pos FROM o WHERE o.id = r.id) "
                f"LIMIT %s FOR UPDATE OF r SKIP LOCKED")
    else:
        inner = rawsql.Compiled(due.values("id", "queue", "fair_key", "priority", "available_at",
                                           "fired_seq"), naive=naive)
        stride, stride_params = _stride("d.fair_key", weights)
        head = (f"SELECT {picks} FROM {table} r JOIN (SELECT d.id, COALESCE(g.vtime, "
                f"(SELECT MIN(m.vtime) FROM {groups} m WHERE m.queue = d.queue), 0) + "
                f"ROW_NUMBER() OVER (PARTITION BY d.queue, d.fair_key, d.priority ORDER BY "
                f"d.available_at, d.fired_seq, d.id) * {stride} AS vt FROM (")
        head_params = stride_params
        tail = (f") d LEFT JOIN {groups} g ON g.queue = d.queue AND g.{key} = d.fair_key) f "
                f"ON f.id = r.id WHERE r.status = %s ORDER BY r.priority DESC, f.vt, "
                f"r.available_at, r.fired_seq, r.id LIMIT %s")
    tail_params = [limit * SLACK, limit] if vendor == "postgresql" else [Status.QUEUED, limit]
    return _Statement(head + inner.sql + tail, [*head_params, *inner.params, *tail_params],
                      [len(head_params) + i for i in inner.now_at])


@functools.cache
def advance_ctes(weights: Weights) -> tuple[str, list[Any]]:
    """`advance` as CTEs of the claim's own statement (PostgreSQL, hot_sql.claim_returning),
    reading its `claimed` rows: no statement, no commit of its own."""
    groups, key = rawsql.qn(FairGroup._meta.db_table), rawsql.qn("key")
    stride, params = _stride(f"g.{key}", weights)
    sql = (f"fair_n AS (SELECT queue, fair_key, COUNT(*) AS n FROM claimed "
           f"GROUP BY queue, fair_key), "
           f"fair_low AS (SELECT g.queue, MIN(g.vtime) AS m FROM {groups} g JOIN fair_n c "
           f"ON g.queue = c.queue AND g.{key} = c.fair_key GROUP BY g.queue), "
           f"fair_advanced AS (UPDATE {groups} AS g SET vtime = COALESCE(g.vtime + (SELECT "
           f"c.n FROM fair_n c WHERE c.queue = g.queue AND c.fair_key = g.{key}) * {stride}, "
           f"fair_low.m) FROM fair_low WHERE g.queue = fair_low.queue AND (g.vtime < fair_low.m "
           f"OR EXISTS (SELECT 1 FROM fair_n c WHERE c.queue = g.queue "
           f"AND c.fair_key = g.{key})))")
    return sql, params


@retry_on_lock()
def advance(started: Iterable[AgentRun], weights: Weights) -> None:
    """Advance the groups of the `started` runs by 1/weight per start; lift the queue's
    other groups below the lowest time those had before (they had no due run) to it: a
    group that comes back is at most one claim ahead of the busy ones, never owed a
    backlog. One UPDATE per queue, in the caller's transaction (the claim's; the one-
    statement claim on PostgreSQL has it as CTEs instead: `advance_ctes`)."""
    counts: dict[str, Counter[str]] = {}
    for run in started:
        counts.setdefault(run.queue, Counter())[run.fair_key] += 1
    _advance(counts, dict(weights))


def _advance(counts: dict[str, Counter[str]], weight: dict[str, float]) -> None:
    groups_table, key = rawsql.qn(FairGroup._meta.db_table), rawsql.qn("key")
    with connection.cursor() as cursor:
        for queue, groups in counts.items():
            keys = sorted(groups)
            marks = ", ".join(["%s"] * len(keys))
            steps = " ".join(["WHEN %s THEN g.vtime + %s"] * len(keys))
            sql = (f"WITH low AS (SELECT MIN(vtime) AS m FROM {groups_table} WHERE queue = %s "
                   f"AND {key} IN ({marks})) UPDATE {groups_table} AS g SET vtime = CASE "
                   f"g.{key} {steps} ELSE low.m END FROM low WHERE g.queue = %s "
                   f"AND (g.{key} IN ({marks}) OR g.vtime < low.m)")
            params: list[Any] = [queue, *keys]
            for k in keys:
                params += [k, groups[k] / weight.get(k, 1.0)]
            cursor.execute(sql, [*params, queue, *keys])


JOIN_ROUNDS = 5  # a group deleted under a join's feet: insert it again, this many times


def join_groups(pairs: Iterable[tuple[str, str]]) -> None:
    """Rows for the (queue, fair_key) groups of new (or requeued) runs, and the queue's ""
    group, each new one at its queue's lowest virtual time (existing ones stay). In the
    caller's transaction, before or beside the write that makes its runs live.

    On PostgreSQL the statement also takes each existing row's KEY SHARE lock, held to the
    end of the caller's transaction: `drop_idle_groups` (FOR UPDATE SKIP LOCKED) cannot
    delete a group whose run is about to be committed, and the claim's UPDATE of a group's
    time (FOR NO KEY UPDATE) does not wait for it. A row deleted by a sweep that committed
    in between is neither inserted nor locked by that statement: it runs again and inserts
    it (a run whose group has no row would never be taken by the PostgreSQL fair claim)."""
    rows = sorted({p for queue, key in pairs for p in ((queue, key), (queue, ""))})
    if not rows:
        return
    groups, key = rawsql.qn(FairGroup._meta.db_table), rawsql.qn("key")
    source = rawsql.json_rows((("queue", "varchar"), ("k", "varchar")))
    insert = (f"INSERT INTO {groups} (queue, {key}, vtime) SELECT v.queue, v.k, "
              f"COALESCE((SELECT MIN(m.vtime) FROM {groups} m WHERE m.queue = v.queue), 0) "
              f"FROM {source} v WHERE true ON CONFLICT DO NOTHING")
    data = rawsql.json_values(rows, ("varchar", "varchar"))
    with connection.cursor() as cursor:
        if connection.vendor != "postgresql":  # the write lock serializes the sweep
            cursor.execute(insert, [data])
            return
        sql = (f"WITH v AS MATERIALIZED {source}, ins AS ({insert.replace(source, 'v')} "
               f"RETURNING queue, {key}), held AS (SELECT g.queue, g.{key} FROM {groups} g "
               f"JOIN v ON g.queue = v.queue AND g.{key} = v.k FOR KEY SHARE OF g) "
               f"SELECT (SELECT COUNT(*) FROM ins) + (SELECT COUNT(*) FROM held)")
        for _ in range(JOIN_ROUNDS):
            cursor.execute(sql, [data])
            if cursor.fetchone()[0] >= len(rows):
                return
    raise OperationalError("fairness groups kept being deleted while joining; try again")


def drop_idle_groups(limit: int = 500) -> int:
    """Delete up to `limit` fairness groups that have no queued, waiting or running run
    (a tenant gone quiet); how many were deleted. Called by the reaper's pass.

    Race-free with `join_groups` and the claim: the candidates are locked FOR UPDATE SKIP
    LOCKED (a group a transaction is joining is skipped; none waits), then deleted by a
    statement that re-checks under those locks with a fresh snapshot (READ COMMITTED), so
    a run made live by a transaction that committed meanwhile keeps its group. A group
    deleted and joined again comes back at its queue's lowest time, as an idle group is
    lifted to it: it gets its share from then on, never a backlog owed, and a flooding
    group (which has queued runs) is never deleted."""
    groups, key = rawsql.qn(FairGroup._meta.db_table), rawsql.qn("key")
    runs = rawsql.qn(AgentRun._meta.db_table)
    idle = (f"NOT EXISTS (SELECT 1 FROM {runs} r WHERE r.queue = g.queue AND r.fair_key = "
            f"g.{key} AND r.status IN (%s, %s, %s))")
    live = [Status.QUEUED, Status.WAITING, Status.RUNNING]
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"SELECT g.id FROM {groups} g WHERE {idle} ORDER BY g.id LIMIT %s "
                           f"FOR UPDATE OF g SKIP LOCKED", [*live, limit])
            ids = [row[0] for row in cursor.fetchall()]
            if not ids:
                return 0
            cursor.execute(f"DELETE FROM {groups} g WHERE g.id = ANY(%s) AND {idle}",
                           [ids, *live])
        else:  # one statement under the database's write lock
            cursor.execute(f"DELETE FROM {groups} WHERE id IN (SELECT g.id FROM {groups} g "
                           f"WHERE {idle} ORDER BY g.id LIMIT %s)", [*live, limit])
        return int(cursor.rowcount)


class FairClaim:
    """A worker's view of whether any fairness group exists (read at most once per
    `refresh` seconds): until one does, its claims are the ordinary statement. A group
    seen a moment late only delays fairness, never a run (the ordinary claim takes every
    due run)."""

    def __init__(self, refresh: float = 1.0) -> None:
        self.refresh = refresh
        self._read_at = float("-inf")
        self._weights: Weights | None = None

    def weights(self) -> Weights | None:
        """The weights to claim fairly with; None: claim as without fairness."""
        now = time.monotonic()
        if now - self._read_at >= self.refresh:
            self._weights = fair_weights() if FairGroup.objects.exists() else None
            self._read_at = now
        return self._weights
