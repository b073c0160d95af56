# Narrow hot row (issue #29), first part: the resume state leaves the run row. A run's
# state is its checkpoint history's row number `checkpoint_count` (AgentRun.checkpoint_state
# reads it through), so a checkpoint no longer rewrites a TOASTed JSON value inside the row
# that claims and renewals update. Set-based SQL; imports nothing of the package (it reads
# the HISTORY_PARTITION setting, as 0018 does).

from django.conf import settings
from django.db import migrations

RUNS = "django_agentruns_agentrun"
CHECKPOINTS = "django_agentruns_runcheckpoint"

# The run row's state wins over a history row of the same number: a version migration
# (`@agent(migrate=)`) rewrote only the run row's until now.
HELD = (f"SELECT 1 FROM {RUNS} r WHERE r.id = {CHECKPOINTS}.run_id "
        f"AND r.checkpoint_count = {CHECKPOINTS}.number AND r.checkpoint_state IS NOT NULL")
MOVE_OUT = [
    f"DELETE FROM {CHECKPOINTS} WHERE EXISTS ({HELD})",
    f"INSERT INTO {CHECKPOINTS} (run_id, number, state, created_at) "
    f"SELECT id, checkpoint_count, checkpoint_state, COALESCE(started_at, created_at) "
    f"FROM {RUNS} WHERE checkpoint_state IS NOT NULL",
]
MOVE_BACK = [
    f"UPDATE {RUNS} SET checkpoint_state = (SELECT c.state FROM {CHECKPOINTS} c "
    f"WHERE c.run_id = {RUNS}.id AND c.number = {RUNS}.checkpoint_count)",
]


def partitions_for_states(apps, schema_editor):
    """Partitioned history (PostgreSQL): a span of runs older than the layout may have no
    partition yet; make the ones the moved states need (named as ops.partitions names them)."""
    connection = schema_editor.connection
    size = (getattr(settings, "AGENTRUNS", None) or {}).get("HISTORY_PARTITION")
    if connection.vendor != "postgresql" or not size:
        return
    q = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_partitioned_table p JOIN pg_class c "
                       "ON c.oid = p.partrelid WHERE c.relname = %s)", [CHECKPOINTS])
        if not cursor.fetchone()[0]:
            return
        cursor.execute(f"SELECT DISTINCT id / %s * %s FROM {RUNS} "
                       f"WHERE checkpoint_state IS NOT NULL", [int(size), int(size)])
        for (lo,) in cursor.fetchall():
            cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON "
                           "c.oid = i.inhrelid WHERE i.inhparent = %s::regclass AND "
                           "c.relname = %s)", [CHECKPOINTS, f"{CHECKPOINTS}_p{lo}"])
            if not cursor.fetchone()[0]:
                cursor.execute(f"CREATE TABLE {q(f'{CHECKPOINTS}_p{lo}')} PARTITION OF "
                               f"{q(CHECKPOINTS)} FOR VALUES FROM ({int(lo)}) "
                               f"TO ({int(lo) + int(size)})")


class Migration(migrations.Migration):

    atomic = True

    dependencies = [
        ('django_agentruns', '0018_partitioned_history'),
    ]

    operations = [
        migrations.RunPython(partitions_for_states, migrations.RunPython.noop, elidable=False),
        migrations.RunSQL(MOVE_OUT, MOVE_BACK, elidable=False),
        migrations.RemoveField(model_name='agentrun', name='checkpoint_state'),
    ]
