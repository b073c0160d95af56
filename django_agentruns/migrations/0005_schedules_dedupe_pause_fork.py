"""Schedules, dedupe keys, paused queues, checkpoint history and forks.

Numbered 0004 and depending on 0002: the worker registry (0003) is merged first and
this is re-pointed at it then."""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_agentruns', '0004_waiting'),
    ]

    operations = [
        migrations.CreateModel(
            name='PausedQueue',
            fields=[
                ('name', models.CharField(max_length=100, primary_key=True, serialize=False)),
                ('paused_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('paused_by', models.CharField(blank=True, default='', max_length=255)),
            ],
            options={
                'ordering': ('name',),
            },
        ),
        migrations.CreateModel(
            name='RunCheckpoint',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('number', models.PositiveIntegerField(help_text='From 1, in the order saved.')),
                ('state', models.JSONField(blank=True, null=True)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
            ],
            options={
                'ordering': ('run', 'number'),
            },
        ),
        migrations.CreateModel(
            name='Schedule',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('name', models.CharField(max_length=200, unique=True)),
                ('agent', models.CharField(max_length=200)),
                ('cron', models.CharField(blank=True, default='', help_text='Cron expression (5 fields), in `tz`.', max_length=200)),
                ('every', models.PositiveIntegerField(blank=True, help_text='Seconds between ticks, aligned to the epoch.', null=True)),
                ('tz', models.CharField(blank=True, default='', help_text='IANA time zone of the cron expression; empty: TIME_ZONE.', max_length=64)),
                ('input', models.JSONField(blank=True, default=dict, help_text="Each run's input; its `tick` key is set to the tick.")),
                ('catch_up', models.BooleanField(default=False, help_text='Run every missed tick, not only the latest.')),
                ('enabled', models.BooleanField(default=True, help_text='Untick to pause the schedule.')),
                ('origin', models.CharField(choices=[('code', '@agent(schedule=/every=)'), ('database', 'add_schedule / admin')], default='database', max_length=16)),
                ('last_tick', models.DateTimeField(blank=True, help_text='The latest tick a run was enqueued for.', null=True)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('updated_at', models.DateTimeField(auto_now=True)),
            ],
            options={
                'ordering': ('name',),
            },
        ),
        migrations.AddField(
            model_name='agentrun',
            name='dedupe_key',
            field=models.CharField(blank=True, default='', help_text='While the run is unfinished, enqueueing its agent with this key returns it.', max_length=255),
        ),
        migrations.AddField(
            model_name='agentrun',
            name='forked_from',
            field=models.ForeignKey(blank=True, help_text='The run this one was forked from (`fork`), starting at one of its checkpoints.', null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='forks', to='django_agentruns.agentrun'),
        ),
        migrations.AddConstraint(
            model_name='agentrun',
            constraint=models.UniqueConstraint(condition=models.Q(('status__in', ('queued', 'running', 'waiting')), models.Q(('dedupe_key', ''), _negated=True)), fields=('agent', 'dedupe_key'), name='agentruns_dedupe'),
        ),
        migrations.AddField(
            model_name='runcheckpoint',
            name='run',
            field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='checkpoints', to='django_agentruns.agentrun'),
        ),
        migrations.AddConstraint(
            model_name='runcheckpoint',
            constraint=models.UniqueConstraint(fields=('run', 'number'), name='agentruns_checkpoint_number'),
        ),
    ]
