"""Fair shares: virtual starts stamped at enqueue, and the fairness groups' rows.

Weighted fair queueing per queue and priority. Enqueue stamps each run with a virtual
start (`fair_vstart`): a group's next run (a queue, a priority and a `fair_key`; "" for
runs without one) comes 1/weight after that group's last queued run, and never before the
queue's virtual now: where its claims have reached (`virtual_now_sql`: the highest stamp
running, the lowest due one, the queue's clock). A claim with fair shares on is the
ordinary claim in (priority, stamp, age) order, read from one index: nothing per group,
nothing written but the runs it starts. A group that enqueues behind a flood starts level
with the flood's next run; an idle group comes back level, never owed a backlog (its
last stamps are gone with its runs).

A requeued run (retry, snooze, wake, failover, a lapsed lease) keeps its stamp, so it
comes back ahead of its group's backlog: a retry storm takes at most max_attempts times
its share. An operator's retry of a finished run is stamped afresh. When a queue has no
queued or running run, enqueue starts from the queue's clock (the "" group's `vtime`),
which the reaper raises to the queue's virtual now on each pass, so stamps never go back
by more than a pass's worth of starts.

Only a worker that has seen a keyed group's row claims in stamp order (`FairClaim`):
without one the claim is the ordinary statement in age order. Likewise enqueue stamps
only while fair shares are on (`stamping`): runs queued before they were turned on keep
stamp 0 and go first, oldest first.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence

from django.db import OperationalError, connection, transaction

from ..models import AgentRun, FairGroup, Status
from ..rules.fairness import fair_weights
from . import rawsql


def strides(keys: Iterable[str]) -> dict[str, float]:
    """1/weight of each fairness group (`FAIR_WEIGHTS`; a group not listed weighs 1)."""
    weight = dict(fair_weights())
    return {k: 1.0 / weight.get(k, 1.0) for k in keys}


def stamp_offsets(groups: Sequence[tuple[str, str, int]]) -> list[tuple[float, float]]:
    """For each new run's (queue, fair_key, priority), in batch order: its group's stride
    and its offset after the group's first new run (rank in the batch times the stride).
    The database adds the group's base (`stamp_base_sql`) to the offset."""
    stride = strides({key for _, key, _ in groups})
    seen: Counter[tuple[str, str, int]] = Counter()
    out = []
    for group in groups:
        out.append((stride[group[1]], seen[group] * stride[group[1]]))
        seen[group] += 1
    return out


def stamp_base_sql(vendor: str, queue: str, key: str, priority: str, stride: str) -> str:
    """SQL for the stamp of a group's first new run: its last queued stamp plus `stride`,
    and at least the queue's virtual now (`virtual_now_sql`). The arguments are SQL
    expressions, used in this order: queue, key, priority, stride, then
    `virtual_now_sql`'s."""
    runs = rawsql.qn(AgentRun._meta.db_table)
    last = (f"COALESCE((SELECT x.fair_vstart FROM {runs} x WHERE x.status = '{Status.QUEUED}' "
            f"AND x.queue = {queue} AND x.fair_key = {key} AND x.priority = {priority} "
            f"ORDER BY x.fair_vstart DESC LIMIT 1) + {stride}, -1e300)")
    return f"{_greatest(vendor)}({last}, {virtual_now_sql(vendor, queue, priority)})"


def _greatest(vendor: str) -> str:
    return "GREATEST" if vendor == "postgresql" else "MAX"


def virtual_now_sql(vendor: str, queue: str, priority: str) -> str:
    """SQL for a queue's virtual now: the stamp its claims have reached. The highest stamp
    of its running keyed runs (the claim starts runs in stamp order; unkeyed ones are left
    out of that index so that a drain without fair keys pays nothing for it), the lowest of its due
    queued runs at `priority` (the claim's next: workers may be stopped), and its clock
    (what the reaper saw last: the queue may be idle), whichever is highest, and at least
    0. A run that cannot start (a delayed run, a closed key's) keeps its low stamp out of
    it. Three index reads (`agentruns_fair_running`, `agentruns_fair_order`, the groups'
    unique index); the arguments as `stamp_base_sql`'s, used in the order queue, queue,
    priority, queue."""
    runs, groups = rawsql.qn(AgentRun._meta.db_table), rawsql.qn(FairGroup._meta.db_table)
    now = "now()" if vendor == "postgresql" else "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"
    running = (f"(SELECT r.fair_vstart FROM {runs} r WHERE r.status = '{Status.RUNNING}' AND "
               f"r.fair_key <> '' AND r.queue = {queue} ORDER BY r.fair_vstart DESC LIMIT 1)")
    due = (f"(SELECT d.fair_vstart FROM {runs} d WHERE d.status = '{Status.QUEUED}' AND "
           f"d.queue = {queue} AND d.priority = {priority} AND d.available_at <= {now} "
           f"ORDER BY d.fair_vstart LIMIT 1)")
    clock = (f"(SELECT c.vtime FROM {groups} c WHERE c.queue = {queue} AND "
             f"c.{rawsql.qn('key')} = '')")
    return (f"{_greatest(vendor)}(COALESCE({running}, 0), COALESCE({due}, 0), "
            f"COALESCE({clock}, 0))")


def next_stamp(queue: str, key: str, priority: int) -> float:
    """The stamp of one new run of a group (a fork: enqueue stamps in its INSERT)."""
    base = stamp_base_sql(connection.vendor, "%s", "%s", "%s", "%s")
    stride = strides([key])[key]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {base}",
                       [queue, key, priority, stride, queue, queue, priority, queue])
        return float(cursor.fetchone()[0])


FAIR_ORDER = ("-priority", "fair_vstart", "available_at", "fired_seq", "id")
"""The claim's order with fair shares on (index `agentruns_fair_order`)."""


def raise_clocks() -> int:
    """Raise each queue's clock (its "" group's `vtime`) to its virtual now (at its
    highest priority with a queued run). With fair shares on (a keyed group exists),
    queues with queued runs get a "" row first: a queue without fair keys has stamps to
    keep from going back too. Called by the reaper's pass; how many clocks moved."""
    runs, groups = rawsql.qn(AgentRun._meta.db_table), rawsql.qn(FairGroup._meta.db_table)
    key, queued, vendor = rawsql.qn("key"), f"'{Status.QUEUED}'", connection.vendor
    top = (f"COALESCE((SELECT t.priority FROM {runs} t WHERE t.status = {queued} AND "
           f"t.queue = {groups}.queue ORDER BY t.priority DESC LIMIT 1), 0)")
    now = virtual_now_sql(vendor, f"{groups}.queue", top)
    # The queues with a queued run, one index probe each (a loose scan of the claim's index).
    queues = (f"WITH RECURSIVE qs(queue) AS (SELECT MIN(queue) FROM {runs} WHERE status = "
              f"{queued} UNION ALL SELECT (SELECT MIN(n.queue) FROM {runs} n WHERE "
              f"n.status = {queued} AND n.queue > qs.queue) FROM qs WHERE qs.queue IS NOT "
              f"NULL) ")
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"{queues}INSERT INTO {groups} (queue, {key}, vtime) SELECT qs.queue, "
                       f"'', 0 FROM qs WHERE qs.queue IS NOT NULL AND EXISTS (SELECT 1 FROM "
                       f"{groups} g WHERE g.{key} <> '') ON CONFLICT DO NOTHING", [])
        cursor.execute(f"UPDATE {groups} SET vtime = {now} WHERE {key} = '' AND {now} > vtime",
                       [])
        return int(cursor.rowcount)


JOIN_ROUNDS = 5  # a group deleted under a join's feet: insert it again, this many times


def join_groups(pairs: Iterable[tuple[str, str]]) -> None:
    """Rows for the (queue, fair_key) groups of new (or requeued) runs, and the queue's ""
    group (existing ones stay). In the caller's transaction, before or beside the write
    that makes its runs live. A group row is what turns a worker's fair order on
    (`FairClaim`); the "" row's `vtime` is the queue's clock (`raise_clocks`).

    On PostgreSQL the statement also takes each existing row's KEY SHARE lock, held to the
    end of the caller's transaction: `drop_idle_groups` (FOR UPDATE SKIP LOCKED) cannot
    delete a group whose run is about to be committed. A row deleted by a sweep that
    committed in between is neither inserted nor locked by that statement: it runs again
    and inserts it, so a live run's group always has its row."""
    rows = sorted({p for queue, key in pairs for p in ((queue, key), (queue, ""))})
    if not rows:
        return
    groups, key = rawsql.qn(FairGroup._meta.db_table), rawsql.qn("key")
    source = rawsql.json_rows((("queue", "varchar"), ("k", "varchar")))
    insert = (f"INSERT INTO {groups} (queue, {key}, vtime) SELECT v.queue, v.k, 0 "
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
    deleted and joined again loses nothing: the order lives in its runs' stamps."""
    groups, key = rawsql.qn(FairGroup._meta.db_table), rawsql.qn("key")
    runs = rawsql.qn(AgentRun._meta.db_table)
    # A queue's "" group holds its clock (`raise_clocks`): kept while any run of it lives.
    idle = (f"NOT EXISTS (SELECT 1 FROM {runs} r WHERE r.queue = g.queue AND (g.{key} = '' "
            f"OR r.fair_key = g.{key}) AND r.status IN (%s, %s, %s))")
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
    """A worker's view of whether any keyed fairness group exists (read at most once per
    `refresh` seconds; a queue's "" row alone is only its clock): until one does, its
    claims are the ordinary statement in age order. A group seen a moment late only
    delays fairness, never a run (both orders take
    every due run)."""

    def __init__(self, refresh: float = 1.0) -> None:
        self.refresh = refresh
        self._read_at = float("-inf")
        self._on = False

    def on(self, *, fresh: bool = True) -> bool:
        """Whether to claim in stamp order (fair shares) rather than age order;
        `fresh=False` trusts the view as it is, however old."""
        now = time.monotonic()
        if fresh and now - self._read_at >= self.refresh:
            self._on = FairGroup.objects.exclude(key="").exists()
            self._read_at = now
        return self._on

    def seen_on(self) -> None:
        """This process just made a keyed group live: fair shares are on, no read needed."""
        self._on, self._read_at = True, time.monotonic()


ENQUEUE_REFRESH = 5.0  # seconds an enqueueing process trusts its view of fair shares
_enqueue_view = FairClaim(ENQUEUE_REFRESH)


def forget_view() -> None:
    """Read whether fair shares are on afresh at the next enqueue (a test's database was
    emptied under the process's view)."""
    _enqueue_view._read_at = float("-inf")


def stamping(keys: Iterable[str]) -> bool:
    """Whether an enqueue of runs with these fair keys stamps them: when one has a key, or
    a keyed group exists (this process's view, read at most once per ENQUEUE_REFRESH; a
    run enqueued unstamped meanwhile just goes first). Without fair shares, enqueue's
    statement is the plain one: nothing to pay."""
    if any(keys):
        _enqueue_view.seen_on()
        return True
    return _enqueue_view.on()
