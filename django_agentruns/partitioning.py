"""Partitioned history's ensure step (PostgreSQL, `AGENTRUNS["HISTORY_PARTITION"]`): the
layout read from the catalog and the partitions new runs will need, created ahead. Here,
below transitions/, because enqueue needs it too: a run's input is a payload row in its
span's partition, so an enqueue that outruns the partitions (no worker running to make
them) makes them itself. Dropping, converting and the checks are `ops.partitions`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db import connection, transaction
from django.db.backends.utils import CursorWrapper

from .conf import app_settings
from .flow_models import RunUsage
from .models import AgentRun, RunCheckpoint, RunEvent, RunPayload, RunStep, RunWait, StreamChunk

HISTORY_MODELS = (RunEvent, RunCheckpoint, RunWait, RunStep, RunUsage, StreamChunk, RunPayload)
"""The tables partitioned by run id. LangGraph's checkpoints belong to a thread that
outlives its runs (their run link may be empty), so they stay plain."""

LOCK_TIMEOUT = "2s"
"""How long ensure and drop wait for a table lock before giving up until next time: a
DDL statement queued behind a long transaction would otherwise stall every writer."""

ENSURE_LOCK = 0x6167_7275_6E70  # pg_try_advisory_xact_lock key: one `ensure` at a time
BOUND = re.compile(r"FROM \('?(-?\d+)'?\) TO \('?(-?\d+)'?\)")


@dataclass(frozen=True)
class Partition:
    table: str
    name: str
    lo: int
    hi: int


@dataclass
class Report:
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # why spans stay (drop), or what was skipped
    busy: bool = False  # another process held the lock: nothing done this time


def history_tables() -> list[str]:
    return [m._meta.db_table for m in HISTORY_MODELS]


def span() -> int | None:
    """Run ids per partition, or None when history is not partitioned here (the setting is
    None, or the database is not PostgreSQL)."""
    value = app_settings.HISTORY_PARTITION
    return int(value) if value and connection.vendor == "postgresql" else None


def partitioned_tables() -> set[str]:
    """History tables that are partitioned in the database right now."""
    if connection.vendor != "postgresql":
        return set()
    with connection.cursor() as cursor:
        cursor.execute("SELECT c.relname FROM pg_partitioned_table p JOIN pg_class c "
                       "ON c.oid = p.partrelid WHERE c.relname = ANY(%s) "
                       "AND pg_table_is_visible(c.oid)", [history_tables()])
        return {row[0] for row in cursor.fetchall()}


def partitions(tables: Iterable[str] | None = None) -> list[Partition]:
    """The partitions of the history tables, by table and lower bound."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT parent.relname, child.relname, pg_get_expr(child.relpartbound, child.oid) "
            "FROM pg_inherits i JOIN pg_class parent ON parent.oid = i.inhparent "
            "JOIN pg_class child ON child.oid = i.inhrelid "
            "WHERE parent.relname = ANY(%s) AND pg_table_is_visible(parent.oid)",
            [list(tables) if tables is not None else history_tables()])
        found = []
        for table, name, bound in cursor.fetchall():
            match = BOUND.search(bound or "")
            if match:
                found.append(Partition(table, name, int(match[1]), int(match[2])))
    return sorted(found, key=lambda p: (p.table, p.lo))


def last_run_id() -> int:
    """The highest run id the sequence handed out (0: none yet). Ids below it may still be
    in uncommitted transactions; none at or above the next one can appear in a span below."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT COALESCE(pg_sequence_last_value(pg_get_serial_sequence(%s, "
                       "'id')::regclass), 0)", [AgentRun._meta.db_table])
        return int(cursor.fetchone()[0])


def target_bound(high: int, size: int) -> int:
    """Partitions must reach past the span of the next id and one whole span more: a
    worker that runs `ensure` once per span keeps inserts from ever finding no partition.
    E.g. size 1000, high 1499: the next id 1500 is in [1000, 2000); spans up to 3000."""
    return ((high + 1) // size + 2) * size


def partition_name(table: str, lo: int) -> str:
    return f"{table}_p{lo}"


# --------------------------------------------------------------------------- ensure


def plan_ensure(size: int) -> list[Partition]:
    """The partitions `ensure` would create now."""
    tables = partitioned_tables()
    target = target_bound(last_run_id(), size)
    tops: dict[str, int] = {}
    for part in partitions(tables):
        tops[part.table] = max(tops.get(part.table, part.hi), part.hi)
    plan = []
    for table in sorted(tables):
        lo = tops.get(table, (last_run_id() + 1) // size * size)
        while lo < target:
            plan.append(Partition(table, partition_name(table, lo), lo, lo + size))
            lo += size
    return plan


def ensure(*, dry_run: bool = False) -> Report:
    """Create the partitions the id sequence will need soon. Leaderless: any worker may
    call it; a try-lock lets one process do the DDL and the others skip (IF NOT EXISTS
    makes even a second pass harmless)."""
    report = Report()
    size = span()
    if size is None:
        return report
    plan = plan_ensure(size)
    if dry_run or not plan:
        report.created = [p.name for p in plan]
        return report
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [ENSURE_LOCK])
        if not cursor.fetchone()[0]:
            report.busy = True
            return report
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        for part in plan_ensure(size):  # re-planned under the lock
            create_partition(cursor, part)
            report.created.append(part.name)
    return report


def create_partition(cursor: CursorWrapper, part: Partition) -> None:
    q = connection.ops.quote_name
    cursor.execute(f"CREATE TABLE IF NOT EXISTS {q(part.name)} PARTITION OF {q(part.table)} "
                   f"FOR VALUES FROM ({int(part.lo)}) TO ({int(part.hi)})")


# --------------------------------------------------------------------------- enqueue's guard

_known_top: dict[str, int] = {}  # database alias: the lowest top bound over the tables


def no_partition(error: BaseException) -> bool:
    """Whether `error` (psycopg's, or Django's wrapping it) is an INSERT into a span that
    has no partition yet."""
    for exc in (error, error.__cause__):
        if getattr(exc, "sqlstate", None) == "23514" and "no partition" in str(exc):
            return True
    return False


def keep_ahead(highest_id: int) -> None:
    """After an enqueue: when its ids near the partitions' top (less than half a span
    left), make the next ones, as a worker's chores would (now, or once the caller's
    transaction commits: DDL inside it would hold its locks until then). One catalog read
    per process until then; nothing when history is not partitioned."""
    size = span()
    if size is None:
        return
    alias = connection.alias
    top = _known_top.get(alias)
    if top is None:
        top = _known_top[alias] = _lowest_top()
    if highest_id + size // 2 < top:
        return
    if connection.in_atomic_block:
        transaction.on_commit(lambda: _ensure_and_look(alias))
    else:
        _ensure_and_look(alias)


def forget_top() -> None:
    """Drop the cached top of the partitions (a test whose layout was rolled back)."""
    _known_top.clear()


def _ensure_and_look(alias: str) -> None:
    ensure()
    _known_top[alias] = _lowest_top()


def _lowest_top() -> int:
    tops: dict[str, int] = {}
    for part in partitions(partitioned_tables()):
        tops[part.table] = max(tops.get(part.table, part.hi), part.hi)
    return min(tops.values(), default=0)


def make_room() -> None:
    """An enqueue found no partition for its runs: make them (outside any transaction)."""
    _ensure_and_look(connection.alias)
