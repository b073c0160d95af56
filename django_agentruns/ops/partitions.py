"""Partitioned history (PostgreSQL, `AGENTRUNS["HISTORY_PARTITION"]`): create partitions
ahead, drop the ones whose runs are all gone, move plain tables into the layout.

Each history table is range-partitioned by run id in fixed spans of `HISTORY_PARTITION`
ids: run ids rise with time, so a span is a stretch of days, and a partition can be made
before any of its runs exists. A span is dropped only when it is old (the id sequence has
passed its end, so no new run can land in it) and empty (no run of it is left in the run
table: a run waiting a week for an approval keeps its span a week). Dropping a partition
unlinks its files: seconds, no dead tuples, no WAL per row, where a DELETE writes both.

Django still sees `id` as each model's primary key; the SQL primary key is `(id, run_id)`
(a partitioned table's unique keys must hold the partition key), so the ORM's lookups,
updates and deletes by `id` use it unchanged, and every other unique key gets `run_id`
in front (events: `(run_id, event_id)`). No foreign key points at these tables, nor from
them to the run table: `purge` deletes runs and leaves their history to the drop.

Migration 0016 builds the same layout on a fresh install (its own frozen copy of
`partition_table`, as migrations import nothing live).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from django.db import OperationalError, connection, transaction
from django.db.backends.utils import CursorWrapper
from django.db.models import Q

from ..models import AgentRun
from ..partitioning import (
    BOUND,
    ENSURE_LOCK,
    HISTORY_MODELS,
    LOCK_TIMEOUT,
    Partition,
    Report,
    create_partition,
    ensure,
    history_tables,
    last_run_id,
    partition_name,
    partitioned_tables,
    partitions,
    plan_ensure,
    span,
    target_bound,
)

__all__ = [  # the ensure step lives in ..partitioning (enqueue uses it); read from here too
    "BOUND",
    "ENSURE_LOCK",
    "HISTORY_MODELS",
    "LOCK_TIMEOUT",
    "Partition",
    "Report",
    "TableEstimate",
    "convert",
    "create_partition",
    "drop",
    "droppable",
    "ensure",
    "estimate_conversion",
    "history_tables",
    "last_run_id",
    "layout_problems",
    "partition_name",
    "partition_table",
    "partitioned_tables",
    "partitions",
    "plan_ensure",
    "setting_problem",
    "span",
    "target_bound",
]

# --------------------------------------------------------------------------- drop


def droppable(parts: list[Partition], high: int, going: Q | None = None,
              ) -> tuple[list[Partition], list[str]]:
    """Of `parts`, those whose span is old (every id of it handed out) and empty (no run of
    it in the run table, or none but the runs `going` matches: a purge's dry run); and why
    each other old span stays."""
    keep: list[str] = []
    go: list[Partition] = []
    for lo, hi in sorted({(p.lo, p.hi) for p in parts if p.hi - 1 <= high}):
        alive = AgentRun.objects.filter(id__gte=lo, id__lt=hi)
        if going is not None:
            alive = alive.exclude(going)
        left = alive.count()
        if left:
            keep.append(f"runs {lo}..{hi - 1}: {left} run(s) not purged")
        else:
            go.extend(p for p in parts if (p.lo, p.hi) == (lo, hi))
    return go, keep


def drop(*, dry_run: bool = False, going: Q | None = None) -> Report:
    """Detach and drop every partition whose runs are all purged.

    The check holds the run table in SHARE mode: it waits for transactions that inserted
    runs and have not committed (an id handed out, its row not yet visible), so "no run in
    the span" is true of committed and uncommitted runs alike; and since the sequence has
    passed the span, no later run can land in it. The lock is given up before the drops,
    which then take each table's lock only for a moment. `going` (dry run only): count the
    runs it matches as purged already.
    """
    report = Report()
    if not partitioned_tables():
        return report
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        try:
            with transaction.atomic():
                cursor.execute(f"LOCK TABLE {connection.ops.quote_name(AgentRun._meta.db_table)}"
                               " IN SHARE MODE")
        except OperationalError:  # lock_timeout: a long transaction holds it; next time
            report.busy = True
            return report
        go, report.kept = droppable(partitions(partitioned_tables()), last_run_id(),
                                    going if dry_run else None)
    if dry_run:
        report.dropped = [p.name for p in go]
        return report
    q = connection.ops.quote_name
    for part in go:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
            cursor.execute(f"ALTER TABLE {q(part.table)} DETACH PARTITION {q(part.name)}")
            cursor.execute(f"DROP TABLE {q(part.name)}")
        report.dropped.append(part.name)
    return report


# --------------------------------------------------------------------------- convert


@dataclass
class TableEstimate:
    table: str
    rows: int
    bytes: int
    seconds: float


def estimate_conversion(sample: int = 20_000) -> list[TableEstimate]:
    """How long `convert` would hold each plain history table: its rows times the time to
    copy a sample of them (into a temporary table, rolled back), doubled for the indexes
    and WAL a real copy writes. Rough, and said to be."""
    out = []
    q = connection.ops.quote_name
    plain = [t for t in history_tables() if t not in partitioned_tables()]
    for table in plain:
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT count(*), pg_total_relation_size(%s) FROM {q(table)}",
                           [table])
            rows, size = cursor.fetchone()
            seconds = 0.0
            if rows:
                with transaction.atomic():
                    cursor.execute(f"CREATE TEMP TABLE agentruns_estimate (LIKE {q(table)} "
                                   "INCLUDING INDEXES) ON COMMIT DROP")
                    started = time.perf_counter()
                    cursor.execute(f"INSERT INTO agentruns_estimate SELECT * FROM {q(table)} "
                                   "LIMIT %s", [sample])
                    took = time.perf_counter() - started
                    transaction.set_rollback(True)
                seconds = 2 * took * rows / min(rows, sample)
        out.append(TableEstimate(table, int(rows), int(size), seconds))
    return out


def convert(size: int) -> list[str]:
    """Move every plain history table into the partitioned layout, each in one transaction
    that holds the table exclusively while its rows are copied (see `estimate_conversion`):
    writes to it wait, reads too. Returns the tables converted."""
    done = []
    for table in history_tables():
        if table in partitioned_tables():
            continue
        with transaction.atomic(), connection.cursor() as cursor:
            partition_table(cursor, table, AgentRun._meta.db_table, size)
        done.append(table)
    return done


def partition_table(cursor: CursorWrapper, table: str, runs: str, size: int) -> None:
    """Rebuild `table` as a table partitioned by run_id with the same columns, checks,
    indexes and id sequence; unique keys gain run_id, foreign keys are left out. Its
    partitions reach from its lowest run id to one whole span past the runs' sequence.
    Migration 0016 keeps a frozen copy of this function: change both or neither."""
    q = cursor.db.ops.quote_name
    cursor.execute("SELECT count(*) FROM pg_constraint WHERE confrelid = %s::regclass", [table])
    if cursor.fetchone()[0]:
        raise RuntimeError(f"{table}: a foreign key points at it; a partitioned table "
                           "cannot be the target of one")
    cursor.execute("SELECT c.conname, c.contype, c.conindid, ARRAY(SELECT a.attname FROM "
                   "unnest(c.conkey) WITH ORDINALITY k(n, i) JOIN pg_attribute a ON "
                   "a.attrelid = c.conrelid AND a.attnum = k.n ORDER BY k.i) FROM pg_constraint "
                   "c WHERE c.conrelid = %s::regclass AND c.contype IN ('p', 'u')", [table])
    keys = cursor.fetchall()
    cursor.execute("SELECT i.indexrelid, c.relname, pg_get_indexdef(i.indexrelid) FROM "
                   "pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = "
                   "%s::regclass", [table])
    indexes = cursor.fetchall()  # their definitions name `table`: run again once it is new
    cursor.execute("SELECT pg_get_serial_sequence(%s, 'id'), COALESCE(pg_sequence_last_value("
                   "pg_get_serial_sequence(%s, 'id')::regclass), 0)", [table, runs])
    sequence, high = cursor.fetchone()
    old = f"{table}__plain"
    cursor.execute(f"ALTER TABLE {q(table)} RENAME TO {q(old)}")
    for oid, name, _ in indexes:  # index names are schema-wide: free them for the new ones
        cursor.execute(f"ALTER INDEX {q(name)} RENAME TO {q(f'agentruns_old_{oid}')}")
    cursor.execute(f"ALTER SEQUENCE {sequence} RENAME TO {q(f'{table}_old_seq')}")
    cursor.execute(f"CREATE TABLE {q(table)} (LIKE {q(old)} INCLUDING DEFAULTS INCLUDING "
                   "CONSTRAINTS INCLUDING STORAGE) PARTITION BY RANGE (run_id)")
    new_sequence = f"{table}_id_seq"
    cursor.execute(f"CREATE SEQUENCE {q(new_sequence)} OWNED BY {q(table)}.id")
    cursor.execute(f"SELECT setval(%s, COALESCE((SELECT max(id) FROM {q(old)}), 0) + 1, false)",
                   [new_sequence])
    cursor.execute(f"ALTER TABLE {q(table)} ALTER COLUMN id SET DEFAULT nextval(%s::regclass)",
                   [new_sequence])
    backing = set()
    for name, kind, index_oid, columns in keys:
        backing.add(index_oid)
        cols = ["id", "run_id"] if kind == "p" else (
            columns if "run_id" in columns else ["run_id", *columns])
        what = "PRIMARY KEY" if kind == "p" else "UNIQUE"
        cursor.execute(f"ALTER TABLE {q(table)} ADD CONSTRAINT {q(name)} {what} "
                       f"({', '.join(q(c) for c in cols)})")
    for oid, _, definition in indexes:
        if oid in backing:
            continue
        if definition.startswith("CREATE UNIQUE") and "run_id" not in definition:
            definition = definition.replace(" USING btree (", " USING btree (run_id, ", 1)
        cursor.execute(definition)
    cursor.execute(f"SELECT COALESCE(min(run_id), %s) FROM {q(old)}", [high + 1])
    lo = min(int(cursor.fetchone()[0]), high + 1) // size * size
    while lo < ((high + 1) // size + 2) * size:  # target_bound(high, size)
        cursor.execute(f"CREATE TABLE {q(f'{table}_p{lo}')} PARTITION OF {q(table)} "
                       f"FOR VALUES FROM ({int(lo)}) TO ({int(lo + size)})")
        lo += size
    cursor.execute(f"INSERT INTO {q(table)} SELECT * FROM {q(old)}")
    # Django's foreign keys are checked at commit: run the old table's checks now, or
    # rows written earlier in this transaction would keep it from being dropped.
    cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    cursor.execute("SET CONSTRAINTS ALL DEFERRED")
    cursor.execute(f"DROP TABLE {q(old)}")


# --------------------------------------------------------------------------- checks


def setting_problem(value: object) -> str | None:
    """What is wrong with a HISTORY_PARTITION value (None: nothing)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1000:
        return f"must be None or a whole number of run ids of at least 1000, not {value!r}"
    return None


def layout_problems() -> list[tuple[str, str]]:
    """(problem, hint) pairs where the database's layout and the setting disagree."""
    if connection.vendor != "postgresql":
        return []
    size, done = span(), partitioned_tables()
    if size is None and done:
        return [("history tables are partitioned but HISTORY_PARTITION is None: no worker "
                 "makes partitions ahead, so event and checkpoint writes fail once the run ids "
                 "pass the last one", "Set AGENTRUNS['HISTORY_PARTITION'] back to a span.")]
    if size is None:
        return []
    plain = sorted(set(history_tables()) - done)
    if plain:
        return [(f"HISTORY_PARTITION is {size} but {', '.join(plain)} are plain tables",
                 "Move them with `manage.py partitions convert` (its --dry-run says how "
                 "long), or set HISTORY_PARTITION back to None.")]
    spans = {p.hi - p.lo for p in partitions()}
    if spans and spans != {size}:
        return [(f"HISTORY_PARTITION is {size} but the existing partitions span "
                 f"{', '.join(map(str, sorted(spans)))} run ids", "New partitions will span "
                 f"{size} ids from the last bound on; set it back if that was not meant.")]
    return []
