# A fork given its origin's step records says so: a run's first attempt holds its steps'
# starts (runtime.steps) only when it has none.

from django.db import migrations, models
from django.db.models import Exists, OuterRef


def mark_copies(apps, schema_editor):
    """A run not yet started that holds step records already (a fork made before this
    field) is marked, so its first attempt looks them up."""
    AgentRun = apps.get_model('django_agentruns', 'AgentRun')
    RunStep = apps.get_model('django_agentruns', 'RunStep')
    AgentRun.objects.filter(attempt=0).filter(
        Exists(RunStep.objects.filter(run_id=OuterRef('pk')))).update(steps_copied=True)


class Migration(migrations.Migration):

    dependencies = [
        ('django_agentruns', '0015_graph_checkpoints'),
    ]

    operations = [
        migrations.AddField(
            model_name='agentrun',
            name='steps_copied',
            field=models.BooleanField(default=False, help_text='A fork given step records of its origin: its first attempt looks its steps up like any later one.'),
        ),
        migrations.RunPython(mark_copies, migrations.RunPython.noop),
    ]
