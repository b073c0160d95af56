# Narrow hot row (issue #29), last part: a run's input and output out of the run row into
# the append-only payload table (AgentRun.input and .output read them through). Set-based
# SQL: one INSERT ... SELECT per kind; the default input ({}) and a None output stay no
# row. On a partitioned payload table (0020), a partition is made for every span of runs
# whose values move in. Imports nothing of the package's live code (it reads the
# HISTORY_PARTITION setting, as 0018 and 0020 do).

from importlib import import_module

from django.conf import settings
from django.db import migrations

RUNS = "django_agentruns_agentrun"
PAYLOADS = "django_agentruns_runpayload"
EMPTY = {"postgresql": "'{}'::jsonb", "sqlite": "'{}'"}
NULL = {"postgresql": "'null'::jsonb", "sqlite": "'null'"}
MOVED = ("(input <> {empty}) OR (output IS NOT NULL AND output <> {null})")


def _size(connection):
    size = (getattr(settings, "AGENTRUNS", None) or {}).get("HISTORY_PARTITION")
    return int(size) if connection.vendor == "postgresql" and size else None


def partition_spans(apps, schema_editor):
    """A partition of the payload table for every span of runs whose values move in (when
    that table is partitioned)."""
    connection = schema_editor.connection
    size = _size(connection)
    if size is None:
        return
    q = connection.ops.quote_name
    with connection.cursor() as cursor:
        if not import_module("django_agentruns.migrations.0020_payload_traceback") \
                ._partitioned(cursor, PAYLOADS):
            return
        moved = MOVED.format(empty=EMPTY["postgresql"], null=NULL["postgresql"])
        cursor.execute(f"SELECT DISTINCT id / %s * %s FROM {RUNS} WHERE {moved}",
                       [size, size])
        for (lo,) in cursor.fetchall():
            cursor.execute(f"CREATE TABLE IF NOT EXISTS {q(f'{PAYLOADS}_p{lo}')} PARTITION OF "
                           f"{q(PAYLOADS)} FOR VALUES FROM ({int(lo)}) TO ({int(lo) + size})")


def move_out(apps, schema_editor):
    connection = schema_editor.connection
    vendor = connection.vendor
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {PAYLOADS} (run_id, kind, value, created_at) "
                       f"SELECT id, 'input', input, created_at FROM {RUNS} "
                       f"WHERE input <> {EMPTY[vendor]} ORDER BY id")
        cursor.execute(f"INSERT INTO {PAYLOADS} (run_id, kind, value, created_at) "
                       f"SELECT id, 'output', output, COALESCE(finished_at, created_at) "
                       f"FROM {RUNS} WHERE output IS NOT NULL AND output <> {NULL[vendor]} "
                       f"ORDER BY id")


def move_back(apps, schema_editor):
    """The columns are back (RemoveField reversed): each run's latest values return to
    them, and their payload rows go."""
    connection = schema_editor.connection
    vendor = connection.vendor

    def latest(kind):
        return (f"(SELECT p.value FROM {PAYLOADS} p WHERE p.run_id = {RUNS}.id "
                f"AND p.kind = '{kind}' ORDER BY p.id DESC LIMIT 1)")

    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {RUNS} SET input = COALESCE({latest('input')}, "
                       f"{EMPTY[vendor]}), output = {latest('output')}")
        cursor.execute(f"DELETE FROM {PAYLOADS} WHERE kind IN ('input', 'output')")


class Migration(migrations.Migration):

    atomic = True

    dependencies = [
        ('django_agentruns', '0020_payload_traceback'),
    ]

    operations = [
        migrations.RunPython(partition_spans, migrations.RunPython.noop, elidable=False),
        migrations.RunPython(move_out, move_back, elidable=False),
        migrations.RemoveField(model_name='agentrun', name='input'),
        migrations.RemoveField(model_name='agentrun', name='output'),
    ]
