# Cheaper history writes (issue #30): seven history tables had Django's index on their run
# foreign key beside a unique key or index that already leads with the run
# (`agentruns_event_run_seq`, `agentruns_checkpoint_number`, `agentruns_step_occurrence`,
# `agentruns_usage_key`, `agentruns_wait_run_key`, `agentruns_chunk_run`,
# `agentruns_window_run`): every event, checkpoint and step paid one more index insert for
# nothing a read needs. Those indexes go (on a partitioned layout the parent's index, and
# its partitions' with it); the foreign keys stay as they are. Imports nothing of the
# package's live code.

import django.db.models.deletion
from django.db import migrations, models

# Django's names for the foreign keys' indexes (made by 0001, 0004, 0006, 0007, 0010,
# 0011 and 0013), with their tables.
RUN_INDEXES = (
    ("django_agentruns_runevent_run_id_ff383412", "django_agentruns_runevent"),
    ("django_agentruns_runwait_run_id_745fc86c", "django_agentruns_runwait"),
    ("django_agentruns_runcheckpoint_run_id_b837bb23", "django_agentruns_runcheckpoint"),
    ("django_agentruns_streamchunk_run_id_3fbb36f2", "django_agentruns_streamchunk"),
    ("django_agentruns_runstep_run_id_61176eff", "django_agentruns_runstep"),
    ("django_agentruns_keywindowentry_run_id_6130d298", "django_agentruns_keywindowentry"),
    ("django_agentruns_runusage_run_id_0d6a5310", "django_agentruns_runusage"),
)


def drop_run_indexes(apps, schema_editor):
    q = schema_editor.connection.ops.quote_name
    for name, _ in RUN_INDEXES:
        schema_editor.execute(f"DROP INDEX IF EXISTS {q(name)}")


def make_run_indexes(apps, schema_editor):
    q = schema_editor.connection.ops.quote_name
    for name, table in RUN_INDEXES:
        schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {q(name)} ON {q(table)} (run_id)")


class Migration(migrations.Migration):

    dependencies = [
        ('django_agentruns', '0024_narrow_indexes'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='keywindowentry',
                    name='run',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='django_agentruns.agentrun'),
                ),
                migrations.AlterField(
                    model_name='runcheckpoint',
                    name='run',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='checkpoints', to='django_agentruns.agentrun'),
                ),
                migrations.AlterField(
                    model_name='runevent',
                    name='run',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='events', to='django_agentruns.agentrun'),
                ),
                migrations.AlterField(
                    model_name='runstep',
                    name='run',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='steps', to='django_agentruns.agentrun'),
                ),
                migrations.AlterField(
                    model_name='runusage',
                    name='run',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='usage_records', to='django_agentruns.agentrun'),
                ),
                migrations.AlterField(
                    model_name='runwait',
                    name='run',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='waits', to='django_agentruns.agentrun'),
                ),
                migrations.AlterField(
                    model_name='streamchunk',
                    name='run',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='django_agentruns.agentrun'),
                ),
            ],
            database_operations=[migrations.RunPython(drop_run_indexes, make_run_indexes)],
        ),
    ]
