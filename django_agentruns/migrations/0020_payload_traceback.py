# Narrow hot row (issue #29), second part: the append-only payload table, and the error
# traceback out of the run row into it (AgentRun.error_traceback reads it through). With
# HISTORY_PARTITION on a partitioned history (PostgreSQL), the new table is partitioned
# like the others, by 0018's frozen `partition_table`. Set-based SQL; imports nothing of
# the package's live code (it reads the HISTORY_PARTITION setting, as 0018 does).

from importlib import import_module

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models

RUNS = "django_agentruns_agentrun"
PAYLOADS = "django_agentruns_runpayload"
CHECKPOINTS = "django_agentruns_runcheckpoint"
JSON_OF = {"postgresql": "to_jsonb(error_traceback)", "sqlite": "json_quote(error_traceback)"}
TEXT_OF = {"postgresql": "p.value #>> '{}'", "sqlite": "json_extract(p.value, '$')"}


def _size(connection):
    size = (getattr(settings, "AGENTRUNS", None) or {}).get("HISTORY_PARTITION")
    return int(size) if connection.vendor == "postgresql" and size else None


def _partitioned(cursor, table):
    cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_partitioned_table p JOIN pg_class c "
                   "ON c.oid = p.partrelid WHERE c.relname = %s)", [table])
    return cursor.fetchone()[0]


def partition_payloads(apps, schema_editor):
    """Partitioned like the history already is (not on an install still to convert: its
    `partitions convert` takes this table too), with a partition for every span of runs
    whose traceback moves in."""
    connection = schema_editor.connection
    size = _size(connection)
    if size is None:
        return
    q = connection.ops.quote_name
    with connection.cursor() as cursor:
        if not _partitioned(cursor, CHECKPOINTS):
            return
        frozen = import_module("django_agentruns.migrations.0018_partitioned_history")
        frozen.partition_table(cursor, PAYLOADS, RUNS, size)
        cursor.execute(f"SELECT DISTINCT id / %s * %s FROM {RUNS} WHERE error_traceback <> ''",
                       [size, size])
        for (lo,) in cursor.fetchall():
            cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON "
                           "c.oid = i.inhrelid WHERE i.inhparent = %s::regclass AND "
                           "c.relname = %s)", [PAYLOADS, f"{PAYLOADS}_p{lo}"])
            if not cursor.fetchone()[0]:
                cursor.execute(f"CREATE TABLE {q(f'{PAYLOADS}_p{lo}')} PARTITION OF "
                               f"{q(PAYLOADS)} FOR VALUES FROM ({int(lo)}) "
                               f"TO ({int(lo) + size})")


def move_out(apps, schema_editor):
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {PAYLOADS} (run_id, kind, value, created_at) "
                       f"SELECT id, 'traceback', {JSON_OF[connection.vendor]}, "
                       f"COALESCE(finished_at, started_at, created_at) FROM {RUNS} "
                       f"WHERE error_traceback <> ''")


def move_back(apps, schema_editor):
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {RUNS} SET error_traceback = COALESCE((SELECT "
                       f"{TEXT_OF[connection.vendor]} FROM {PAYLOADS} p WHERE p.run_id = "
                       f"{RUNS}.id AND p.kind = 'traceback' ORDER BY p.id DESC LIMIT 1), '')")


class Migration(migrations.Migration):

    atomic = True

    dependencies = [
        ('django_agentruns', '0019_payload_checkpoint_state'),
    ]

    operations = [
        migrations.CreateModel(
            name='RunPayload',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('kind', models.CharField(max_length=20)),
                ('value', models.JSONField(blank=True, null=True)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('run', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE,
                                          related_name='+', to='django_agentruns.agentrun')),
            ],
            options={
                'verbose_name': 'run payload',
                'verbose_name_plural': 'run payloads',
                'indexes': [models.Index(fields=['run', 'kind', 'id'],
                                         name='agentruns_payload_kind')],
            },
        ),
        migrations.RunPython(partition_payloads, migrations.RunPython.noop, elidable=False),
        migrations.RunPython(move_out, move_back, elidable=False),
        migrations.RemoveField(model_name='agentrun', name='error_traceback'),
    ]
