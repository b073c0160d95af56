"""Runs that wait: the `waiting` status, the RunWait table, parent and child runs.

On PostgreSQL two more triggers: a run a delivery (or its children, or its deadline) sends
back to the queue wakes the queue's workers like an operator's retry does, and a run that
finishes NOTIFYs `agentruns_finished` with its id, for `wait_for_run`. Both are per row with
a WHEN clause, so UPDATEs that leave status alone (renewals) skip them.
"""

import django.db.models.deletion
from django.db import migrations, models

CHANNEL = "agentruns"  # the workers' wake-up channel, as it was when written; a migration
# never imports live code, which may move or change

FINISHED_CHANNEL = "agentruns_finished"  # django_agentruns.waiting.FINISHED_CHANNEL


class WaitTriggers(migrations.operations.base.Operation):
    """Creates the triggers on PostgreSQL (drops them backwards); nothing elsewhere."""

    reversible = True

    def state_forwards(self, app_label, state):
        pass

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor == "postgresql":
            table = self.table(schema_editor, to_state)
            for statement in [
                f"""CREATE FUNCTION agentruns_notify_finished() RETURNS trigger
                    LANGUAGE plpgsql AS $$
                    BEGIN
                        PERFORM pg_notify('{FINISHED_CHANNEL}', NEW.id::text);
                        RETURN NULL;
                    END $$""",
                f"""CREATE TRIGGER agentruns_notify_finish AFTER UPDATE OF status ON {table}
                    FOR EACH ROW WHEN (NEW.status IN ('succeeded', 'failed', 'cancelled')
                                       AND OLD.status IS DISTINCT FROM NEW.status)
                    EXECUTE FUNCTION agentruns_notify_finished()""",
                f"""CREATE FUNCTION agentruns_notify_resumed() RETURNS trigger
                    LANGUAGE plpgsql AS $$
                    BEGIN
                        PERFORM pg_notify('{CHANNEL}', NEW.queue);
                        RETURN NULL;
                    END $$""",
                f"""CREATE TRIGGER agentruns_notify_resume AFTER UPDATE OF status ON {table}
                    FOR EACH ROW WHEN (NEW.status = 'queued' AND OLD.status = 'waiting')
                    EXECUTE FUNCTION agentruns_notify_resumed()""",
            ]:
                schema_editor.execute(statement)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor == "postgresql":
            table = self.table(schema_editor, from_state)
            for statement in [
                f"DROP TRIGGER IF EXISTS agentruns_notify_resume ON {table}",
                "DROP FUNCTION IF EXISTS agentruns_notify_resumed()",
                f"DROP TRIGGER IF EXISTS agentruns_notify_finish ON {table}",
                "DROP FUNCTION IF EXISTS agentruns_notify_finished()",
            ]:
                schema_editor.execute(statement)

    def describe(self):
        return f"PostgreSQL triggers: resumed runs NOTIFY {CHANNEL}, finished runs " \
               f"{FINISHED_CHANNEL}"

    @staticmethod
    def table(schema_editor, state):
        model = state.apps.get_model("django_agentruns", "AgentRun")
        return schema_editor.quote_name(model._meta.db_table)


class Migration(migrations.Migration):

    dependencies = [
        ('django_agentruns', '0003_workers'),
    ]

    operations = [
        migrations.CreateModel(
            name='RunWait',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('key', models.CharField(max_length=210)),
                ('kind', models.CharField(choices=[('input', 'Input'), ('approval', 'Approval'), ('runs', 'Child runs')], default='input', max_length=16)),
                ('prompt', models.JSONField(blank=True, help_text='For whoever answers.', null=True)),
                ('deadline', models.DateTimeField(blank=True, null=True)),
                ('waited_at', models.DateTimeField(blank=True, help_text='Last time it waited.', null=True)),
                ('timed_out_at', models.DateTimeField(blank=True, null=True)),
                ('payload', models.JSONField(blank=True, null=True)),
                ('delivered_at', models.DateTimeField(blank=True, null=True)),
                ('delivered_by', models.CharField(blank=True, default='', max_length=255)),
            ],
            options={
                'ordering': ('run', 'id'),
            },
        ),
        migrations.AlterModelOptions(
            name='agentrun',
            options={'ordering': ('-id',), 'permissions': (('retry_agentrun', 'Can retry failed or cancelled runs'), ('cancel_agentrun', 'Can cancel queued or running runs'), ('approve_agentrun', 'Can approve or reject what a waiting run proposes'))},
        ),
        migrations.AddField(
            model_name='agentrun',
            name='parent',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='children', to='django_agentruns.agentrun'),
        ),
        migrations.AddField(
            model_name='agentrun',
            name='spawn_key',
            field=models.CharField(blank=True, default='', max_length=200),
        ),
        migrations.AddField(
            model_name='agentrun',
            name='wait_until',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='agentrun',
            name='wait_key',
            field=models.CharField(blank=True, default='', max_length=210),
        ),
        migrations.AlterField(
            model_name='agentrun',
            name='status',
            field=models.CharField(choices=[('queued', 'Queued'), ('running', 'Running'), ('waiting', 'Waiting'), ('succeeded', 'Succeeded'), ('failed', 'Failed'), ('cancelled', 'Cancelled')], default='queued', max_length=16),
        ),
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(condition=models.Q(('status', 'waiting'), ('wait_until__isnull', False)), fields=['wait_until'], name='agentruns_wait_until'),
        ),
        migrations.AddConstraint(
            model_name='agentrun',
            constraint=models.UniqueConstraint(condition=models.Q(('spawn_key', ''), _negated=True), fields=('parent', 'spawn_key'), name='agentruns_spawn_key'),
        ),
        migrations.AddField(
            model_name='runwait',
            name='run',
            field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='waits', to='django_agentruns.agentrun'),
        ),
        migrations.AddConstraint(
            model_name='runwait',
            constraint=models.UniqueConstraint(fields=('run', 'key'), name='agentruns_wait_run_key'),
        ),
        WaitTriggers(),
    ]
