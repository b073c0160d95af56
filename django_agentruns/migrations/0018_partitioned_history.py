# Partitioned history (HISTORY_PARTITION, docs/history.md): on PostgreSQL with the setting
# on, the history tables are rebuilt as tables range-partitioned by run id. Reads the
# setting; imports nothing of the package (a frozen copy of ops.partitions.partition_table).
# Only empty tables are rebuilt here: an install with history moves it with
# `manage.py partitions convert`, which says first how long it holds each table.

from django.conf import settings
from django.db import migrations

HISTORY_TABLES = (
    "django_agentruns_runevent", "django_agentruns_runcheckpoint", "django_agentruns_runwait",
    "django_agentruns_runstep", "django_agentruns_runusage", "django_agentruns_streamchunk",
)
RUNS = "django_agentruns_agentrun"


def partition_history(apps, schema_editor):
    connection = schema_editor.connection
    size = (getattr(settings, "AGENTRUNS", None) or {}).get("HISTORY_PARTITION")
    if connection.vendor != "postgresql" or not size:
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT c.relname FROM pg_partitioned_table p JOIN pg_class c "
                       "ON c.oid = p.partrelid WHERE c.relname = ANY(%s)", [list(HISTORY_TABLES)])
        done = {row[0] for row in cursor.fetchall()}
        for table in HISTORY_TABLES:
            if table in done:
                continue
            cursor.execute(f"SELECT EXISTS (SELECT 1 FROM {connection.ops.quote_name(table)})")
            if cursor.fetchone()[0]:
                print(f"\n  {table} holds rows: left plain; move it with "
                      "`manage.py partitions convert` (docs/history.md)")
                continue
            partition_table(cursor, table, RUNS, int(size))


def partition_table(cursor, table, runs, size):
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


class Migration(migrations.Migration):

    atomic = True

    dependencies = [
        ('django_agentruns', '0017_fair_shares'),
    ]

    operations = [
        migrations.RunPython(partition_history, migrations.RunPython.noop, elidable=False),
    ]
