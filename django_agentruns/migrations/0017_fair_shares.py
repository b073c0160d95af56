# Fair shares (issue 28): a run's fairness group, each group's virtual time, and the
# index the fair claim reads each group's due runs through; the index of failover at the
# claim (queued runs with a list of keys).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_agentruns', '0016_steps_copied'),
    ]

    operations = [
        migrations.CreateModel(
            name='FairGroup',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('queue', models.CharField(max_length=100)),
                ('key', models.CharField(blank=True, max_length=200)),
                ('vtime', models.FloatField(default=0.0)),
            ],
            options={
                'verbose_name': 'fairness group',
                'verbose_name_plural': 'fairness groups',
            },
        ),
        migrations.AddField(
            model_name='agentrun',
            name='fair_key',
            field=models.CharField(blank=True, default='', max_length=200),
        ),
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(condition=models.Q(('limit_keys__isnull', False), ('status', 'queued')), fields=['limit_key'], name='agentruns_key_failover'),
        ),
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(condition=models.Q(('status', 'queued')), fields=['queue', 'fair_key', '-priority', 'available_at', 'fired_seq', 'id'], name='agentruns_fair_due'),
        ),
        migrations.AddConstraint(
            model_name='fairgroup',
            constraint=models.UniqueConstraint(fields=('queue', 'key'), name='agentruns_fair_group'),
        ),
    ]
