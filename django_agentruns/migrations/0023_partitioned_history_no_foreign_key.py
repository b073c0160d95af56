# Partitioned history carries no database foreign key to the run table (issue #29): purge
# deletes a run's rows itself, and a partition drops whole. Migration 0020 partitioned the
# new payload table inside the migration that created it, before Django added the table's
# deferred foreign key, which so landed on the partitioned table of a fresh install. Drop
# such keys (PostgreSQL; a plain table keeps its own). Imports nothing of the live code.

from django.db import migrations

RUNS = "django_agentruns_agentrun"


def drop_foreign_keys(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        return
    q = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute("SELECT c.conrelid::regclass::text, c.conname FROM pg_constraint c "
                       "JOIN pg_partitioned_table p ON p.partrelid = c.conrelid WHERE "
                       "c.contype = 'f' AND c.confrelid = %s::regclass AND c.conparentid = 0",
                       [RUNS])
        for table, name in cursor.fetchall():
            cursor.execute(f"ALTER TABLE {table} DROP CONSTRAINT {q(name)}")


class Migration(migrations.Migration):

    dependencies = [
        ("django_agentruns", "0022_fair_vstart"),
    ]

    operations = [
        migrations.RunPython(drop_foreign_keys, migrations.RunPython.noop, elidable=False),
    ]
