# LangGraph checkpoint saver tables (integrations.langgraph), after main's last migration.

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_agentruns', '0014_translatable_labels'),
    ]

    operations = [
        migrations.CreateModel(
            name='GraphWrite',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('thread_id', models.CharField(max_length=255)),
                ('checkpoint_ns', models.CharField(blank=True, default='', max_length=255)),
                ('checkpoint_id', models.CharField(max_length=64)),
                ('task_id', models.CharField(max_length=255)),
                ('idx', models.IntegerField()),
                ('channel', models.CharField(max_length=255)),
                ('type', models.CharField(max_length=32)),
                ('value', models.BinaryField()),
                ('task_path', models.CharField(blank=True, default='', max_length=255)),
            ],
            options={
                'ordering': ('thread_id', 'checkpoint_ns', 'checkpoint_id', 'task_id', 'idx'),
                'constraints': [models.UniqueConstraint(fields=('thread_id', 'checkpoint_ns', 'checkpoint_id', 'task_id', 'idx'), name='agentruns_graph_write')],
            },
        ),
        migrations.CreateModel(
            name='GraphCheckpoint',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('thread_id', models.CharField(max_length=255)),
                ('checkpoint_ns', models.CharField(blank=True, default='', max_length=255)),
                ('checkpoint_id', models.CharField(max_length=64)),
                ('parent_checkpoint_id', models.CharField(blank=True, default='', max_length=64)),
                ('type', models.CharField(max_length=32)),
                ('checkpoint', models.BinaryField()),
                ('metadata_type', models.CharField(max_length=32)),
                ('metadata', models.BinaryField()),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('run', models.ForeignKey(blank=True, db_constraint=False, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='django_agentruns.agentrun')),
            ],
            options={
                'ordering': ('thread_id', 'checkpoint_ns', 'checkpoint_id'),
                'constraints': [models.UniqueConstraint(fields=('thread_id', 'checkpoint_ns', 'checkpoint_id'), name='agentruns_graph_checkpoint')],
            },
        ),
    ]
